"""Notebook 05's ZeRO-Offload runs (Ren et al. 2021): optimizer states, and with ZeRO-3 parameters, in host
RAM, Adam on the CPU (DeepSpeedCPUAdam); where the bytes live is read from the engine, not assumed."""
from __future__ import annotations

from pathlib import Path
from statistics import median_high   # the middle step (the higher of two): a step that really ran


def compare(run, data, zero_blocks: dict[str, dict], steps: int = 6, output_dir=".") -> list[dict]:
    """`run` (the ZeRO comparison's `run_here`: helpers/programs/zero_stages.py's `run_stage` in this process,
    handed in by the caller, since a library module imports no program) once per named `zero_optimization`
    block (offload blocks as written: offload needs ZeRO >= 1, parameter offload ZeRO-3), same data, model
    and seed: where its bytes live, the optimizer DeepSpeed built, step times, losses."""
    return [{"name": name, **run(block, data, Path(output_dir) / f"offload{i}", steps=steps)}
            for i, (name, block) in enumerate(zero_blocks.items())]


def rows(results: list[dict]) -> list[dict]:
    """A table: MB on each side, the optimizer that ran, median step time (of run_stage's timed steps,
    after its warm-up) and its ratio to the first row."""
    base = median_high(results[0]["step_s"])
    return [{"config": r["name"], "accelerator MB": r["accelerator_bytes"] / 1e6, "host MB": r["host_bytes"] / 1e6,
             "host tensors on": ",".join(r["host_devices"]) or "-", "optimizer": r["optimizer"],
             "step ms": 1e3 * median_high(r["step_s"]), "time vs first": median_high(r["step_s"]) / base,
             "final loss": r["losses"][-1]} for r in results]
