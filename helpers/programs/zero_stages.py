"""The ZeRO comparison (notebook 04): the same model, data and seed trained at each ZeRO stage in turn.

    torchrun --nproc_per_node 2 -m helpers.programs.zero_stages --out runs/04_zero_stages/default --stages 0 1 2 3

What one rank runs is `train`: a DeepSpeed config, `deepspeed.initialize`, the loop. The only thing that
changes between stages is the config's zero_optimization block (`zero_block`). Measurement (bytes held,
collectives logged, step times) is attached from outside through `Measure`, which `train` calls at three
points of the loop. One launch runs every stage (starting N processes costs more than a stage's training).
Notebook 05 runs its offload and 16-bit comparisons through the same `run_stage`, in its own kernel
(`run_here`), with the zero_optimization blocks it writes out.
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
from helpers.memory.measured import (allocated_peak, held_bytes, measurement_zero_extra, peak_memory, split_by_side,
                                     zero2_overhang_bytes)
from helpers.model import MODEL_SIZES, build_model
from helpers.precision import add_precision_flag, eps
from helpers.runtime import (detect, init_single_process, keep_freed_memory, process_rank, quiet_deepspeed,
                             rank_process, resolve_precision, world_size)
from helpers.trainer import undo_optimizer_init_step


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--stages", type=int, nargs="+", required=True, choices=(0, 1, 2, 3), help="run one after another")
    p.add_argument("--steps", type=integer(3, "a warm-up, a logged and a timed step"), default=20)
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES))
    p.add_argument("--seq-len", type=integer(2), default=64)
    p.add_argument("--micro-batch", type=integer(1), default=4)
    p.add_argument("--grad-accum", type=integer(2, "ZeRO-1 holds full gradients only while accumulating: see Measure"), default=2)
    p.add_argument("--lr", type=number(), default=3e-3)
    p.add_argument("--seed", type=integer(0), default=0)
    add_precision_flag(p, help="auto (the default): the one this machine's rule picks")
    p.add_argument("--paper-comm", action="store_true",
                   help="configure ZeRO-2/3 communication as the paper describes it (see notebook 04)")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="ZeRO-Offload: optimizer state and its step on the host (stages 1-3; notebook 05)")
    a = p.parse_args(argv)
    # resolved here, not in run_stage, whose source notebooks 04 and 05 print (and nbval compares)
    a.precision = resolve_precision(a.precision)
    return a


def main(argv=None):
    """What each of the N processes runs. torchrun starts them with RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT set; rank_process joins them into one process group (plain `python -m`: a 1-rank job)."""
    a = parse(argv)
    rt = detect()            # the device (a CPU here, gloo) and the precision this machine trains in
    with rank_process():     # quiet logs, the launcher's group; at the end a barrier and the group's end
        reuse_pages(rt)
        data = SyntheticTextDataset("markov", n_samples=1024, seq_len=a.seq_len, seed=a.seed)   # the same on every rank
        write_result(a.out, {"stages": [run_stage(a, {"stage": s}, data, rt) for s in a.stages]})


# DeepSpeed's defaults differ from the paper's algorithm in two places (measured in notebook 04):
# ZeRO-1/2 average gradients with all-reduce buckets (use_multi_rank_bucket_allreduce) instead of
# reducing each partition to its owner, and ZeRO-3 keeps a gathered parameter alive from forward to
# backward when its reuse lies within stage3_max_reuse_distance (1e9 elements: every parameter of a small
# model; PartitionedParameterCoordinator.__params_to_release) instead of gathering it again. These switch
# to the paper's way.
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


def stage_config(a, block: dict, n_params: int, precision: str, device: str, world: int) -> dict:
    """The whole DeepSpeed config of one run (the trainer's, helpers.config.build_config), with this run's
    zero_optimization block and DeepSpeed's comms logger on."""
    zero = zero_block(a, block, n_params)
    return build_config(zero_stage=zero["stage"], micro_batch=a.micro_batch, grad_accum=a.grad_accum, lr=a.lr,
                        warmup_steps=2, total_steps=a.steps + 1, precision=precision, device=device, world_size=world,
                        offload_optimizer="offload_optimizer" in zero,   # DeepSpeedCPUAdam
                        extra={"zero_optimization": zero, "comms_logger": comms.LOGGER_BLOCK})


class NoMeasure:
    """The hooks `train` calls; this one measures nothing."""
    def step_begins(self, step, engine): pass
    def backward_done(self, step, micro, engine): pass
    def step_done(self, step, engine): pass


def train(config: dict, model, batches, steps: int, measure=NoMeasure()) -> list[float]:
    """What one rank runs: config -> deepspeed.initialize -> the loop. Returns the loss of each step."""
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    undo_optimizer_init_step(engine)   # a DeepSpeed 0.19 quirk at ZeRO 0 in bf16/fp16: see "DeepSpeed 0.19 pitfalls"
    losses = []
    for step in range(steps):
        measure.step_begins(step, engine)
        micro_losses = []
        for micro in range(config["gradient_accumulation_steps"]):
            ids = batches.next().to(engine.device)        # this rank's shard of the data
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)                         # ZeRO 2/3 reduce gradient shards here
            measure.backward_done(step, micro, engine)
            engine.step()                                 # weights change only at the last micro-batch
            micro_losses.append(loss.detach())
        losses.append(torch.stack(micro_losses).float().mean().item())
        measure.step_done(step, engine)
    engine.destroy()   # release hooks and buffers before the next stage's engine
    return losses


class Measure(NoMeasure):
    """What the comparison records around `train`'s loop (steps counted from 0 here; notebook 04 counts from 1):
    step 0 warms up (buffers, Adam state); step 1 reads the bytes held after its first backward
    (mid-accumulation, the moment the paper's formulas describe: ZeRO-1 keeps the full gradient while
    accumulating, and at the end of the window keeps only its partition, so --grad-accum must be >= 2);
    step 2's collectives are logged (DeepSpeed's
    comms logger) and its writes counted by the kernel; later steps are timed."""
    HELD, LOGGED = 1, 2

    def __init__(self, is_gpu: bool):
        self.is_gpu, self.result, self.step_s = is_gpu, {}, []

    def step_begins(self, step, engine):
        if step == 0:
            inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
            self.result.update(world_size=engine.world_size, device=str(engine.device), optimizer=type(inner).__name__,
                               backend=torch.distributed.get_backend(), zero2_overhang_bytes=zero2_overhang_bytes(engine))
            if self.is_gpu:
                torch.cuda.reset_peak_memory_stats()
        if step == self.LOGGED:
            comms_logger.reset_data()                        # the config's comms_logger block records from here
            self.written = comms.written_bytes()             # and the kernel counts what this process writes
        self.start = time.perf_counter()

    def backward_done(self, step, micro, engine):
        if step == self.HELD and micro == 0:   # ZeRO-1 still holds full gradients here (needs grad_accum >= 2)
            self.result["held_bytes"] = held_bytes(engine)

    def step_done(self, step, engine):
        if step == self.HELD:
            self.result.update(split_by_side(engine))        # what lives on the accelerator side and on the host
        elif step == self.LOGGED:
            logged, world = comms.logged(), engine.world_size
            written = comms.written_bytes() - self.written if self.written is not None else None
            # gloo's sends are writev calls: the kernel's count of this process's writes during the logged step
            self.result.update(comm_logged=logged, comm_sent_bytes=comms.sent_bytes(logged, world),
                               comm_written_bytes=written if torch.distributed.get_backend() == "gloo" else None)
        elif step > self.LOGGED:
            self.step_s.append(time.perf_counter() - self.start)
        # A GPU reports each stage's own peak; a CPU process's peak RSS spans every stage run before.
        self.result["peak_memory_mb"] = peak_memory("cuda") / 1e6 if self.is_gpu else None


def tolerance_per_step(curve: list[float], precision: str) -> list[float]:
    """How far a loss curve may move, at each step, from rounding alone (notebook 04's appendix derives it): the
    training dtype's machine epsilon times the distance the loss has travelled so far, at least 8 fp32
    spacings of the loss itself (the loss is computed in fp32)."""
    travelled = [sum(abs(b - a) for a, b in zip(curve[:t], curve[1:t + 1])) for t in range(len(curve))]
    return [max(eps(precision) * d, 8 * torch.finfo(torch.float32).eps * loss) for d, loss in zip(travelled, curve)]


def gap_over_tolerance(ranks: list[dict], reference: list[dict]) -> float:
    """The largest difference, over ranks and steps, between a run's losses and a reference run's (each
    {stage: [rank results]}-style list), as a fraction of the reference's `tolerance_per_step`: <= 1 passes."""
    return max(abs(a - b) / tol for r, r0 in zip(ranks, reference)
               for a, b, tol in zip(r["losses"], r0["losses"], tolerance_per_step(r0["losses"], r0["precision"])))


def run_stage(a, block: dict, data, rt) -> dict:
    """Train with one zero_optimization `block` ({"stage": 2}, or a whole block), measured; return what this
    rank held, sent, and how its steps went."""
    set_seed(a.seed)   # the same seed on every rank: every rank starts from the same weights
    with allocated_peak("cpu") as loaded:   # every process first builds the whole model in fp32 on the host
        model = build_model(data.vocab_size, n_positions=a.seq_len, size=a.model_size,
                            pad_token_id=data.tokenizer.pad_token_id, seed=a.seed)
    n_params = sum(p.numel() for p in model.parameters())
    precision = a.precision or rt.precision
    config = stage_config(a, block, n_params, precision, rt.device, world_size())
    validate(config, device=rt.device, world_size=world_size(), capability=rt.capability)
    save_config(a.out, f"stage{config['zero_optimization']['stage']}", config)
    # this rank's shard of every global batch: rank r of N reads micro-batches r, r + N, r + 2N, ...
    batches = ResumableBatches(data, micro_batch=a.micro_batch, seed=a.seed, rank=process_rank(),
                               world_size=world_size())
    measure = Measure(rt.is_gpu)
    losses = train(config, model, batches, a.steps + 1, measure)   # warm-up, held, logged, then timed steps
    return {"stage": config["zero_optimization"]["stage"], "n_params": n_params, "precision": precision,
            "zero_config": config["zero_optimization"], "load_host_bytes": loaded["end"], **measure.result,
            "step_s": measure.step_s, "losses": losses}


def reuse_pages(rt) -> None:
    if not rt.is_gpu:   # every step's activations reuse the last step's pages (no page faults)
        keep_freed_memory()


def run_here(block: dict, data, out, **options) -> dict:
    """`run_stage` in this process (a notebook's kernel, a test) on `data`, with the program's defaults and
    `options` as its flags (micro_batch=8 -> --micro-batch=8)."""
    a = parse(["--out", str(out), "--stages", str(block["stage"]), f"--seq-len={data.seq_len}", *flags(options)])
    rt = detect()
    quiet_deepspeed()
    init_single_process()   # the kernel's process group of one, kept for its next run
    reuse_pages(rt)
    return run_stage(a, block, data, rt)


if __name__ == "__main__":
    main()
