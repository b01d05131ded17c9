"""The config builder: what it writes, and each mistake it stops before deepspeed.initialize."""
import json

import pytest

from helpers.config import build_config, load_json, save_json, validate
from helpers.errors import ConfigError


def good(**overrides):
    return build_config(micro_batch=4, grad_accum=2, world_size=1, **overrides)


def test_built_config_is_complete_and_valid():
    cfg = validate(good(zero_stage=2, precision="bf16", lr=1e-3, warmup_steps=5, total_steps=50), device="cpu")
    assert cfg["train_batch_size"] == 8
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["scheduler"]["params"]["warmup_max_lr"] == cfg["optimizer"]["params"]["lr"] == 1e-3


def test_fp16_uses_dynamic_loss_scaling():
    cfg = validate(good(precision="fp16"), device="cuda")
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["loss_scale"] == 0   # 0 means dynamic


def test_json_round_trip(tmp_path):
    cfg = good(zero_stage=1, tensorboard_dir=tmp_path / "tb")
    assert load_json(save_json(cfg, tmp_path / "ds.json")) == json.loads(json.dumps(cfg))


def test_deepspeed_accepts_the_built_config():
    from deepspeed.runtime.config import DeepSpeedConfig
    ds = DeepSpeedConfig(good(zero_stage=3, precision="bf16"))
    assert ds.zero_optimization_stage == 3 and ds.train_batch_size == 8


@pytest.mark.parametrize("mutate, device, world, field", [
    (lambda c: c.update(train_batch_size=12), "cpu", 1, "train_batch_size=12"),
    (lambda c: None, "cpu", 2, "world size (2)"),
    (lambda c: c.update(train_micro_batch_size_per_gpu=0), "cpu", 1, "train_micro_batch_size_per_gpu=0"),
    (lambda c: c["zero_optimization"].update(stage=4), "cpu", 1, "zero_optimization.stage=4"),
    (lambda c: c.update(fp16={"enabled": True}), "cpu", 1, "fp16.enabled"),
    (lambda c: c.update(fp16={"enabled": True}, bf16={"enabled": True}), "cuda", 1, "pick one precision"),
    (lambda c: c["zero_optimization"].update(cpu_offload=True), "cpu", 1, "zero_optimization.cpu_offload"),
    (lambda c: c.update(curriculum_learning={"enabled": True}), "cpu", 1, "'curriculum_learning'"),
    (lambda c: c["optimizer"].update(type="OneBitAdam"), "cpu", 1, "optimizer.type='OneBitAdam'"),
    (lambda c: c["optimizer"]["params"].update(lr=0.0), "cpu", 1, "optimizer.params.lr=0.0"),
    (lambda c: c["optimizer"]["params"].update(lr=-1e-3), "cpu", 1, "optimizer.params.lr=-0.001"),
    (lambda c: c["zero_optimization"].update(offload_param={"device": "cpu"}), "cpu", 1, "offload_param"),
    (lambda c: c["zero_optimization"].update(stage=0, offload_optimizer={"device": "cpu"}), "cpu", 1,
     "offload_optimizer"),
    (lambda c: c["scheduler"]["params"].update(total_num_steps=1), "cpu", 1, "total_num_steps=1"),
    (lambda c: c["scheduler"]["params"].update(warmup_num_steps=0), "cpu", 1, "warmup_num_steps must be a positive integer"),
    (lambda c: c["zero_optimization"].update(stage=3, zero_quantized_weights=True), "cpu", 1,
     "zero_optimization.zero_quantized_weights"),
    (lambda c: c.update(gradient_clipping=-1.0), "cpu", 1, "gradient_clipping=-1.0"),
    (lambda c: c.update(compile={"deepcompile": True}), "cpu", 1, "compile.deepcompile"),
])
def test_bad_config_names_the_field(mutate, device, world, field):
    cfg = good()
    mutate(cfg)
    with pytest.raises(ConfigError) as err:
        validate(cfg, device=device, world_size=world)
    assert field in str(err.value)


# The shapes a new user gets wrong (issue 16): each one is refused with the key path, what it got and
# what it expects, before any engine exists. Without the validator each of these ended in a bare
# TypeError / AttributeError inside DeepSpeed, a failure at the first step, or a silently different run.
@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.update(gradient_clipping="1.0"), "gradient_clipping='1.0' (str) must be a number"),
    (lambda c: c["optimizer"]["params"].update(lr="3e-4"), "optimizer.params.lr='3e-4' (str) must be a number"),
    (lambda c: c.update(zero_optimization=2), "zero_optimization=2 (int) must be a JSON object"),
    (lambda c: c.update(bf16=True), "bf16=True (bool) must be a JSON object"),
    (lambda c: c["zero_optimization"].update(stag=3), "unknown key 'zero_optimization.stag' (did you mean 'stage'?)"),
    (lambda c: c["zero_optimization"].update(offload_optimizer={"devce": "cpu"}),
     "unknown key 'zero_optimization.offload_optimizer.devce' (did you mean 'device'?)"),
    (lambda c: c["zero_optimization"].update(offload_optimizer={"device": "gpu"}),
     "zero_optimization.offload_optimizer.device='gpu': Input should be 'none', 'cpu' or 'nvme'"),
    (lambda c: c["zero_optimization"].update(stage=2, offload_optimizer={"device": "nvme"}), "nvme_path is not set"),
    (lambda c: c["zero_optimization"].update(stage="2"), "zero_optimization.stage='2'"),
    (lambda c: c.update(bf16={"enabled": "false"}), "bf16.enabled='false' (str) must be a bool"),
    (lambda c: c["optimizer"]["params"].update(betas=[0.9]), "optimizer.params.betas=[0.9] (list) must be a list of 2"),
    (lambda c: c["optimizer"]["params"].update(betas=[0.9, 1.5]), "Invalid beta parameter at index 1: 1.5"),
    (lambda c: c["optimizer"]["params"].update(weight_decy=0.1), "'optimizer.params.weight_decy' for AdamW (did you mean 'weight_decay'?)"),
    (lambda c: c["optimizer"].update(type="AdamWW"), "optimizer.type='AdamWW' is not an optimizer DeepSpeed can build (did you mean 'AdamW'?)"),
    (lambda c: c.pop("optimizer"), "no 'optimizer' block"),
    # found by the Hypothesis run: DeepSpeed hands `fused` to its FusedAdam, whose constructor has no such argument
    (lambda c: c["optimizer"]["params"].update(torch_adam="", fused=True), "optimizer.params.torch_adam='' (str)"),
    (lambda c: c["optimizer"]["params"].update(torch_adam=False, fused=True),
     "optimizer.params.fused: only torch's AdamW takes it"),
    (lambda c: c["scheduler"].update(type="WarmupDecay"), "(did you mean 'WarmupDecayLR'?)"),
    (lambda c: c["scheduler"]["params"].update(warmup_type="cosine"), "scheduler.params.warmup_type='cosine'"),
    (lambda c: c["scheduler"]["params"].pop("total_num_steps"), "scheduler.params.total_num_steps is missing"),
    (lambda c: c.update(gradient_acumulation_steps=2), "unknown top-level key 'gradient_acumulation_steps', which "
                                                        "DeepSpeed would ignore (did you mean 'gradient_accumulation_steps'?)"),
    (lambda c: c.update(steps_per_print="10"), "steps_per_print='10' must be a positive integer"),
])
def test_wrong_shapes_are_named_with_what_was_expected(mutate, message):
    cfg = good()
    mutate(cfg)
    with pytest.raises(ConfigError) as err:
        validate(cfg, device="cpu")
    assert message in str(err.value)


def test_a_config_that_is_not_a_dict_is_refused():
    with pytest.raises(ConfigError, match="a DeepSpeed config is a JSON object"):
        validate(["train_batch_size", 8], device="cpu")


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("  \n", "is empty"),
    # line 2 is  "zero_optimization": {"stage": 2,}}  and its 35th character is the brace after the stray comma
    ('{"train_batch_size": 8,\n "zero_optimization": {"stage": 2,}}', "line 2 column 35: not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
])
def test_bad_config_files_are_named_with_line_and_column(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_json(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_a_file_that_is_not_text_is_named(tmp_path):
    path = tmp_path / "weights.json"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match=f"config file {path} could not be read as text"):
        load_json(path)


def test_unknown_precision_is_refused():
    with pytest.raises(ConfigError, match="precision='fp8'"):
        build_config(precision="fp8")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_json(tmp_path / "nope.json")


def test_zero_plus_plus_is_fine_on_a_gpu():
    cfg = good(zero_stage=3)
    cfg["zero_optimization"].update(zero_quantized_weights=True, zero_quantized_gradients=True)
    assert validate(cfg, device="cuda") is cfg


def test_deepcompile_is_fine_on_a_gpu():
    cfg = good(zero_stage=3) | {"compile": {"deepcompile": True}}
    assert validate(cfg, device="cuda") is cfg


def test_every_block_deepspeed_lists_as_removed_is_refused_before_initialize():
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS
    for key in _REMOVED_TOP_LEVEL_CONFIG_KEYS:
        with pytest.raises(ConfigError, match=f"'{key}' was removed"):
            validate({**build_config(), key: {"enabled": True}}, device="cpu")


def test_an_nvme_path_is_a_string_as_json_writes_it():
    # DeepSpeed's model holds a Path; a config read from JSON (and the one DeepSpeed prints as JSON) has a string
    cfg = good()
    cfg["zero_optimization"].update(stage=3, offload_param={"device": "nvme", "nvme_path": "/local_nvme"})
    assert validate(cfg, device="cpu")["zero_optimization"]["offload_param"]["nvme_path"] == "/local_nvme"
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = 5
    with pytest.raises(ConfigError, match="nvme_path=5"):
        validate(cfg, device="cpu")
