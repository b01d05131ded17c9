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
(OUTPUT_DIR/checkpoints, the last --keep-last of them, with the model config and tokenizer that
`python -m helpers.export` needs) and, on rank 0, OUTPUT_DIR/metrics.json, and prints where they are.

SIGTERM (a scheduler, a spot VM) or SIGINT (Ctrl-C) ends the run after the step it arrives in, on every
rank: it writes a complete checkpoint and exits with status 128 + the signal's number (143 for SIGTERM),
saying where to resume from (--resume-from OUTPUT_DIR/checkpoints).

The file is the DeepSpeed config: it reaches `deepspeed.initialize` as written (validated once, on
this many ranks), and the trainer reads batch size, accumulation and ZeRO stage back from the engine.
Only the TensorBoard block is the script's own (OUTPUT_DIR/tensorboard). A pipeline config is refused
(this script trains a GPT2LMHeadModel, not a PipelineModule), before any model is built.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings
from pathlib import Path

from helpers.config import load_json, micro_batch_of, validate
from helpers.errors import ConfigError, InputError, integer
from helpers.interrupts import StopRequested


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a DeepSpeed JSON config, e.g. configs/zero2.json")
    p.add_argument("--steps", type=integer(1), default=None,
                   help="train until this optimizer step (default: the schedule's total_num_steps); "
                        "a resumed run continues up to it")
    p.add_argument("--model-size", default="tiny", choices=("tiny", "small", "base", "gpt2", "auto"))
    p.add_argument("--seq-len", type=integer(2, "a token to predict and one to predict it from"), default=64)
    p.add_argument("--data", default=None,
                   help="your own text: a text file, a folder of text files, a dataset saved with "
                        "Dataset.save_to_disk, or a dataset name on the Hugging Face hub (online only); "
                        "default: synthetic Markov text, whose best possible loss is known")
    # The four options of --data default to None here, so that load_own_text's defaults are the only ones.
    p.add_argument("--text-column", help="with --data: the column that holds the text (default: text)")
    p.add_argument("--tokenizer", help="with --data: 'word-level' (the default: trained on your text here), a "
                                       "folder written by save_pretrained, or a tokenizer name on the hub (online only)")
    p.add_argument("--vocab-size", type=integer(4, "3 ids are [PAD], [UNK], [EOS]"),
                   help="with --data and the word-level tokenizer: keep the most frequent words (default 8192)")
    p.add_argument("--held-out", type=float,
                   help="with --data: the fraction of rows held out for the final eval loss, drawn by --seed (default 0.1)")
    p.add_argument("--n-samples", type=integer(1), default=None, help="synthetic data only: training sequences (default 2048)")
    p.add_argument("--eval-samples", type=integer(1), default=None,
                   help="synthetic data only: held-out sequences for the final eval loss (default 256)")
    p.add_argument("--output-dir", default=None, help="default: --out if given, else runs/train/<config name>")
    p.add_argument("--resume-from", default=None, help="a checkpoints directory written by an earlier run, or one checkpoint's own folder "
                                                       "(e.g. the output of ds_to_universal)")
    p.add_argument("--save-every", type=integer(0), default=0, help="also checkpoint every K steps (0: only at the end)")
    p.add_argument("--keep-last", type=integer(0), default=3,
                   help="keep the newest K checkpoints, delete older ones after each save (0: keep all)")
    p.add_argument("--compile", action="store_true",
                   help="compile the model (DeepSpeed's engine.compile(), torch.compile): the first step "
                        "compiles (20-40 s for a small model on a 2-core CPU), later ones run faster; implied "
                        "by compile.deepcompile=true in the file (DeepCompile, CUDA only)")
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--out", default=None, help="also write each rank's result as OUT/rank<N>.json "
                                               "(what helpers.launch.run_program reads)")
    # The deepspeed launcher passes --local_rank unless told --no_local_rank; LOCAL_RANK is in the
    # environment either way, so it is accepted and ignored.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for flag in ("output_dir", "out"):
        check_writable_dir(p, flag, getattr(a, flag))
    if a.data is not None and (a.n_samples is not None or a.eval_samples is not None):
        p.error("--n-samples and --eval-samples size the synthetic data; with --data the size is your text's "
                "(use --held-out for the held-out fraction)")
    if a.data is None and own_text_options(a):
        p.error(f"{', '.join('--' + k.replace('_', '-') for k in own_text_options(a))} only apply to your own "
                "text: add --data FILE_OR_FOLDER")
    return a


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


def train(a: argparse.Namespace) -> dict:
    """Hand the file's dict to the trainer, train to --steps with checkpoints, and report the run."""
    from helpers.interrupts import holding_signals
    from helpers.launch import save_config
    from helpers.runtime import detect, local_world_size, process_rank, run_dir, world_size
    from helpers.trainer import AdvancedDeepSpeedTrainer
    output_dir = Path(a.output_dir or a.out or run_dir(f"train/{Path(a.config).stem}"))
    config = load_json(a.config) | {"tensorboard": {   # the one block the script owns
        "enabled": True, "output_path": str(output_dir / "tensorboard"), "job_name": Path(a.config).stem}}
    check_runnable(config)
    steps = run_length(config, a.steps)
    check_cost(a, config, world_size(), detect().device, local_world_size())
    data, held_out = own_data(a, config, world_size()) if a.data is not None else synthetic_data(a)
    # DeepSpeed applies its compile block (DeepCompile) only inside engine.compile(): asking for it is asking to compile.
    compile = a.compile or bool((config.get("compile") or {}).get("deepcompile"))
    if a.out:
        save_config(a.out, Path(a.config).stem, config)
    with holding_signals():   # a SIGTERM or SIGINT from here on ends the run at a step boundary, saved
        trainer = AdvancedDeepSpeedTrainer(data, config, model_size=a.model_size, output_dir=output_dir, seed=a.seed,
                                           name=Path(a.config).stem, resume_from=a.resume_from, compile=compile)
        checkpoint = _train_with_checkpoints(trainer, steps, a.save_every, a.keep_last, output_dir / "checkpoints",
                                             progress=process_rank() == 0)
    return {"config": str(a.config), "world_size": trainer.engine.world_size, "rank": process_rank(),
            "steps": trainer.step, "history": trainer.history, "eval_loss": trainer.evaluate(held_out),
            "floor_nats": data.floor_nats, "data": a.data or "synthetic Markov text", "summary": trainer.summary(), "checkpoint": str(checkpoint),
            "tensorboard": str(trainer.tensorboard_logdir), "output_dir": str(output_dir)}


def _train_with_checkpoints(trainer, steps: int, save_every: int, keep_last: int, directory: Path,
                            progress: bool) -> Path:
    """Train up to global step `steps`, checkpointing every `save_every` steps, at the end, and when a
    signal stops the run (StopRequested goes on up, once its checkpoint is complete)."""
    from helpers.interrupts import StopRequested
    from helpers.runtime import process_rank
    if process_rank() == 0:   # what `python -m helpers.export DIRECTORY OUT` needs beside the weights
        directory.mkdir(parents=True, exist_ok=True)
        trainer.engine.module.config.save_pretrained(directory)
        trainer.tokenizer.save_pretrained(directory)
    last = None
    while trainer.step < steps:
        chunk = steps - trainer.step if not save_every else min(save_every - trainer.step % save_every,
                                                                steps - trainer.step)
        try:
            trainer.train(chunk, progress=progress)
        except StopRequested as stop:
            stop.checkpoint = trainer.save_checkpoint(directory, keep_last)
            raise
        last = trainer.save_checkpoint(directory, keep_last)
    if last is None:   # nothing left to train (a resumed run already at --steps): save where it stands
        last = trainer.save_checkpoint(directory, keep_last)
    return last


# Not runtime.rank_process: the trainer joins the group itself, and a signalled stop ends it too (no barrier).
def cli(argv=None) -> None:
    """The script's entry point: a mistake in the input (config, checkpoint) is one line on stderr and
    exit status 1, not a traceback; anything else is a bug and keeps its traceback."""
    try:
        main(argv)
        end_process_group()
    except InputError as err:   # a config, data, checkpoint or option mistake
        sys.exit(f"error: {err}")
    except StopRequested as stop:   # a scheduler reads the signal from the status: 128 + its number
        print(f"{signal.Signals(stop.signum).name}: stopped after step {stop.step}; checkpoint {stop.checkpoint} is "
              f"complete; continue with --resume-from {stop.checkpoint.parent}", file=sys.stderr, flush=True)
        end_process_group()
        sys.exit(128 + stop.signum)


def end_process_group() -> None:
    """Every rank is past its last collective: end the group while Python is alive, since gloo's threads
    left running at exit can abort the interpreter (SIGABRT, "terminate called without an active exception")."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- below: the checks made before any model is built, and the data (what parse, train and
# helpers.launch.run_program's check_options call) ----


def check_writable_dir(p: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """A folder the run can create or write into: an existing file, or a file on the way to it, would fail only
    once DeepSpeed writes its first TensorBoard event or checkpoint."""
    if path is None:
        return
    existing = next(q for q in (Path(path).absolute(), *Path(path).absolute().parents) if q.exists())
    if not existing.is_dir():
        p.error(f"--{flag.replace('_', '-')} {path}: {existing} is a file; name a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        p.error(f"--{flag.replace('_', '-')} {path}: {existing} is not writable; name a folder you can write to")


def check_options(a: argparse.Namespace, world_size: int) -> None:
    """Before any rank starts (helpers.launch.run_program): the config file must exist and be a config
    DeepSpeed accepts on this many ranks. A relative path may start at the repository root, where the
    launcher runs the ranks."""
    from helpers import REPO_ROOT
    from helpers.launch import gpu_count
    path = Path(a.config) if Path(a.config).is_file() else REPO_ROOT / a.config
    if not path.is_file():
        raise ConfigError(f"config file {a.config} not found (relative paths may start at the repository root)")
    device = "cuda" if gpu_count() >= world_size else "cpu"
    config = validate(load_json(path), device=device, world_size=world_size)
    check_runnable(config)
    check_cost(a, config, world_size, device, local_ranks=world_size)   # a local launch: every rank here
    if a.data is not None:   # a data mistake (missing file, no text column, too little text) fails here too
        own_data(a, config, world_size)


def own_data(a: argparse.Namespace, config: dict, world_size: int):
    """--data read, tokenised and packed to --seq-len: (train, held_out), or a DataError naming the problem."""
    from helpers.own_text import load_own_text, require_global_batch
    train, held_out = load_own_text(a.data, a.seq_len, seed=a.seed, **own_text_options(a))
    accum = config.get("gradient_accumulation_steps", 1)
    require_global_batch(train, micro_batch_of(config, world_size) * accum * world_size, a.data)
    return train, held_out


def own_text_options(a: argparse.Namespace) -> dict:
    """The --data options given on the command line, as load_own_text's keyword arguments."""
    given = dict(tokenizer=a.tokenizer, text_column=a.text_column, held_out=a.held_out, vocab_size=a.vocab_size)
    return {key: value for key, value in given.items() if value is not None}


# Synthetic data that takes longer than this to generate is warned about before it starts; below TIMED_TOKENS
# (seconds on any CPU: 12 s on a 2-core EPYC) it is not timed, which would cost every run a second.
SLOW_DATA_S, TIMED_TOKENS = 60, 4_000_000


def check_cost(a: argparse.Namespace, config: dict, world_size: int, device: str, local_ranks: int) -> None:
    """The run's memory by the formulas (helpers.memory.budget) against what is free, before any data or
    model is built: a --seq-len of 100000 is refused in a second, not found out after minutes. Synthetic
    data that would take minutes to generate is warned about, with the time measured on a sample."""
    from helpers.data import N_WORDS, SPECIAL_TOKENS, generation_seconds
    from helpers.errors import CostWarning
    from helpers.memory import budget
    from helpers.runtime import process_rank
    from helpers.model import auto_model_size
    from helpers.runtime import detect
    size = auto_model_size(detect()) if a.model_size == "auto" else a.model_size
    if a.data is None:   # the synthetic data's vocabulary, and its tokens, held as ids and tensors
        vocab, tokens = N_WORDS + len(SPECIAL_TOKENS), sum(synthetic_sizes(a)) * a.seq_len
    else:   # your text's size is known only once read: its vocabulary at most
        vocab, tokens = a.vocab_size or 8192, 0
    need = budget.run_bytes(config, size, a.seq_len, a.seq_len, vocab, world_size, data_tokens=tokens)
    budget.check_fits(need, device, local_ranks, what=f"training --model-size {size} at --seq-len {a.seq_len}")
    n = sum(synthetic_sizes(a))
    if a.data is None and n * a.seq_len > TIMED_TOKENS and process_rank() == 0:
        seconds = generation_seconds(n, a.seq_len)
        if seconds > SLOW_DATA_S:
            warnings.warn(f"generating {n:,} synthetic sequences of --seq-len {a.seq_len} takes about "
                          f"{seconds / 60:.0f} min here (a sample timed and scaled): fewer --n-samples start sooner, "
                          "and training repeats them in epochs", CostWarning, stacklevel=2)


def synthetic_sizes(a: argparse.Namespace) -> tuple[int, int]:
    """(training, held-out) sequences of the synthetic data."""
    return tuple(default if given is None else given for given, default in ((a.n_samples, 2048), (a.eval_samples, 256)))


def synthetic_data(a: argparse.Namespace):
    """Markov text whose best achievable loss is known: (train, held_out), sharing one tokenizer."""
    from helpers.data import SyntheticTextDataset
    n_train, n_held_out = synthetic_sizes(a)
    data = SyntheticTextDataset("markov", n_samples=n_train, seq_len=a.seq_len, seed=a.seed)
    return data, SyntheticTextDataset("markov", n_samples=n_held_out, seq_len=a.seq_len, seed=a.seed + 1,
                                      tokenizer=data.tokenizer)


def check_runnable(config: dict) -> None:
    if "pipeline" in config:
        raise ConfigError("'pipeline' config: pipeline parallelism needs a deepspeed.pipe.PipelineModule, and "
                          "this script trains a GPT2LMHeadModel; use the file with a PipelineModule "
                          "(see notebook 06), or a configs/zero*.json here")


def run_length(config: dict, steps: int | None) -> int:
    """--steps, or by default the whole LR schedule; never past its end, where the rate is 0."""
    total = (config.get("scheduler") or {}).get("params", {}).get("total_num_steps")
    if steps is None and total is None:
        raise ConfigError("no scheduler.params.total_num_steps in the file to train to: pass --steps")
    if steps is None:
        return total
    if total is not None and steps > total:
        raise ConfigError(f"--steps={steps} runs past scheduler.params.total_num_steps={total}, where the "
                          "learning rate has decayed to 0: train fewer steps or raise total_num_steps in the file")
    return steps


if __name__ == "__main__":
    cli()
