"""configs/gpu/*.json, the three ready configs of notebook 04 (read by notebook 05): each is accepted by DeepSpeed
0.19's own config classes at the world size it is for and by helpers.config.validate for that GPU, and the model
states of the model it is for fit in half of that GPU by DeepSpeed's own estimators (the other half is left to
activations and buffers, notebook 05), and on the host where its RAM is small (Colab). One GPU partitions nothing:
the one-GPU files run stage 0."""
import json
from pathlib import Path

import pytest

from helpers.config import validate

GPU_DIR = Path(__file__).resolve().parents[1] / "configs" / "gpu"
GB = 1e9
# what each file is for: GPUs, their compute capability and memory (GB), host RAM (GB, None: a server's), the model
# (parameters, largest layer: GPT-2 sizes from helpers.memory.formulas.gpt2_sizes; a 7B Llama-2-style model with a
# 32000 x 4096 embedding), and whether the optimizer is offloaded.
SPECS = {
    "gpt2-1.5b_1xA100-80GB.json": dict(gpus=1, capability=(8, 0), gpu_gb=80, host_gb=None,
                                       params=1_557_611_200, largest=80_411_200, offload=False),
    "7b_8xA100-80GB.json": dict(gpus=8, capability=(8, 0), gpu_gb=80, host_gb=None,
                                params=6_738_415_616, largest=32_000 * 4096, offload=False),
    "gpt2-355m_1xT4-16GB.json": dict(gpus=1, capability=(7, 5), gpu_gb=15, host_gb=12.7,
                                     params=354_823_168, largest=51_463_168, offload=False),
}


def load(name):
    return json.loads((GPU_DIR / name).read_text())


def test_every_file_has_a_spec():
    assert sorted(p.name for p in GPU_DIR.glob("*.json")) == sorted(SPECS)


@pytest.mark.parametrize("name", SPECS)
def test_deepspeeds_zero_model_accepts_the_block(name):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    zero = load(name)["zero_optimization"]
    parsed = DeepSpeedZeroConfig(**zero)   # forbids unknown keys
    for key, value in zero.items():        # and reads every value as written
        field = DeepSpeedZeroConfig.model_fields.get(key) and key
        field = field or next(k for k, f in DeepSpeedZeroConfig.model_fields.items() if f.alias == key)
        got = getattr(parsed, field)
        assert (got.value if hasattr(got, "value") else got) == value, (key, got, value)


class DataParallel:
    """The `mpu` DeepSpeedConfig asks for its data-parallel world size (runtime/config.py, DeepSpeedConfig.__init__)."""
    def __init__(self, size):
        self.size = size

    def get_data_parallel_world_size(self):
        return self.size


@pytest.mark.parametrize("name", SPECS)
def test_deepspeed_config_parses_each_file_at_its_world_size(name, monkeypatch):
    from deepspeed.runtime import config as ds_config
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)   # no process group here
    spec, config = SPECS[name], load(name)
    parsed = ds_config.DeepSpeedConfig(config, mpu=DataParallel(spec["gpus"]))
    assert parsed.world_size == spec["gpus"]
    assert parsed.train_batch_size == (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
                                       * spec["gpus"])
    assert parsed.zero_optimization_stage == config["zero_optimization"]["stage"]
    fp16 = spec["capability"] < (8, 0)   # no bf16 before Ampere (a T4 is 7.5)
    assert (parsed.float16_config.enabled, parsed.bfloat16_config.enabled) == (fp16, not fp16)


@pytest.mark.parametrize("name", SPECS)
def test_project_validator_accepts_each_file_for_its_gpu(name):
    spec = SPECS[name]
    validate(load(name), device="cuda", world_size=spec["gpus"], capability=spec["capability"])


@pytest.mark.parametrize("name", SPECS)
def test_model_states_fit_by_deepspeeds_estimators(name):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    spec, stage = SPECS[name], load(name)["zero_optimization"]["stage"]
    if stage == 3:
        host, gpu, _ = estimate_zero3_model_states_mem_needs(spec["params"], spec["largest"], spec["gpus"], 1,
                                                             cpu_offload=spec["offload"], cpu_offload_params=False)
    else:   # stage 0 has no estimator; on one GPU stage 2's (2Ψ + 18Ψ) counts what stage 0 holds (test below)
        assert stage == 2 or (stage == 0 and spec["gpus"] == 1), (stage, spec)
        host, gpu = estimate_zero2_model_states_mem_needs(spec["params"], spec["gpus"], 1, cpu_offload=spec["offload"])
    assert gpu <= 0.5 * spec["gpu_gb"] * GB, (gpu / GB, spec)
    if spec["host_gb"] is not None:
        assert host <= 0.5 * spec["host_gb"] * GB, (host / GB, spec)


def test_the_checks_refuse_what_they_should():
    """The tests above bite: a misspelt ZeRO key is refused by DeepSpeed's model, bf16 on a T4 by validate."""
    from pydantic import ValidationError
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from helpers.errors import ConfigError
    with pytest.raises(ValidationError):
        DeepSpeedZeroConfig(**load("7b_8xA100-80GB.json")["zero_optimization"], stage3_prefetch_bucket=1)
    t4 = load("gpt2-355m_1xT4-16GB.json")
    bf16 = {k: v for k, v in t4.items() if k != "fp16"} | {"bf16": {"enabled": True}}
    with pytest.raises(ConfigError, match="bf16"):
        validate(bf16, device="cuda", world_size=1, capability=(7, 5))


@pytest.mark.parametrize("name", SPECS)
def test_multi_rank_bucket_allreduce_left_at_its_default(name):
    """Notebook 04's advice: keep use_multi_rank_bucket_allreduce at DeepSpeed's default (true; read by stages 1-2
    only, stage_1_and_2.py average_tensor) unless a timed run at stage 1-2 on many GPUs says otherwise."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    zero = load(name)["zero_optimization"]
    assert "use_multi_rank_bucket_allreduce" not in zero
    assert DeepSpeedZeroConfig(**zero).use_multi_rank_bucket_allreduce is True


@pytest.mark.parametrize("name", [n for n, spec in SPECS.items() if spec["gpus"] == 1])
def test_one_gpu_files_run_stage_0_and_its_estimate_counts_stage_0(name):
    """One GPU partitions nothing, so stage 0 (notebook 04, section 7). DeepSpeed has no stage-0 estimator; at N = 1
    its stage-2 estimate is stage 0's paper bytes, 16Ψ, plus the fp32 copy of every gradient that stage 0's optimizer
    wrapper makes in step (runtime/fp16/unfused_optimizer.py, FP16_UnfusedOptimizer.step), as helpers.memory.planner
    counts stage 0."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from helpers.memory import planner
    config, psi = load(name), SPECS[name]["params"]
    assert config["zero_optimization"] == {"stage": 0}
    precision = "fp16" if config.get("fp16", {}).get("enabled") else "bf16"
    _, gpu = estimate_zero2_model_states_mem_needs(psi, 1, 1, cpu_offload=False)
    assert gpu == 20 * psi
    assert planner.model_state_bytes(psi, 1, 0, precision=precision)["gpu"] == pytest.approx(gpu, rel=1e-9)
    assert planner.model_state_bytes(psi, 1, 0, precision=precision, counting="paper")["gpu"] == 16 * psi


def test_gpt2_774m_does_not_fit_a_t4_at_stage_0():
    """Notebook 04's reason for GPT-2 355M on the T4: 774M's model states alone, as DeepSpeed counts them (20Ψ), exceed
    the T4's 15 usable GB, before activations and CUDA context."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from helpers.memory import formulas
    psi = next(s["params"] for s in formulas.gpt2_sizes() if "774" in s["name"])
    _, gpu = estimate_zero2_model_states_mem_needs(psi, 1, 1, cpu_offload=False)
    assert gpu > SPECS["gpt2-355m_1xT4-16GB.json"]["gpu_gb"] * GB
