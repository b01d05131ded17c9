"""DeepSpeed config dicts from a few readable arguments (`build_config`), and `validate`: the mistakes
that otherwise surface as a stack trace inside DeepSpeed, or a silently different run, named by key."""
from __future__ import annotations

import json
import math
from pathlib import Path

from helpers.errors import ConfigError, require_positive_int
from helpers.precision import precision_block, precision_of, trainable_precisions
from helpers.schema import check_blocks, check_optimizer, check_scheduler, check_top_level, check_with_deepspeed_config

ZERO_STAGES = (0, 1, 2, 3)

# Where our fix says more than DeepSpeed 0.19's own message for a removed top-level key (its
# _REMOVED_TOP_LEVEL_CONFIG_KEYS table has the rest).
REMOVED_TOP_LEVEL = {
    "curriculum_learning": "use 'data_efficiency.data_sampling.curriculum_learning' or "
                           "deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler",
}
REMOVED_ZERO_KEYS = {
    "cpu_offload": "use zero_optimization.offload_optimizer = {'device': 'cpu'}",
    "cpu_offload_param": "use zero_optimization.offload_param = {'device': 'cpu'} (ZeRO stage 3)",
    "cpu_offload_use_pin_memory": "use 'pin_memory' inside offload_optimizer / offload_param",
}
REMOVED_OPTIMIZERS = {"onebitadam", "zerooneadam", "onebitlamb"}
ZERO_PLUS_PLUS = ("zero_quantized_gradients", "zero_quantized_weights")   # hpZ (zero_hpz_partition_size) runs anywhere


def zero_block(stage: int, offload_optimizer: bool, offload_param: bool, extra: dict | None = None) -> dict:
    block = {"stage": stage, **(extra or {})}
    if offload_optimizer:   # an offload block given in extra is kept as written
        block.setdefault("offload_optimizer", {"device": "cpu", "pin_memory": False})
    if offload_param:
        block.setdefault("offload_param", {"device": "cpu", "pin_memory": False})
    return block


def build_config(*, micro_batch: int = 8, grad_accum: int = 1, world_size: int = 1,
                 zero_stage: int = 0, precision: str = "fp32", lr: float = 1e-3,
                 weight_decay: float = 0.01, warmup_steps: int = 10, total_steps: int = 100,
                 grad_clip: float = 1.0, offload_optimizer: bool = False, offload_param: bool = False,
                 torch_adam: bool | None = None, zero_extra: dict | None = None, tensorboard_dir: str | None = None,
                 job_name: str = "run", device: str = "cuda", extra: dict | None = None) -> dict:
    """A complete DeepSpeed config: ZeRO stage, precision, AdamW with warmup then linear decay.

    On every device the optimizer is torch's AdamW ("torch_adam": true, with `fused`: one kernel per tensor)
    unless it is offloaded to DeepSpeedCPUAdam. On a GPU that spares DeepSpeed's FusedAdam, a CUDA op JIT-built
    with nvcc on first use: minutes of set-up, and a failure wherever nvcc's CUDA differs from torch's (as on
    some Colab images); torch's fused AdamW does the same update with no build. On a CPU, DeepSpeed's FusedAdam
    kernel rounds by where tensors sit in memory, so a resumed run drifts by a few ulps; torch's AdamW resumes
    bitwise (and is ~10x faster here).

    device="cpu" adds the CPU settings the trainer's runs use (zero_extra and extra, top-level keys, win):
    - on one rank, ZeRO 1/2 without contiguous_gradients: its reduce bucket (5e8 elements) is allocated
      fresh every backward (DeepSpeedZeroOptimizer.setup_buckets), a new memory mapping on a CPU whose
      pages fault in each step (~15 ms for 4.3M params), for gradients no other rank waits for.
    """
    on_cpu = device == "cpu"
    torch_adam = not offload_optimizer if torch_adam is None else torch_adam
    if on_cpu and world_size == 1 and zero_stage in (1, 2):
        zero_extra = {"contiguous_gradients": False, **(zero_extra or {})}
    config = {
        "train_batch_size": micro_batch * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "optimizer": {"type": "AdamW", "params": {
            "lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": weight_decay,
            **({"torch_adam": True, "fused": True} if torch_adam else {})}},
        # WarmupDecayLR: linear warmup to lr over warmup_steps, then linear decay to 0 at total_steps.
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": warmup_steps,
            "warmup_type": "linear", "total_num_steps": total_steps}},
        "zero_optimization": zero_block(zero_stage, offload_optimizer, offload_param, zero_extra),
        "steps_per_print": 10**9,   # the trainer reports metrics itself
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronises the device at every forward start and step
        # end (utils/timer.py, ThroughputTimer); it only feeds steps_per_print's log, and the trainer times steps itself.
        "timers": {"throughput": {"enabled": False}},
        **precision_block(precision),
    }
    if tensorboard_dir is not None:
        config["tensorboard"] = {"enabled": True, "output_path": str(tensorboard_dir), "job_name": job_name}
    return {**config, **(extra or {})}


def micro_batch_of(config: dict, world_size: int = 1) -> int:
    """The micro-batch per rank a config trains with, as DeepSpeed derives it from the batch keys."""
    if "train_micro_batch_size_per_gpu" in config:
        return config["train_micro_batch_size_per_gpu"]
    accum, total = config.get("gradient_accumulation_steps", 1), config.get("train_batch_size")
    if total is None or total % (accum * world_size):
        raise ConfigError(f"set train_micro_batch_size_per_gpu: train_batch_size={total} is not a multiple of "
                          f"gradient_accumulation_steps ({accum}) x world size ({world_size})")
    return total // (accum * world_size)


def zero_stage_of(config: dict) -> int:
    """The ZeRO stage a config asks for (DeepSpeed's default: 0)."""
    return (config.get("zero_optimization") or {}).get("stage", 0)


def validate(config: dict, *, device: str, world_size: int = 1, capability: tuple | None = None) -> dict:
    """Raise ConfigError naming the key path if DeepSpeed would reject, misread or later fail on `config`,
    before any model exists: our rules here, then DeepSpeed's own (helpers.schema). capability: a CUDA
    GPU's compute capability, e.g. (7, 5) for a T4, where bf16 is refused."""
    if not isinstance(config, dict):
        raise ConfigError(f"a DeepSpeed config is a JSON object (a dict), got {type(config).__name__} {config!r}")
    check_finite(config)
    check_removed_keys(config)
    check_top_level(config)
    check_blocks(config)
    check_batch_sizes(config, world_size)
    check_zero(config.get("zero_optimization", {}), device)
    check_precision(config, device, capability)
    check_deepcompile(config, device)
    check_rates(config)
    check_optimizer(config)
    check_scheduler(config)
    check_with_deepspeed_config(config)
    return config


def removed_top_level_keys() -> dict[str, str]:
    """Removed top-level blocks -> what to do: DeepSpeed's own table (its message), with our fix where
    we have one. DeepSpeed raises on them too, but only inside initialize."""
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS
    return {**_REMOVED_TOP_LEVEL_CONFIG_KEYS, **REMOVED_TOP_LEVEL}


def check_removed_keys(config: dict) -> None:
    for key, fix in removed_top_level_keys().items():
        if key in config:
            raise ConfigError(f"'{key}' was removed in DeepSpeed 0.19: {fix}")
    zero = config.get("zero_optimization")
    for key, fix in REMOVED_ZERO_KEYS.items():
        if isinstance(zero, dict) and key in zero:
            raise ConfigError(f"'zero_optimization.{key}' was removed: {fix}")
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in REMOVED_OPTIMIZERS:
        raise ConfigError(f"optimizer.type={optimizer['type']!r} (1-bit / 0-1 optimizers) was removed: "
                          "use 'AdamW' with 'communication_data_type' or ZeRO++ quantized communication")


def check_batch_sizes(config: dict, world_size: int) -> None:
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    train, micro, accum = (config.get(n) for n in names)
    for name, value in reversed(list(zip(names, (train, micro, accum)))):   # inputs before their product
        if value is not None:
            require_positive_int(name, value)
    require_positive_int("world_size", world_size)
    if None not in (train, micro, accum) and train != micro * accum * world_size:
        raise ConfigError(
            f"train_batch_size={train} must equal train_micro_batch_size_per_gpu ({micro}) x "
            f"gradient_accumulation_steps ({accum}) x world size ({world_size}) = {micro * accum * world_size}")
    if train is None and micro is None:
        raise ConfigError("set train_batch_size or train_micro_batch_size_per_gpu")
    if "steps_per_print" in config:
        require_positive_int("steps_per_print", config["steps_per_print"])


def check_zero(zero: dict, device: str) -> None:
    """Rules DeepSpeed's ZeRO model does not hold (its model, in check_blocks, already checked the stage):
    offload needs a stage that partitions, and nvme offload a path (else it fails at the first step)."""
    stage = zero.get("stage", 0)
    if "offload_optimizer" in zero and stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 (stage is 0)")
    if "offload_param" in zero and stage != 3:
        raise ConfigError(f"zero_optimization.offload_param needs ZeRO stage 3 (stage is {stage})")
    for block in ("offload_optimizer", "offload_param"):
        if (zero.get(block) or {}).get("device") == "nvme" and not zero[block].get("nvme_path"):
            raise ConfigError(f"zero_optimization.{block}.device is 'nvme' but nvme_path is not set: add "
                              f"\"nvme_path\": \"/local_nvme\" (a directory on a fast local disk), or use device 'cpu'")
    used = [k for k in ZERO_PLUS_PLUS if zero.get(k)]
    if used and device == "cpu":   # CUDA kernels only: DeepSpeed fails inside initialize or at the first backward
        raise ConfigError(f"zero_optimization.{used[0]} (ZeRO++) is not implemented on a CPU: it needs a CUDA GPU; "
                          "remove it, or use communication_data_type for cheaper communication on a CPU")


def check_precision(config: dict, device: str, capability: tuple | None = None) -> None:
    fp16 = config.get("fp16", {}).get("enabled", False)
    bf16 = config.get("bf16", {}).get("enabled", False)
    if fp16 and bf16:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: pick one precision")
    if precision_of(config) in trainable_precisions(device, capability):
        return
    if device == "cpu":   # fp16: DeepSpeed takes it only where oneDNN has fp16 kernels (trainable_precisions says why not here)
        raise ConfigError("fp16.enabled is true but this device is a CPU: this tutorial trains fp16 on CUDA GPUs "
                          "only (DeepSpeed takes it only on CPUs with AVX512-FP16/AMX-FP16): use precision 'bf16' "
                          "or 'fp32'")
    # bf16 below Ampere: DeepSpeed accepts it (torch emulates bf16), and every step then runs many times slower.
    raise ConfigError(f"bf16.enabled is true but this GPU (sm_{capability[0]}{capability[1]}) has no bf16 tensor "
                      "cores, where torch emulates bf16 many times slower: use fp16 with dynamic loss scaling "
                      "(precision 'fp16'), or fp32")


def check_deepcompile(config: dict, device: str) -> None:
    """DeepCompile builds DeepSpeed's `dc` op against CUDA's headers: on a CPU engine.compile() fails
    ("cuda.h: No such file or directory") after the engine is built."""
    if config.get("compile", {}).get("deepcompile") and device == "cpu":
        raise ConfigError("compile.deepcompile is true but this device is a CPU: DeepCompile builds a CUDA op and "
                          "needs a CUDA GPU; remove the key (engine.compile() alone, the trainer's compile=True, "
                          "works on a CPU)")


def check_finite(config, path: str = "") -> None:
    """JSON's NaN and Infinity (Python's json reads them) are never a setting: name where one is."""
    items = config.items() if isinstance(config, dict) else enumerate(config) if isinstance(config, list) else ()
    for key, value in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}={value!r} is not a finite number: write the value you mean")
        check_finite(value, where)


def check_rates(config: dict) -> None:
    """Values DeepSpeed accepts but that train nothing (lr 0), divide by zero (Adam's eps 0: a weight whose
    gradients were all zero so far gets 0/0) or misbehave (a negative clipping norm)."""
    params = config.get("optimizer", {}).get("params", {})
    params = params if isinstance(params, dict) else {}
    for key in ("lr", "eps"):
        value = params.get(key, 1)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            raise ConfigError(f"optimizer.params.{key}={value!r} must be positive")
    if config.get("gradient_clipping", 0) < 0:
        raise ConfigError(f"gradient_clipping={config['gradient_clipping']} must be >= 0 (0 turns clipping off)")


def save_json(config: dict, path: str | Path) -> Path:
    """Write the config as JSON: what a script's `--deepspeed_config` flag (deepspeed.add_config_arguments) or HF `TrainingArguments(deepspeed=)` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def config_lines(config: dict, prefix: str = "") -> dict[str, object]:
    """One entry per setting, as a dotted key: {"zero_optimization.stage": 2, "bf16.enabled": True, ...}."""
    lines = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            lines |= config_lines(value, f"{prefix}{key}.")
        else:
            lines[f"{prefix}{key}"] = value
    return lines


def differing_lines(base: dict, config: dict) -> list[str]:
    """The settings in which `config` differs from `base`: "key: old -> new", "key: new" where base has no such
    key, "key: old -> (absent)" where config has none."""
    old, new = config_lines(base), config_lines(config)
    absent = "(absent)"
    return [f"{key}: " + (f"{json.dumps(new[key])}" if key not in old else
                         f"{json.dumps(old[key])} -> " + (json.dumps(new[key]) if key in new else absent))
            for key in [*new, *(k for k in old if k not in new)] if old.get(key, absent) != new.get(key, absent)]


def load_json(path: str | Path) -> dict:
    """A config file as a dict; a missing, empty, unreadable or malformed one is a ConfigError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} could not be read as text: {err}") from None
    if not text.strip():
        raise ConfigError(f"config file {path} is empty: write a DeepSpeed config (a JSON object) into it, "
                          "e.g. a copy of configs/zero0.json")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"config file {path}, line {err.lineno} column {err.colno}: not valid JSON "
                          f"({err.msg})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config file {path} holds a JSON {type(config).__name__}, not an object: "
                          "a DeepSpeed config is {...} with keys such as train_batch_size")
    return config
