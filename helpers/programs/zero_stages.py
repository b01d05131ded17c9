"""The ZeRO comparison (notebook 04): train the same model on the same data at each ZeRO stage in turn
and record what this rank holds, how long steps take, the losses, and what it sent.

    torchrun --nproc_per_node 2 -m helpers.programs.zero_stages --out runs/zero --stages 0 1 2 3

One launch runs every stage (starting N processes costs more than a stage's training). Every rank
builds the identical model (same seed) and reads its own shard of the same data order; the only
thing that changes between stages is the config's zero_optimization block (`zero_extra` below adds to
the trainer's; each result records the whole block DeepSpeed ran with).
"""
import argparse

import torch

from helpers import comms
from helpers.data import SyntheticTextDataset
from helpers.launch import write_result
from helpers.memory.measured import measure_held, measurement_zero_extra, split_by_side, zero2_overhang_bytes
from helpers.memory.measured import peak_memory
from helpers.model import MODEL_SIZES, gpt2_param_count
from helpers.trainer import AdvancedDeepSpeedTrainer


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--stages", type=int, nargs="+", required=True, help="run one after another")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2, help=">= 2: see helpers.memory.measured.measure_held")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paper-comm", action="store_true",
                   help="configure ZeRO-2/3 communication as the paper describes it (see notebook 04)")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="ZeRO-Offload: optimizer state and its step on the host (stages 1-3; notebook 05)")
    return p.parse_args(argv)


# DeepSpeed's defaults differ from the paper's algorithm in two places (measured in notebook 04):
# ZeRO-1/2 average gradients with all-reduce buckets (use_multi_rank_bucket_allreduce) instead of
# reducing each partition to its owner, and ZeRO-3 keeps gathered parameters alive from forward to
# backward (max_reuse_distance) instead of gathering them again. These switch to the paper's way.
PAPER_COMM = {1: {"use_multi_rank_bucket_allreduce": False}, 2: {"use_multi_rank_bucket_allreduce": False},
              3: {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0}}


def zero_extra(a, stage: int, n_params: int) -> dict:
    """Keys added to the trainer's zero_optimization block: buckets small enough that ZeRO really
    partitions this tiny model (measurement_zero_extra), and the paper's algorithm."""
    return {**measurement_zero_extra(n_params), **(PAPER_COMM.get(stage, {}) if a.paper_comm else {})}


def run_stage(a, stage: int, data, n_params: int) -> dict:
    """Train at one ZeRO stage; return what this rank held, sent, and how its steps went."""
    extra = zero_extra(a, stage, n_params)
    trainer = AdvancedDeepSpeedTrainer(
        data, model_size=a.model_size, zero_stage=stage, micro_batch=a.micro_batch, grad_accum=a.grad_accum,
        lr=a.lr, warmup_steps=2, total_steps=a.steps + 1, seed=a.seed, output_dir=f"{a.out}/stage{stage}",
        offload_optimizer=a.offload_optimizer, zero_extra=extra)
    if trainer.runtime.is_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train(1, progress=False)             # warm-up: buffers allocated, optimizer state created
    held = measure_held(trainer)          # model states while gradients accumulate (one step)
    sides = split_by_side(trainer.engine)   # what lives on the accelerator side and on the host side
    comms.start_logging()
    trainer.train(1, progress=False)             # one step's collectives, logged
    logged = comms.stop_logging()
    history = trainer.train(a.steps - 2, progress=False)   # + the measurement step: steps + 1 in all
    world = trainer.engine.world_size
    result = {
        "stage": stage, "world_size": world, "n_params": n_params, "precision": trainer.precision,
        "device": str(trainer.engine.device), "backend": torch.distributed.get_backend(),
        "zero_config": trainer.config["zero_optimization"],
        "held_bytes": held, "zero2_overhang_bytes": zero2_overhang_bytes(trainer.engine), **sides,
        # A GPU reports each stage's own peak; a CPU process's peak RSS spans every stage run before.
        "peak_memory_mib": peak_memory("cuda") / 2**20 if trainer.runtime.is_gpu else None,
        "step_s": [m["step_s"] for m in history], "losses": [m["loss"] for m in trainer.history],
        "comm_logged": logged, "comm_sent_bytes": comms.sent_bytes(logged, world)}
    trainer.engine.destroy()   # release hooks and buffers before the next stage's engine
    return result


def setup(a):
    """(data, n_params) for a run of --steps (>= 3: a warm-up, a logged and a timed step)."""
    if a.steps < 3:
        raise SystemExit(f"--steps={a.steps}: need at least 3 (a warm-up, a logged and a timed step)")
    data = SyntheticTextDataset("markov", n_samples=1024, seq_len=a.seq_len, seed=a.seed)
    n_layer, n_embd, _ = MODEL_SIZES[a.model_size]
    return data, gpt2_param_count(data.vocab_size, a.seq_len, n_layer, n_embd)


def main(argv=None):
    a = parse(argv)
    data, n_params = setup(a)
    write_result(a.out, {"stages": [run_stage(a, s, data, n_params) for s in a.stages]})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
