"""The ready-made DeepSpeed configs in `configs/`, generated from `PRESETS` so they cannot drift:
`python -m helpers.presets` rewrites them; a test checks the files equal what this module generates and
that DeepSpeed and HF `Trainer(deepspeed=...)` accept each unchanged. Each differs from `zero0.json` only in
what its name says, and holds no "auto" value (plain DeepSpeed cannot read one: HF's TrainingArguments are
made to agree with the file instead, helpers.hf_trainer).
"""
from __future__ import annotations

from pathlib import Path

from helpers import REPO_ROOT
from helpers.config import build_config, save_json
from helpers.precision import precision_of

CONFIG_DIR = REPO_ROOT / "configs"

# The trainer's default hyperparameters (helpers.trainer.AdvancedDeepSpeedTrainer), so a file run by
# `python -m helpers.programs.train` trains as the notebooks' trainer does.
COMMON = dict(micro_batch=16, grad_accum=1, lr=3e-3, weight_decay=0.01, warmup_steps=20, total_steps=300,
              grad_clip=1.0)

# name -> (what it is for, build_config arguments on top of COMMON, extra top-level keys)
PRESETS: dict[str, tuple[str, dict, dict]] = {
    "zero0": ("plain data parallelism: every rank holds everything", {"zero_stage": 0}, {}),
    "zero1": ("ZeRO-1: optimizer state partitioned across ranks", {"zero_stage": 1}, {}),
    "zero2": ("ZeRO-2: optimizer state and gradients partitioned", {"zero_stage": 2}, {}),
    "zero3": ("ZeRO-3: parameters partitioned too", {"zero_stage": 3}, {}),
    "zero2_offload": ("ZeRO-2 with optimizer state and step on the CPU (DeepSpeedCPUAdam)",
                      {"zero_stage": 2, "offload_optimizer": True}, {}),
    "zero3_offload": ("ZeRO-3 with optimizer state and parameters in CPU memory",
                      {"zero_stage": 3, "offload_optimizer": True, "offload_param": True}, {}),
    "bf16": ("ZeRO-2 in bf16 (Ampere or newer GPUs; CPUs with native bf16)",
             {"zero_stage": 2, "precision": "bf16"}, {}),
    "fp16": ("ZeRO-2 in fp16 with dynamic loss scaling (older GPUs such as the T4; the tutorial trains fp16 on GPUs only)",
             {"zero_stage": 2, "precision": "fp16"}, {}),
    # PipelineEngine refuses ZeRO-2/3 (runtime/pipe/engine.py asserts stage < 2), and needs several
    # micro-batches per step or all but one stage sit idle: accumulation is the number of
    # micro-batches that flow through the pipeline in one step. The number of stages and how layers
    # are split are PipelineModule arguments (num_stages, partition_method), not config keys; of
    # the "pipeline" block the engine reads only activation checkpointing and buffer partitioning.
    "pipeline": ("pipeline parallelism for a deepspeed.pipe.PipelineModule: ZeRO-1, 4 micro-batches per step",
                 {"zero_stage": 1, "grad_accum": 4}, {"pipeline": {"activation_checkpoint_interval": 0}}),
    # Native MoE layers (deepspeed.moe.layer.MoE) take experts, k and ep_size as layer arguments,
    # not config keys; what the config must get right is the ZeRO stage, because DeepSpeed refuses
    # native MoE under ZeRO-3 (engine._validate_zero3_moe_compatibility).
    "moe": ("models with deepspeed.moe.layer.MoE layers: ZeRO-2, the highest stage MoE supports",
            {"zero_stage": 2}, {}),
}


def preset(name: str) -> dict:
    """The config dict of one preset (what configs/<name>.json holds)."""
    if name not in PRESETS:
        raise KeyError(f"no preset {name!r}: choose one of {sorted(PRESETS)}")
    _, arguments, extra = PRESETS[name]
    # torch's fused AdamW on every device (bitwise resume on a CPU); DeepSpeedCPUAdam where the optimizer is offloaded
    config = build_config(**{**COMMON, **arguments}, torch_adam=not arguments.get("offload_optimizer"), extra=extra)
    del config["train_batch_size"]   # DeepSpeed computes it for whatever world size launches the file
    return config


def write_configs(directory: str | Path = CONFIG_DIR) -> list[Path]:
    """Write every preset as <directory>/<name>.json; return the paths."""
    return [save_json(preset(name), Path(directory) / f"{name}.json") for name in PRESETS]


def describe() -> list[dict]:
    """One row per preset for a notebook table: file, purpose, ZeRO stage, precision, offload."""
    rows = []
    for name, (purpose, _, _) in PRESETS.items():
        config = preset(name)
        zero = config["zero_optimization"]
        offload = [k.removeprefix("offload_") for k in ("offload_optimizer", "offload_param") if k in zero]
        rows.append({"file": f"configs/{name}.json", "purpose": purpose, "ZeRO stage": zero["stage"],
                     "precision": precision_of(config), "offload": ", ".join(offload) or "-"})
    return rows


def resolve(config_path: str | Path) -> Path:
    """A config path as given, or relative to the repository ("configs/zero2.json" from notebooks/ too)."""
    for candidate in (Path(config_path), REPO_ROOT / config_path):
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"config file {config_path} not found (looked here and under {REPO_ROOT})")


if __name__ == "__main__":
    for path in write_configs():
        print(path.relative_to(CONFIG_DIR.parent))
