"""Notebook 05's ZeRO-Offload runs (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model
Training"): keep the optimizer's fp32 master weights and Adam moments in host RAM and run Adam on the CPU
(DeepSpeed's vectorised `DeepSpeedCPUAdam`); with ZeRO-3, park the parameter partitions there too.

Each step the accelerator sends its gradient partition down to the host and gets the updated parameters
back, so device memory drops to the parameters (and, stage 1, gradients) at the price of host traffic
and a CPU optimizer step. Where the bytes live is read from the engine (measured.split_by_side), not assumed.
"""
from __future__ import annotations

from pathlib import Path
from statistics import median_high   # the middle step (the higher of two): a step that really ran

from .measured import measuring_trainer, split_by_side


def run_config(name: str, zero_optimization: dict, data, steps: int = 6, **trainer_args) -> dict:
    """Train the tiny model briefly with this `zero_optimization` block (offload blocks as written: offload
    needs ZeRO >= 1, parameter offload ZeRO-3); where its bytes live, its step times and losses."""
    block = dict(zero_optimization)
    trainer = measuring_trainer(
        data, name=name, micro_batch=8, warmup_steps=2, total_steps=steps + 4, zero_stage=block.pop("stage"),
        offload_optimizer="offload_optimizer" in block, offload_param="offload_param" in block,
        zero_extra=block, **trainer_args)
    trainer.train(1, progress=False)       # Adam state exists after the first step
    sides = split_by_side(trainer.engine)  # what the rank holds between steps
    history = trainer.train(steps, progress=False)
    inner = getattr(trainer.engine.optimizer, "optimizer", trainer.engine.optimizer)
    result = {"name": name, "stage": trainer.config["zero_optimization"]["stage"], "n_params": trainer.n_params,
              "precision": trainer.precision, "zero_optimization": trainer.config["zero_optimization"],
              "optimizer": type(inner).__name__, **sides,
              "step_s": [m["step_s"] for m in history], "losses": [m["loss"] for m in trainer.history],
              "device": str(trainer.engine.device)}
    trainer.engine.destroy()
    return result


def compare(data, zero_blocks: dict[str, dict], steps: int = 6, output_dir=".") -> list[dict]:
    """`run_config` for each named `zero_optimization` block, same data, model and seed."""
    return [run_config(name, block, data, steps, output_dir=Path(output_dir) / f"offload{i}")
            for i, (name, block) in enumerate(zero_blocks.items())]


def rows(results: list[dict]) -> list[dict]:
    """A table: MB on each side, the optimizer that ran, median step time and its ratio to the first row
    (the first step of each run is left out: it includes one-off set-up)."""
    base = median_high(results[0]["step_s"][1:])
    return [{"config": r["name"], "accelerator MB": r["accelerator_bytes"] / 1e6, "host MB": r["host_bytes"] / 1e6,
             "host tensors on": ",".join(r["host_devices"]) or "-", "optimizer": r["optimizer"],
             "step ms": 1e3 * median_high(r["step_s"][1:]), "time vs first": median_high(r["step_s"][1:]) / base,
             "final loss": r["losses"][-1]} for r in results]
