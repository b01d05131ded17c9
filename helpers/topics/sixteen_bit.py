"""Notebook 05's 16-bit runs: model-state bytes, activation bytes and speed of a 16-bit format beside fp32,
measured (notebook 05 explains what mixed precision keeps in 16 bits and what stays fp32)."""
from __future__ import annotations

from pathlib import Path
from statistics import median_high

from .activations import measure_step_memory


MICRO_BATCH, GRAD_ACCUM = 4, 2


def model_states(run, data, precision: str, steps: int = 4, output_dir=".") -> dict:
    """Train briefly at ZeRO 1 in `precision` with `run` (the ZeRO comparison's `run_here`: its `run_stage`, in
    this process, handed in by the caller, since a library module imports no program); bytes held per
    component (read mid-accumulation by zero_stages.Measure), tokens/s of its timed steps and losses."""
    r = run({"stage": 1}, data, Path(output_dir) / precision, steps=steps, precision=precision,
            micro_batch=MICRO_BATCH, grad_accum=GRAD_ACCUM)
    tokens_per_step = MICRO_BATCH * GRAD_ACCUM * data.seq_len   # one rank
    return {"precision": precision, "n_params": r["n_params"], "held_bytes": r["held_bytes"],
            "tokens_per_s": tokens_per_step / median_high(r["step_s"]), "losses": r["losses"]}


def compare(run, data, precisions, output_dir=".", seq_len: int = 512) -> list[dict]:
    """Model states (ZeRO 1, trained by `run`: see `model_states`) and one plain-PyTorch step's activations
    (in a fresh process), per precision."""
    rows = []
    for precision in precisions:
        act = measure_step_memory("tiny", seq_len, micro_batch=1, precision=precision, steps=2)
        rows.append({**model_states(run, data, precision, output_dir=output_dir), "activation_bytes": act["forward_bytes"]})
    return rows
