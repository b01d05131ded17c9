"""Where a training step's time goes: AdvancedDeepSpeedTrainer vs the plain loop, phase by phase.

    python -m benchmarks.step_phases                  # ZeRO 0-3, 30 steps each, the CPU sizes of trainer_vs_plain
    python -m benchmarks.step_phases --stages 2 --steps 60

The profile behind the trainer's defaults. Unlike benchmarks.trainer_vs_plain (separate processes,
blocks of steps), both run in this one process, one step each in turn, so machine noise hits both
alike step by step. The trainer runs its real train_step(); DeepSpeed's forward, backward and step
are timed by wrapping the engine's own methods, and whatever else the step does (data, the trainer's
gradient norm at ZeRO 0, the loss's host sync, metrics) is the rest. Medians over steps, milliseconds,
and the trainer's speed relative to the plain loop: the median over steps of plain step / trainer step
(> 1: the trainer is faster). The trainer's CPU memory setting (helpers.runtime.keep_freed_memory) is
process-wide, so the plain loop here runs with it too: this compares the two loops' own work.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from .contenders import DeepSpeedTrainer, Plain, Setup
from .trainer_vs_plain import load_data

PHASES = ("forward", "backward", "step", "rest", "total")


def timed(record: dict, phase: str, fn):
    """fn, adding its wall time to record[phase] on every call."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record[phase] += time.perf_counter() - start
    return wrapper


def instrument(trainer) -> dict:
    """Time the engine's forward (via __call__), backward and step inside trainer.train_step()."""
    record = dict.fromkeys(PHASES, 0.0)
    engine = trainer.engine
    engine.forward = timed(record, "forward", engine.forward)   # an instance attribute: nn.Module calls it
    engine.backward = timed(record, "backward", engine.backward)
    engine.step = timed(record, "step", engine.step)
    return record


def trainer_step(trainer, record: dict) -> dict:
    for phase in PHASES:
        record[phase] = 0.0
    start = time.perf_counter()
    trainer.train_step()
    record["total"] = time.perf_counter() - start
    record["rest"] = record["total"] - record["forward"] - record["backward"] - record["step"]
    return dict(record)


def profile_stage(data, setup: Setup, stage: int, steps: int, warmup: int = 2) -> dict:
    ds, plain = DeepSpeedTrainer(data, setup, stage), Plain(data, setup)
    ds.train(warmup)
    plain.train(warmup)
    record = instrument(ds.trainer)
    runs = {"plain": [], f"ds{stage}": []}
    for i in range(steps):   # alternate which goes first, so neither always follows the other
        order = ("plain", "ds") if i % 2 == 0 else ("ds", "plain")
        for who in order:
            if who == "plain":
                runs["plain"].append(plain.step())
            else:
                runs[f"ds{stage}"].append(trainer_step(ds.trainer, record))
    rows = {name: {ph: 1e3 * statistics.median(s[ph] for s in steps_) for ph in PHASES}
            for name, steps_ in runs.items()}
    # steps i of the two ran back to back: the median of their paired ratios is robust to a slow spell
    pairs = zip(runs["plain"], runs[f"ds{stage}"])
    rows[f"ds{stage}"]["speed_vs_plain"] = statistics.median(p["total"] / d["total"] for p, d in pairs)
    rows["plain"]["speed_vs_plain"] = 1.0
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, nargs="*", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model-size", default="small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--n-words", type=int, default=4096)
    p.add_argument("--out-dir", default="runs/benchmarks/step_phases")
    a = p.parse_args(argv)
    a.vocab_size, a.seed, a.total = None, 0, (a.steps + 2) * 2
    data = load_data(a)
    setup = Setup(device="cpu", precision="fp32", model_size=a.model_size, micro_batch=a.micro_batch, lr=3e-3,
                  warmup=5, total=a.total, grad_clip=1.0, seed=0, threads=torch.get_num_threads(),
                  out_dir=str(Path(a.out_dir)))
    results = {}
    print(f"median ms per step over {a.steps} steps, interleaved in one process ({torch.get_num_threads()} threads)")
    print(f"{'':8s}" + "".join(f"{ph:>10s}" for ph in PHASES) + "   speed vs plain, median of paired steps")
    for stage in a.stages:
        results[stage] = profile_stage(data, setup, stage, a.steps)
        for name, row in results[stage].items():
            print(f"{name:8s}" + "".join(f"{row[ph]:10.1f}" for ph in PHASES) + f"   {row['speed_vs_plain']:.3f}")
    return results


if __name__ == "__main__":
    main()
