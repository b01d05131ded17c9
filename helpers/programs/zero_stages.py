"""The ZeRO comparison (notebook 04): train the same model on the same data at each ZeRO stage in turn
and record what this rank holds, how long steps take, the losses, and what it sent.

    torchrun --nproc_per_node 2 -m helpers.programs.zero_stages --out runs/zero --stages 0 1 2 3

One launch runs every stage (starting N processes costs more than a stage's training). Every rank
builds the identical model (same seed) and reads its own shard of the same data order; the only
thing that changes between stages is the config's zero_optimization block (`zero_block` below), which
each result records as DeepSpeed ran it. Notebook 05 runs its offload and 16-bit comparisons through
the same `run_stage`, in its own kernel (`run_here`), with the zero_optimization blocks it writes out.
"""
import argparse
import time

import deepspeed
from deepspeed.comm import comms_logger
import torch
from transformers import set_seed

from helpers import comms
from helpers.batches import ResumableBatches
from helpers.config import build_config, validate
from helpers.data import SyntheticTextDataset
from helpers.errors import integer, number
from helpers.launch import flags, save_config, write_result
from helpers.memory.measured import (allocated_peak, held_while_accumulating, measurement_zero_extra, peak_memory,
                                     split_by_side, zero2_overhang_bytes)
from helpers.model import MODEL_SIZES, build_model
from helpers.precision import PRECISIONS
from helpers.runtime import detect, init_single_process, keep_freed_memory, process_rank, quiet_deepspeed, world_size
from helpers.trainer import undo_optimizer_init_step


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--stages", type=int, nargs="+", required=True, choices=(0, 1, 2, 3), help="run one after another")
    p.add_argument("--steps", type=integer(3, "a warm-up, a logged and a timed step"), default=20)
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES))
    p.add_argument("--seq-len", type=integer(2), default=64)
    p.add_argument("--micro-batch", type=integer(1), default=4)
    p.add_argument("--grad-accum", type=integer(2, "see helpers.memory.measured.held_while_accumulating"), default=2)
    p.add_argument("--lr", type=number(), default=3e-3)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--precision", choices=list(PRECISIONS), help="default: the one this machine's rule picks")
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


def zero_block(a, block: dict, n_params: int) -> dict:
    """The zero_optimization block of one run: buckets small enough that ZeRO really partitions this tiny
    model (measurement_zero_extra), the paper's algorithm if asked, offload if asked; the entries of
    `block` (at least the stage) win."""
    stage = block["stage"]
    out = {"stage": stage, **measurement_zero_extra(n_params), **(PAPER_COMM.get(stage, {}) if a.paper_comm else {})}
    if a.offload_optimizer:
        out["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return out | block


def train_step(engine, batches, grad_accum: int) -> float:
    """One optimizer step: grad_accum micro-batches through forward, backward and engine.step()."""
    losses = []
    for _ in range(grad_accum):
        ids = batches.next().to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()   # DeepSpeed updates the weights only at the last micro-batch of the step
        losses.append(loss.detach())
    return torch.stack(losses).float().mean().item()


def run_stage(a, block: dict, data, rt) -> dict:
    """Train with one zero_optimization `block` ({"stage": 2}, or a whole block); return what this rank held,
    sent, and how its steps went."""
    set_seed(a.seed)
    with allocated_peak("cpu") as loaded:   # every process first builds the whole model in fp32 on the host
        model = build_model(data.vocab_size, a.seq_len, a.model_size, data.tokenizer.pad_token_id, a.seed)
    n_params = sum(p.numel() for p in model.parameters())
    zero, precision = zero_block(a, block, n_params), a.precision or rt.precision
    config = build_config(zero_stage=zero["stage"], micro_batch=a.micro_batch, grad_accum=a.grad_accum, lr=a.lr,
                          warmup_steps=2, total_steps=a.steps + 1, precision=precision, device=rt.device,
                          world_size=world_size(), offload_optimizer="offload_optimizer" in zero,   # DeepSpeedCPUAdam
                          extra={"zero_optimization": zero, "comms_logger": comms.LOGGER_BLOCK})
    validate(config, device=rt.device, world_size=world_size(), capability=rt.capability)
    save_config(a.out, f"stage{zero['stage']}", config)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    undo_optimizer_init_step(engine)   # stage 0 in 16 bits: see notebook 04, section 2
    batches = ResumableBatches(data, a.micro_batch, a.seed, process_rank(), world_size())
    if rt.is_gpu:
        torch.cuda.reset_peak_memory_stats()

    losses = [train_step(engine, batches, a.grad_accum)]   # warm-up: buffers allocated, Adam state created
    held = held_while_accumulating(engine, batches, a.grad_accum)   # one step, model states read mid-accumulation
    sides = split_by_side(engine)                           # what lives on the accelerator side and on the host
    comms_logger.reset_data()                               # the config's comms_logger block records from here
    written = comms.written_bytes()                         # and the kernel counts what this process writes
    losses.append(train_step(engine, batches, a.grad_accum))   # one step's collectives, logged
    logged, written = comms.logged(), comms.written_bytes() - written if written is not None else None
    step_s = []
    for _ in range(a.steps - 2):                            # timed steps: --steps + 1 in all, with the measured one
        start = time.perf_counter()
        losses.append(train_step(engine, batches, a.grad_accum))
        step_s.append(time.perf_counter() - start)

    world, inner = engine.world_size, getattr(engine.optimizer, "optimizer", engine.optimizer)
    result = {
        "stage": zero["stage"], "world_size": world, "n_params": n_params, "precision": precision,
        "device": str(engine.device), "backend": torch.distributed.get_backend(),
        "zero_config": config["zero_optimization"], "optimizer": type(inner).__name__,
        "load_host_bytes": loaded["end"], "held_bytes": held, "zero2_overhang_bytes": zero2_overhang_bytes(engine), **sides,
        # A GPU reports each stage's own peak; a CPU process's peak RSS spans every stage run before.
        "peak_memory_mib": peak_memory("cuda") / 2**20 if rt.is_gpu else None,
        "step_s": step_s, "losses": losses, "comm_logged": logged, "comm_sent_bytes": comms.sent_bytes(logged, world),
        # gloo's sends are writev calls: the kernel's count of this process's writes during the logged step
        "comm_written_bytes": written if torch.distributed.get_backend() == "gloo" else None}
    engine.destroy()   # release hooks and buffers before the next stage's engine
    return result


def set_up_process(rt) -> None:
    quiet_deepspeed()
    init_single_process()   # a no-op under torchrun; one rank's environment when run with plain python
    if not rt.is_gpu:   # every step's activations reuse the last step's pages (no page faults)
        keep_freed_memory()


def run_here(block: dict, data, out, **options) -> dict:
    """`run_stage` in this process (a notebook's kernel, a test) on `data`, with the program's defaults and
    `options` as its flags (micro_batch=8 -> --micro-batch=8)."""
    a = parse(["--out", str(out), "--stages", str(block["stage"]), f"--seq-len={data.seq_len}", *flags(options)])
    rt = detect()
    set_up_process(rt)
    return run_stage(a, block, data, rt)


def main(argv=None):
    a = parse(argv)
    rt = detect()
    set_up_process(rt)
    data = SyntheticTextDataset("markov", n_samples=1024, seq_len=a.seq_len, seed=a.seed)
    write_result(a.out, {"stages": [run_stage(a, {"stage": s}, data, rt) for s in a.stages]})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()   # gloo's threads end before exit can abort them (SIGABRT)


if __name__ == "__main__":
    main()
