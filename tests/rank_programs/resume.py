"""Exact resume at every ZeRO stage, on N ranks, across processes.

Phase "straight": for each stage, train N steps from scratch, saving a checkpoint after N/2.
Phase "resumed" (a new launch, so new processes): for each stage, load the N/2 checkpoint and train
the remaining N/2. Every step records its loss, learning rate and a fingerprint of the token ids
each micro-batch fed the model, so the comparison covers the weights and optimizer (losses), the LR
schedule and the data order. On a CPU the two must agree bitwise.
"""
import argparse
from pathlib import Path

import torch

from helpers.data import SyntheticTextDataset
from helpers.launch import write_result
from helpers.memory.measured import measurement_zero_extra
from helpers.model import MODEL_SIZES, gpt2_param_count
from tests.trainers import make_trainer


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--phase", choices=("straight", "resumed"), required=True)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=8, help="even: the checkpoint is taken after steps/2")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="train compiled (engine.compile()) in both phases")
    return p.parse_args(argv)


def record_data(trainer) -> list[int]:
    """Fingerprint (sum of token ids) of every micro-batch the trainer draws from now on."""
    seen, draw = [], trainer.batches.next

    def recording():
        ids = draw()
        seen.append(int(ids.sum()))
        return ids
    trainer.batches.next = recording
    return seen


def run_stage(a, stage: int, data) -> dict:
    n_layer, n_embd, _ = MODEL_SIZES["tiny"]
    extra = measurement_zero_extra(gpt2_param_count(data.vocab_size, a.seq_len, n_layer, n_embd))
    checkpoints = Path(a.out).parent / f"stage{stage}-checkpoints"   # shared by both phases' out dirs
    trainer = make_trainer(
        data, zero_stage=stage, micro_batch=a.micro_batch, grad_accum=a.grad_accum,
        warmup_steps=3, total_steps=a.steps + 2, seed=a.seed, output_dir=Path(a.out) / f"stage{stage}",
        zero_extra=extra, resume_from=checkpoints if a.phase == "resumed" else None, compile=a.compile)
    data_seen = record_data(trainer)
    half = a.steps // 2
    if a.phase == "straight":
        history = trainer.train(half, progress=False)
        trainer.save_checkpoint(checkpoints)
        history += trainer.train(a.steps - half, progress=False)
    else:
        history = trainer.train(a.steps - half, progress=False)
    trainer.engine.destroy()
    return {"stage": stage, "steps": [m["step"] for m in history], "losses": [m["loss"] for m in history],
            "lrs": [m["lr"] for m in history], "data": data_seen, "world_size": trainer.engine.world_size}


def main(argv=None):
    a = parse(argv)
    if a.steps < 2 or a.steps % 2:
        raise SystemExit(f"--steps={a.steps}: use an even number >= 2 (the checkpoint is taken halfway)")
    data = SyntheticTextDataset("markov", n_samples=256, seq_len=a.seq_len, seed=a.seed)
    write_result(a.out, {"phase": a.phase, "stages": [run_stage(a, s, data) for s in a.stages]})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()   # gloo's threads end before exit can abort them (SIGABRT)


if __name__ == "__main__":
    main()


# ---- the notebook's / test's side ----

def run(n_ranks: int, stages=(0, 1, 2, 3), steps: int = 8, out_dir=".", **options) -> dict:
    """Both phases on n_ranks (two launches); {"straight": [...], "resumed": [...]} per rank."""
    from helpers.launch import flags, launch
    args = flags({"stages": stages, "steps": steps, **options})
    base = Path(out_dir) / f"resume-{n_ranks}ranks"
    return {phase: launch(__name__, n_ranks, [*args, f"--phase={phase}"], out_dir=base / phase)
            for phase in ("straight", "resumed")}


def compare(results: dict) -> list[dict]:
    """Per stage and rank: the resumed run's second half against the straight run's."""
    rows = []
    for straight, resumed in zip(results["straight"], results["resumed"]):
        for s, r in zip(straight["stages"], resumed["stages"]):
            half = len(s["losses"]) - len(r["losses"])
            rows.append({"stage": s["stage"], "rank": straight["rank"], "world size": s["world_size"],
                         "steps compared": len(r["losses"]), "same steps": s["steps"][half:] == r["steps"],
                         "max |loss difference|": max(abs(x - y) for x, y in zip(s["losses"][half:], r["losses"])),
                         "same lr": s["lrs"][half:] == r["lrs"],
                         "same data": s["data"][len(s["data"]) - len(r["data"]):] == r["data"]})
    return rows
