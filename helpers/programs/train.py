"""Train the tutorial's GPT-2 from a DeepSpeed JSON config, as a script under a launcher.

The notebooks run one rank inside the kernel; this runs the same `AdvancedDeepSpeedTrainer` on as
many ranks as a launcher starts (the world size comes from the launcher, never from the file):

    python -m helpers.programs.train --config configs/zero2.json             # 1 rank
    deepspeed --num_gpus 8 --module helpers.programs.train --config configs/zero3.json
    torchrun --nproc_per_node 8 -m helpers.programs.train --config configs/zero3.json
    python -m helpers.programs.train --config configs/zero2.json --data my_text.txt  # your own text

The data is synthetic Markov text (its best possible loss is known) unless --data names your own
(helpers/own_text.py: a text file or folder, a dataset saved with save_to_disk, a hub name online).

It writes TensorBoard scalars (OUTPUT_DIR/tensorboard), DeepSpeed checkpoints
(OUTPUT_DIR/checkpoints, with the model config and tokenizer that `python -m helpers.export` needs)
and, on rank 0, OUTPUT_DIR/metrics.json, and prints where they are.

The file's settings reach DeepSpeed unchanged: batch size, accumulation, ZeRO stage, offload,
precision and AdamW become the trainer's arguments (they also steer its own loop), every other key
is passed through as it is, and the engine's final config is compared with the file. Only the
TensorBoard location is the script's own. A file the trainer cannot run as written (a pipeline
config, another optimizer, no LR schedule, AdamW settings the trainer does not expose) is refused
with the key named, before any training step.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from helpers.checkpoints import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from helpers.config import ConfigError, load_json, validate

# Blocks the trainer builds itself from its arguments, adding what it needs (torch's AdamW on a CPU for
# bitwise-exact resumes; its offload settings); every other top-level key is passed through as it is.
BUILT_BY_TRAINER = ("optimizer", "zero_optimization")
# Replaced by the script: metrics always go to OUTPUT_DIR/tensorboard.
REPLACED = ("tensorboard",)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a DeepSpeed JSON config, e.g. configs/zero2.json")
    p.add_argument("--steps", type=int, default=None,
                   help="train until this optimizer step (default: the schedule's total_num_steps); "
                        "a resumed run continues up to it")
    p.add_argument("--model-size", default="tiny", help="tiny, small, base, gpt2 or auto")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--data", default=None,
                   help="your own text: a text file, a folder of text files, a dataset saved with "
                        "Dataset.save_to_disk, or a dataset name on the Hugging Face hub (online only); "
                        "default: synthetic Markov text, whose best possible loss is known")
    # The four options of --data default to None here, so that load_own_text's defaults are the only ones.
    p.add_argument("--text-column", help="with --data: the column that holds the text (default: text)")
    p.add_argument("--tokenizer", help="with --data: 'word-level' (the default: trained on your text here), a "
                                       "folder written by save_pretrained, or a tokenizer name on the hub (online only)")
    p.add_argument("--vocab-size", type=int,
                   help="with --data and the word-level tokenizer: keep the most frequent words (default 8192)")
    p.add_argument("--held-out", type=float,
                   help="with --data: the fraction of rows held out for the final eval loss, drawn by --seed (default 0.1)")
    p.add_argument("--n-samples", type=int, default=None, help="synthetic data only: training sequences (default 2048)")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="synthetic data only: held-out sequences for the final eval loss (default 256)")
    p.add_argument("--output-dir", default=None, help="default: --out if given, else runs/train/<config name>")
    p.add_argument("--resume-from", default=None, help="a checkpoints directory written by an earlier run, or one checkpoint's own folder "
                                                       "(e.g. the output of ds_to_universal)")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every K steps (0: only at the end)")
    p.add_argument("--compile", action="store_true",
                   help="compile the model (DeepSpeed's engine.compile(), torch.compile): the first step "
                        "compiles (20-40 s for a small model on a 2-core CPU), later ones run faster; implied "
                        "by compile.deepcompile=true in the file (DeepCompile, CUDA only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write each rank's result as OUT/rank<N>.json "
                                               "(what helpers.launch.run_program reads)")
    # The deepspeed launcher passes --local_rank unless told --no_local_rank; LOCAL_RANK is in the
    # environment either way, so it is accepted and ignored.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps is not None and a.steps < 1:
        p.error(f"--steps={a.steps} must be at least 1")
    if a.save_every < 0:
        p.error(f"--save-every={a.save_every} must be >= 0 (0: checkpoint only at the end)")
    if a.data is not None and (a.n_samples is not None or a.eval_samples is not None):
        p.error("--n-samples and --eval-samples size the synthetic data; with --data the size is your text's "
                "(use --held-out for the held-out fraction)")
    if a.data is None and own_text_options(a):
        p.error(f"{', '.join('--' + k.replace('_', '-') for k in own_text_options(a))} only apply to your own "
                "text: add --data FILE_OR_FOLDER")
    return a


def check_options(a: argparse.Namespace, world_size: int) -> None:
    """Before any rank starts (helpers.launch.run_program): the config file must exist and be a config
    DeepSpeed accepts on this many ranks. A relative path may start at the repository root, where the
    launcher runs the ranks."""
    from helpers import REPO_ROOT
    from helpers.launch import gpu_count
    path = Path(a.config) if Path(a.config).is_file() else REPO_ROOT / a.config
    if not path.is_file():
        raise ConfigError(f"config file {a.config} not found (relative paths may start at the repository root)")
    config = validate(load_json(path), device="cuda" if gpu_count() >= world_size else "cpu", world_size=world_size)
    if a.data is not None:   # a data mistake (missing file, no text column, too little text) fails here too
        own_data(a, config, world_size)


def own_data(a: argparse.Namespace, config: dict, world_size: int):
    """--data read, tokenised and packed to --seq-len: (train, held_out), or a DataError naming the problem."""
    from helpers.own_text import load_own_text, require_global_batch
    train, held_out = load_own_text(a.data, a.seq_len, seed=a.seed, **own_text_options(a))
    accum = config.get("gradient_accumulation_steps", 1)
    require_global_batch(train, _micro_batch(config, accum, world_size) * accum * world_size, a.data)
    return train, held_out


def own_text_options(a: argparse.Namespace) -> dict:
    """The --data options given on the command line, as load_own_text's keyword arguments."""
    given = dict(tokenizer=a.tokenizer, text_column=a.text_column, held_out=a.held_out, vocab_size=a.vocab_size)
    return {key: value for key, value in given.items() if value is not None}


def synthetic_data(a: argparse.Namespace):
    """Markov text whose best achievable loss is known: (train, held_out), sharing one tokenizer."""
    from helpers.data import SyntheticTextDataset
    n_train, n_held_out = [default if given is None else given   # a 0 given must reach the dataset's own check
                           for given, default in ((a.n_samples, 2048), (a.eval_samples, 256))]
    data = SyntheticTextDataset("markov", n_samples=n_train, seq_len=a.seq_len, seed=a.seed)
    return data, SyntheticTextDataset("markov", n_samples=n_held_out, seq_len=a.seq_len, seed=a.seed + 1,
                                      tokenizer=data.tokenizer)


def precision_of(config: dict) -> str:
    if config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "bf16" if config.get("bf16", {}).get("enabled") else "fp32"


def trainer_arguments(config: dict, world_size: int) -> dict:
    """AdvancedDeepSpeedTrainer keyword arguments that make its DeepSpeed config equal `config`.

    Raises ConfigError naming the key when the trainer cannot run the file as written.
    """
    _check_runnable(config)
    zero = dict(config.get("zero_optimization", {}))
    params, schedule = config["optimizer"].get("params", {}), config["scheduler"].get("params", {})
    accum = config.get("gradient_accumulation_steps", 1)
    return dict(
        micro_batch=_micro_batch(config, accum, world_size), grad_accum=accum,
        zero_stage=zero.pop("stage", 0), precision=precision_of(config),
        offload_optimizer=zero.pop("offload_optimizer", None) is not None,
        offload_param=zero.pop("offload_param", None) is not None,
        lr=params.get("lr", 1e-3), grad_clip=config.get("gradient_clipping", 0.0),   # DeepSpeed's defaults
        # Only used to build the schedule, which the file's own block then replaces unchanged.
        warmup_steps=schedule.get("warmup_num_steps", 1), total_steps=schedule.get("total_num_steps", 1),
        zero_extra=zero,
        # DeepSpeed applies its compile block (DeepCompile) only inside engine.compile(): asking for it is asking to compile.
        compile=bool(config.get("compile", {}).get("deepcompile")),
        config_extra={k: v for k, v in config.items() if k not in BUILT_BY_TRAINER + REPLACED})


def _check_runnable(config: dict) -> None:
    if "pipeline" in config:
        raise ConfigError("'pipeline' config: pipeline parallelism needs a deepspeed.pipe.PipelineModule, and "
                          "this script trains a GPT2LMHeadModel; use the file with a PipelineModule "
                          "(see notebook 06), or a configs/zero*.json here")
    opt_type = config.get("optimizer", {}).get("type")
    if str(opt_type).lower() != "adamw":
        raise ConfigError(f"optimizer.type={opt_type!r}: the trainer trains with AdamW; set optimizer.type "
                          "to 'AdamW' (with params lr, betas, eps, weight_decay)")
    if "scheduler" not in config:
        raise ConfigError("no 'scheduler' block: the trainer always schedules the learning rate; add one, "
                          "e.g. the WarmupDecayLR block of configs/zero0.json")


def run_length(config: dict, steps: int | None) -> int:
    """--steps, or by default the whole LR schedule; never past its end, where the rate is 0."""
    total = config["scheduler"].get("params", {}).get("total_num_steps")
    if steps is None:
        return total or 1
    if total is not None and steps > total:
        raise ConfigError(f"--steps={steps} runs past scheduler.params.total_num_steps={total}, where the "
                          "learning rate has decayed to 0: train fewer steps or raise total_num_steps in the file")
    return steps


def _micro_batch(config: dict, accum: int, world_size: int) -> int:
    if "train_micro_batch_size_per_gpu" in config:
        return config["train_micro_batch_size_per_gpu"]
    total = config.get("train_batch_size")
    if total is None or total % (accum * world_size):
        raise ConfigError(f"set train_micro_batch_size_per_gpu: train_batch_size={total} is not a multiple of "
                          f"gradient_accumulation_steps ({accum}) x world size ({world_size})")
    return total // (accum * world_size)


def unhonoured(wanted: dict, used: dict, prefix: str = "") -> list[str]:
    """Every setting of `wanted` (the file) whose value differs in `used` (the engine's config)."""
    problems = []
    for key, value in wanted.items():
        path, actual = f"{prefix}{key}", used.get(key, "<missing>")
        if prefix == "" and key in REPLACED:
            continue
        if isinstance(value, dict) and isinstance(actual, dict):
            problems += unhonoured(value, actual, f"{path}.")
        elif actual != value:
            problems.append(f"{path}: file {value!r}, trainer {actual!r}")
    return problems


def train(a: argparse.Namespace) -> dict:
    """Build the trainer from the file, train to --steps with checkpoints, and report the run."""
    from helpers.runtime import detect, process_rank, run_dir, world_size
    from helpers.trainer import AdvancedDeepSpeedTrainer
    runtime = detect()
    config = validate(load_json(a.config), device=runtime.device, world_size=world_size(), capability=runtime.capability)
    arguments = trainer_arguments(config, world_size())   # refuse a bad file before building anything
    steps = run_length(config, a.steps)
    output_dir = Path(a.output_dir or a.out or run_dir(f"train/{Path(a.config).stem}"))
    data, held_out = own_data(a, config, world_size()) if a.data is not None else synthetic_data(a)
    trainer = AdvancedDeepSpeedTrainer(data, model_size=a.model_size, output_dir=output_dir, seed=a.seed,
                                       name=Path(a.config).stem, resume_from=a.resume_from,
                                       **arguments | {"compile": arguments["compile"] or a.compile})
    problems = unhonoured(config, trainer.config)
    if problems:
        raise ConfigError("the trainer cannot run this file as written (set these to the trainer's values, "
                          "or train with the file through deepspeed.initialize directly): " + "; ".join(problems))
    checkpoint = _train_with_checkpoints(trainer, steps, a.save_every, output_dir / "checkpoints",
                                         progress=process_rank() == 0)
    return {"config": str(a.config), "world_size": trainer.engine.world_size, "rank": process_rank(),
            "steps": trainer.step, "history": trainer.history, "eval_loss": trainer.evaluate(held_out),
            "floor_nats": data.floor_nats, "data": a.data or "synthetic Markov text", "summary": trainer.summary(), "checkpoint": str(checkpoint),
            "tensorboard": str(trainer.tensorboard_logdir), "output_dir": str(output_dir)}


def _train_with_checkpoints(trainer, steps: int, save_every: int, directory: Path, progress: bool) -> Path:
    """Train up to global step `steps`, checkpointing every `save_every` steps and at the end."""
    from helpers.runtime import process_rank
    last = None
    while trainer.step < steps:
        chunk = steps - trainer.step if not save_every else min(save_every - trainer.step % save_every,
                                                                steps - trainer.step)
        trainer.train(chunk, progress=progress)
        last = trainer.save_checkpoint(directory)
    if last is None:   # nothing left to train (a resumed run already at --steps): save where it stands
        last = trainer.save_checkpoint(directory)
    if process_rank() == 0:   # what `python -m helpers.export DIRECTORY OUT` needs beside the weights
        trainer.engine.module.config.save_pretrained(directory)
        trainer.tokenizer.save_pretrained(directory)
    return last


def main(argv=None) -> dict:
    a = parse(argv)
    result = train(a)
    if a.out is not None:
        from helpers.launch import write_result
        write_result(a.out, result)
    if result["rank"] == 0:
        metrics = Path(result["output_dir"]) / "metrics.json"
        metrics.write_text(json.dumps(result, indent=1))
        print(f"trained {result['steps']} steps on {result['world_size']} rank(s): final loss "
              f"{result['history'][-1]['loss']:.3f}, held-out loss {result['eval_loss']:.3f}"
              + (f" (floor {result['floor_nats']:.3f})" if result["floor_nats"] is not None else "")
              + f" on {result['data']}\n"
              f"metrics:     {metrics}\ncheckpoint:  {result['checkpoint']}\n"
              f"tensorboard: tensorboard --logdir {Path(result['tensorboard']).parent}")
    return result


def cli(argv=None) -> None:
    """The script's entry point: a mistake in the input (config, checkpoint) is one line on stderr and
    exit status 1, not a traceback; anything else is a bug and keeps its traceback."""
    try:
        main(argv)
    except (ConfigError, CheckpointNotFoundError, CheckpointCorruptError, CheckpointMismatchError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    cli()
