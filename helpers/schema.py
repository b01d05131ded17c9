"""What DeepSpeed 0.19 itself accepts in a config, read from its own code: the top-level keys its parser
reads (and their defaults' JSON types), the pydantic models of its blocks, the signatures of the optimizer
and LR schedule named, and its DeepSpeedConfig class on the whole dict. Each check raises ConfigError with
the key path, what it got and what it expects; an unknown key gets the closest valid name.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import json
import math
import typing
from pathlib import PurePath

from helpers.errors import ConfigError

# Top-level keys whose value is a block (a JSON object) though DeepSpeed reads them without a default.
DICT_KEYS = ("zero_optimization", "bf16", "optimizer", "scheduler", "activation_checkpointing", "flops_profiler",
             "aio", "comms_logger")
JSON_NAMES = {dict: "JSON object", bool: "bool (true or false)", int: "number", float: "number", str: "string"}


def did_you_mean(key: str, valid) -> str:
    close = difflib.get_close_matches(str(key), [str(v) for v in valid], n=1)
    return f" (did you mean '{close[0]}'?)" if close else f"; valid keys: {sorted(map(str, valid))}"


def wrong_type(path: str, value, expected: str) -> ConfigError:
    return ConfigError(f"{path}={value!r} ({type(value).__name__}) must be {expected}")


class RecordingDict(dict):
    """A dict that notes every key read from it, with the default the reader passed: run through
    DeepSpeedConfig, it lists the top-level keys DeepSpeed 0.19 understands and their types."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reads = {}

    def get(self, key, default=None):
        self.reads.setdefault(key, default)
        return super().get(key, default)

    def __contains__(self, key):
        self.reads.setdefault(key, None)
        return super().__contains__(key)

    def keys(self):   # DeepSpeed also asks `KEY in param_dict.keys()`: answer with the recording dict itself
        return self


@functools.cache
def deepspeed_top_level_keys() -> dict:
    """Top-level key -> the default DeepSpeed's config parser reads it with (None: no default given)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    # Only per-rank batch sizes: DeepSpeed multiplies them by the world size of the process group, if any.
    recorded = RecordingDict({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})
    DeepSpeedConfig(recorded)
    # Read only inside a live process group and without an mpu (runtime/config.py sizes data parallelism by it):
    # the key the Ulysses/ALST tutorial sets, which a recording outside a group never reaches.
    return {**recorded.reads, "sequence_parallel_size": 1}


def check_top_level(config: dict) -> None:
    """Unknown keys (DeepSpeed ignores them silently) and values of the wrong JSON type."""
    known = deepspeed_top_level_keys()
    for key, value in config.items():
        if key not in known:
            raise ConfigError(f"unknown top-level key '{key}', which DeepSpeed would ignore{did_you_mean(key, known)}")
        expected = dict if key in DICT_KEYS else type(known[key])
        if expected is not type(None) and not same_json_type(value, expected):
            raise wrong_type(key, value, f"a {JSON_NAMES.get(expected, expected.__name__)} like DeepSpeed's "
                                         f"default {known[key]!r}")


def same_json_type(value, expected: type) -> bool:
    if expected in (int, float):   # a number, and a bool is not one
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, expected)


def check_blocks(config: dict) -> None:
    """Each block DeepSpeed models with pydantic, checked by that model: unknown keys, types, allowed values."""
    from pydantic import ValidationError
    for key, model in block_models().items():
        if key not in config:
            continue
        try:
            parsed = model(**config[key])
        except ValidationError as err:
            raise pydantic_error(key, model, err.errors()[0]) from None
        check_not_coerced(config[key], parsed, key)


@functools.cache
def block_models() -> dict:
    """The blocks DeepSpeed 0.19 parses with its own pydantic models (which forbid unknown keys)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config,
            "tensorboard": TensorBoardConfig, "wandb": WandbConfig, "csv_monitor": CSVConfig, "comet": CometConfig,
            "comms_logger": CommsLoggerConfig, "compile": CompileConfig}


def pydantic_error(key: str, model, error: dict) -> ConfigError:
    path = ".".join([key, *map(str, error["loc"])])
    if error["type"] == "extra_forbidden":
        valid = field_names(model, error["loc"][:-1])
        return ConfigError(f"unknown key '{path}'{did_you_mean(error['loc'][-1], valid)}")
    return ConfigError(f"{path}={error['input']!r}: {error['msg']}")


def field_names(model, loc) -> set[str]:
    """Keys a pydantic model (or the sub-model at `loc`) accepts, aliases included."""
    from pydantic import BaseModel
    for part in loc:
        annotation = model.model_fields[part].annotation
        model = next(t for t in (annotation, *typing.get_args(annotation))
                     if isinstance(t, type) and issubclass(t, BaseModel))
    return {name for field_name, field in model.model_fields.items() for name in (field_name, field.alias) if name}


def check_not_coerced(given: dict, parsed, path: str) -> None:
    """pydantic converts "2" to 2 and "false" to False without a word; our own code reads the dict as
    written, where "false" is true. Refuse a string or a bool where DeepSpeed's model holds something else."""
    from pydantic import BaseModel
    for key, value in given.items():
        held = getattr(parsed, key, None)
        if isinstance(value, dict) and isinstance(held, BaseModel):
            check_not_coerced(value, held, f"{path}.{key}")
        elif held is not None and (isinstance(value, bool) != isinstance(held, bool) or isinstance(value, str)
                                   and not isinstance(getattr(held, "value", held), (str, PurePath))):   # JSON writes a path as a string
            plain = getattr(held, "value", held)
            raise wrong_type(f"{path}.{key}", value, f"a {type(plain).__name__}, e.g. {json.dumps(plain)}")


def check_optimizer(config: dict) -> None:
    """The type names an optimizer DeepSpeed can build (its own, or one of torch.optim), and its params
    fit that optimizer's signature; torch's own constructor then checks the ranges (lr >= 0, betas < 1)."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    if "optimizer" not in config:
        raise ConfigError("no 'optimizer' block: add one, e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4}}")
    name = config["optimizer"].get("type")
    known = [*DEEPSPEED_OPTIMIZERS, *(n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type))]
    if not isinstance(name, str) or not (name.lower() in DEEPSPEED_OPTIMIZERS or name in known):
        raise ConfigError(f"optimizer.type={name!r} is not an optimizer DeepSpeed can build{did_you_mean(name, known)}")
    params = check_params("optimizer", config["optimizer"])
    if name.lower() in ("adam", "adamw"):   # DeepSpeed's Adam(W) is torch's AdamW, FusedAdam or CPUAdam
        optimizer, extra = torch.optim.AdamW, {"torch_adam", "adam_w_mode"}
        check_torch_adam(params)
    elif name.lower() in DEEPSPEED_OPTIMIZERS:
        return   # LAMB, Lion, Muon...: CUDA kernels whose arguments DeepSpeed checks itself
    else:
        optimizer, extra = getattr(torch.optim, name), set()
    check_arguments("optimizer.params", params, optimizer, extra)
    probe = [torch.zeros(1, requires_grad=True)]
    try:
        optimizer(probe, **{k: v for k, v in params.items() if k not in extra | {"fused", "foreach"}})
    except (ValueError, TypeError, IndexError) as err:
        raise ConfigError(f"optimizer.params: {optimizer.__name__} refuses them: {err}") from None


def check_torch_adam(params: dict) -> None:
    """`fused` and `foreach` are torch.optim.AdamW's: DeepSpeed passes them on only when torch_adam is true
    (engine.get_optimizer_configuration); its FusedAdam and DeepSpeedCPUAdam take neither."""
    flag = params.get("torch_adam", False)
    if not isinstance(flag, bool):
        raise wrong_type("optimizer.params.torch_adam", flag, "true or false")
    torch_only = sorted({"fused", "foreach"} & params.keys())
    for key in torch_only:
        if params[key] is not None and not isinstance(params[key], bool):
            raise wrong_type(f"optimizer.params.{key}", params[key], "true, false or null")
    if torch_only and not flag:
        raise ConfigError(f"optimizer.params.{torch_only[0]}: only torch's AdamW takes it; set "
                          f"optimizer.params.torch_adam to true, or remove {torch_only[0]}")


def check_scheduler(config: dict) -> None:
    """A known schedule whose params fit its signature; then DeepSpeed's own constructor checks them."""
    import torch
    from deepspeed.runtime import lr_schedules
    if "scheduler" not in config:
        return
    name = config["scheduler"].get("type")
    known = [*lr_schedules.VALID_LR_SCHEDULES, *(n for n in dir(torch.optim.lr_scheduler) if n[0].isupper())]
    if not isinstance(name, str) or name not in known:
        raise ConfigError(f"scheduler.type={name!r} is not a schedule DeepSpeed can build{did_you_mean(name, known)}")
    params = check_params("scheduler", config["scheduler"])
    schedule = getattr(lr_schedules if name in lr_schedules.VALID_LR_SCHEDULES else torch.optim.lr_scheduler, name)
    check_arguments("scheduler.params", params, schedule, set())
    warmup = params.get("warmup_type", lr_schedules.WARMUP_LINEAR_RATE)
    if warmup not in (lr_schedules.WARMUP_LOG_RATE, lr_schedules.WARMUP_LINEAR_RATE):   # DeepSpeed only warns
        raise ConfigError(f"scheduler.params.warmup_type={warmup!r} must be 'linear' or 'log'")
    if params.get("total_num_steps", math.inf) < params.get("warmup_num_steps", 0):
        raise ConfigError(f"scheduler.params.total_num_steps={params['total_num_steps']} is shorter than "
                          f"warmup_num_steps={params['warmup_num_steps']}: train longer or warm up less")
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        schedule(probe, **params)
    except (ValueError, TypeError, ZeroDivisionError) as err:
        raise ConfigError(f"scheduler.params: {name} refuses them: {err}") from None


def check_params(block: str, config: dict) -> dict:
    unknown = set(config) - {"type", "params"}
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(f"unknown key '{block}.{key}'{did_you_mean(key, ['type', 'params'])}")
    params = config.get("params", {})
    if not isinstance(params, dict):
        raise wrong_type(f"{block}.params", params, "a JSON object of the constructor's arguments")
    return params


def check_arguments(path: str, params: dict, constructor, extra: set) -> None:
    """Every key is a parameter of `constructor`, of the JSON type of its default (a number, a bool, a
    string, a list as long as a tuple default); a parameter without a default must be given."""
    signature = inspect.signature(constructor).parameters
    accepted = {*signature, *extra} - {"self", "params", "optimizer"}
    for key, value in params.items():
        if key not in accepted:
            raise ConfigError(f"unknown key '{path}.{key}' for {constructor.__name__}{did_you_mean(key, accepted)}")
        default = signature[key].default if key in signature else None
        if default is inspect.Parameter.empty and signature[key].annotation in (int, float):
            default = signature[key].annotation()   # a required number (total_num_steps): 0 stands for its type
        if isinstance(default, tuple):
            if not (isinstance(value, (list, tuple)) and len(value) == len(default)
                    and all(same_json_type(v, float) for v in value)):
                raise wrong_type(f"{path}.{key}", value, f"a list of {len(default)} numbers, e.g. {list(default)}")
        elif isinstance(default, (bool, int, float, str)) and not same_json_type(value, type(default)):
            if not (isinstance(default, float) and isinstance(value, list)):   # a list: one value per param group
                raise wrong_type(f"{path}.{key}", value, f"a {JSON_NAMES.get(type(default), type(default).__name__)}"
                                                         f" like the default {default!r}")
    for key, parameter in signature.items():
        if key not in accepted or key in params:
            continue
        if parameter.default is inspect.Parameter.empty and parameter.kind is parameter.POSITIONAL_OR_KEYWORD:
            raise ConfigError(f"{path}.{key} is missing: {constructor.__name__} needs it")


def check_with_deepspeed_config(config: dict) -> None:
    """Last, DeepSpeed's own config class on the whole dict: whatever it refuses is refused here too,
    naming the top-level key without which it would accept the rest. It takes the world size from
    torch.distributed (1 here), so the batch sizes checked above go in as the per-rank pair."""
    per_rank = {k: v for k, v in config.items() if k != "train_batch_size" or "train_micro_batch_size_per_gpu" not in config}
    error = deepspeed_config_error(per_rank)
    if error is not None:
        culprit = next((k for k in per_rank if deepspeed_config_error(per_rank, without=k) is None), None)
        where = f"{culprit}={config[culprit]!r}: " if culprit is not None else ""
        raise ConfigError(f"{where}DeepSpeed refuses this config: {type(error).__name__}: {error}")


def deepspeed_config_error(config: dict, without: str | None = None) -> Exception | None:
    from deepspeed.runtime.config import DeepSpeedConfig
    try:
        DeepSpeedConfig({k: v for k, v in config.items() if k != without})
    except Exception as err:   # noqa: BLE001 (any refusal, whatever class DeepSpeed raises it as)
        return err
    return None
