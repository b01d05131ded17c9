"""HF `Trainer` with a DeepSpeed config as it is: the `TrainingArguments` that agree with the file (HF
compares its own arguments with the config and refuses any mismatch), a `Trainer` on the tutorial's data,
and the global state HF leaves behind undone."""
from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

from helpers.precision import precision_of
from helpers.presets import resolve


class StopAfter(TrainerCallback):
    """Stop a HF `Trainer` after `steps` optimizer steps: HF refuses a `max_steps` other than the DeepSpeed
    config's `total_num_steps`, so a short demo run of a file keeps the file's schedule and stops early."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.steps


def matching_arguments(config: dict) -> dict:
    """The TrainingArguments HF cross-checks against a DeepSpeed config (batch, accumulation, clipping,
    AdamW settings, the LR schedule, the precision), read from the config so the two cannot disagree."""
    params, schedule = config["optimizer"]["params"], config["scheduler"]["params"]
    return dict(per_device_train_batch_size=config["train_micro_batch_size_per_gpu"],
                gradient_accumulation_steps=config["gradient_accumulation_steps"],
                max_grad_norm=config["gradient_clipping"], learning_rate=params["lr"],
                adam_beta1=params["betas"][0], adam_beta2=params["betas"][1], adam_epsilon=params["eps"],
                weight_decay=params["weight_decay"], max_steps=schedule["total_num_steps"],
                warmup_steps=schedule["warmup_num_steps"],
                **{name: precision_of(config) == name for name in ("bf16", "fp16")})


def training_arguments(config_path: str | Path, output_dir: str | Path, **overrides):
    """HF `TrainingArguments` that agree with a DeepSpeed config file (`matching_arguments`), for
    `Trainer(args=...)`; `overrides` go to TrainingArguments as well (e.g. logging_steps=1)."""
    import torch
    from transformers import TrainingArguments
    config_path = resolve(config_path)
    matching = matching_arguments(json.loads(config_path.read_text()))
    # Without a GPU, HF refuses bf16 unless told the CPU is meant (use_cpu), where DeepSpeed runs it.
    return TrainingArguments(output_dir=str(output_dir), deepspeed=str(config_path), report_to="none",
                             save_strategy="no", use_cpu=not torch.cuda.is_available(), **{**matching, **overrides})


def hf_trainer(config_path: str | Path, model, data, output_dir: str | Path, stop_after: int, **overrides):
    """A HF `Trainer` that trains `model` on `data` with the config file as it is, for `stop_after` steps:
    HF refuses a max_steps other than the file's total_num_steps, so a callback stops it."""
    from transformers import DataCollatorForLanguageModeling, Trainer

    # disable_tqdm: HF's notebook progress bar is an HTML display a saved notebook keeps at its first frame.
    args = training_arguments(config_path, output_dir, **{"disable_tqdm": True, **overrides})
    return Trainer(model=model, args=args, train_dataset=data,
                   data_collator=DataCollatorForLanguageModeling(data.tokenizer, mlm=False), callbacks=[StopAfter(stop_after)])


def release_hf_deepspeed() -> None:
    """Undo the global state HF Trainer(deepspeed=...) leaves behind: its DeepSpeed config (which
    changes how later from_pretrained calls build models) and ACCELERATE_USE_DEEPSPEED in the
    environment (inherited by every process started afterwards)."""
    import os
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
