"""The ready-made DeepSpeed configs in `configs/`, generated here so they cannot drift.

Run `python -m helpers.presets` to rewrite `configs/*.json` from `PRESETS`; a test checks that the
checked-in files equal what this module generates, and that DeepSpeed 0.19 and HF
`Trainer(deepspeed=...)` both accept each file unchanged.

Every file trains the tutorial's model with the trainer's defaults (micro-batch 16, AdamW lr 3e-3,
20 warmup steps of 300) and differs from `zero0.json` only in what its name says. Two choices make
the same file work everywhere:
- No `train_batch_size`: DeepSpeed derives it as micro-batch x accumulation x world size, so one
  file runs on 1 GPU, 8 GPUs or 4 nodes (a fixed value would be wrong for all but one world size).
- No "auto" values: plain DeepSpeed cannot read them. HF Trainer instead requires its
  `TrainingArguments` to agree with the file, which `training_arguments` below builds.
"""
from __future__ import annotations

import json
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
    "fp16": ("ZeRO-2 in fp16 with dynamic loss scaling (older GPUs such as the T4; not CPUs)",
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


def training_arguments(config_path: str | Path, output_dir: str | Path, **overrides):
    """HF `TrainingArguments` that agree with a DeepSpeed config file, for `Trainer(args=...)`.

    HF Trainer compares batch size, accumulation, clipping, AdamW settings, the LR schedule and the
    precision in the file with its own arguments and refuses any mismatch; this reads them from the
    file so they match. `overrides` go to TrainingArguments as well (e.g. logging_steps=1).
    """
    import torch
    from transformers import TrainingArguments
    config_path = resolve(config_path)
    config = json.loads(config_path.read_text())
    params, schedule = config["optimizer"]["params"], config["scheduler"]["params"]
    matching = dict(
        per_device_train_batch_size=config["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=config["gradient_accumulation_steps"],
        max_grad_norm=config["gradient_clipping"], learning_rate=params["lr"],
        adam_beta1=params["betas"][0], adam_beta2=params["betas"][1], adam_epsilon=params["eps"],
        weight_decay=params["weight_decay"], max_steps=schedule["total_num_steps"],
        warmup_steps=schedule["warmup_num_steps"], bf16=config.get("bf16", {}).get("enabled", False),
        fp16=config.get("fp16", {}).get("enabled", False))
    # Without a GPU, HF refuses bf16 unless told the CPU is meant (use_cpu), where DeepSpeed runs it.
    return TrainingArguments(output_dir=str(output_dir), deepspeed=str(config_path), report_to="none",
                             save_strategy="no", use_cpu=not torch.cuda.is_available(), **{**matching, **overrides})


def hf_trainer(config_path: str | Path, model, data, output_dir: str | Path, stop_after: int | None = None,
               **overrides):
    """A HF `Trainer` that trains `model` on `data` (a SyntheticTextDataset) with the config file as it is.

    stop_after: end after this many optimizer steps. HF refuses a max_steps that differs from the
    file's total_num_steps, so a short run keeps the file's schedule and is stopped by a callback.
    """
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = stop_after is not None and state.global_step >= stop_after

    # disable_tqdm: HF's notebook progress bar is an HTML display a saved notebook keeps at its first frame.
    args = training_arguments(config_path, output_dir, **{"disable_tqdm": True, **overrides})
    return Trainer(model=model, args=args, train_dataset=data,
                   data_collator=DataCollatorForLanguageModeling(data.tokenizer, mlm=False), callbacks=[StopAfter()])


def release_hf_deepspeed() -> None:
    """Undo the global state HF Trainer(deepspeed=...) leaves behind: its DeepSpeed config (which
    changes how later from_pretrained calls build models) and ACCELERATE_USE_DEEPSPEED in the
    environment (inherited by every process started afterwards)."""
    import os
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)


if __name__ == "__main__":
    for path in write_configs():
        print(path.relative_to(CONFIG_DIR.parent))
