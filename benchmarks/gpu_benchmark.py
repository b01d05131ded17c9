"""The trainer vs the plain loop on one GPU, in one process and one command, under a hard deadline.

    python -m benchmarks.gpu_benchmark --dry-run --gpu H100   # the plan and its time estimate (no GPU needed)
    python -m benchmarks.gpu_benchmark --out $OUT/gpu_benchmark.json   # on a CUDA GPU: GPT-2 124M, bf16, seq 1024
    python -m benchmarks.gpu_benchmark --smoke                # the same code path at toy sizes on a CPU (CI)
    python -m benchmarks.gpu_benchmark --smoke --device cuda  # toy sizes on the GPU (sync counting included): seconds
    python -m benchmarks.gpu_benchmark --deadline-s 230 --rounds 5 --steps 10   # the defaults; --micro-batch N
                                                              # overrides the planner's; --no-compiled, --no-hf

Writes --out (default runs/benchmarks/gpu_benchmark.json) and the table beside it (.md); the contenders' own
printing goes to --work-dir/contenders.log, progress lines to stderr, the table to stdout at the end.

Unlike benchmarks.trainer_vs_plain (a process per contender, its table written only at the end), every
contender lives in this one process, as in benchmarks.step_phases, and all stay alive so they can take
turns: plain (the hand-written loop of benchmarks.contenders), plain-compiled, ds0 / ds2 (the tutorial's
AdvancedDeepSpeedTrainer at ZeRO 0 / 2) and their compiled twins, hf0 (HF Trainer(deepspeed= the same
config) at ZeRO 0, driven block by block in a thread: benchmarks.contenders.HFTrainer), and plain2, a second
copy of the plain loop whose ratio to plain is the noise floor. Same model init, batches, precision and AdamW
math for all (benchmarks.contenders).

Order of work: build every contender; one warm-up block each (allocator, kernels, optimizer state, and a
compiled contender's torch.compile: its compile seconds are reported apart; dynamo's and inductor's caches
are the process's, so a compiled contender whose graph an earlier one compiled compiles in less); one extra
step each under torch.cuda.set_sync_debug_mode("warn") that counts the host syncs per step (the same step
for every contender, so their losses stay aligned step for step; outside every timed block); then rounds of
one --steps block each, the order reversed every other round. A block's clock covers all a contender does per
step and ends with torch.cuda.synchronize(). The result JSON and its markdown table are rewritten after every
phase (each warm-up block, each round), so a kill loses at most the phase it struck; --deadline-s (SIGALRM)
stops the run in whatever phase it is in, and no round starts that would not end before the deadline.

Micro-batch: the largest of MICRO_BATCHES (16 at most) at which all contenders' model states, one step's
activations (one contender computes at a time; the caching allocator reuses the blocks) and the planner's
fixed overhead fit in 0.9 of the GPU's memory by notebook 05's planner (helpers.memory.planner); an
out-of-memory error while building or warming up one contender frees that contender alone and builds it again
at half its micro-batch (the others, their compiled graphs included, stay), and the notes say so. Speeds are
compared per token, so such a contender still has its ratios; its first losses (other batches) are not compared.

Reported per contender: tokens/s (median over rounds); the median (min-max) of the per-round ratios to plain
(> 1: faster); MFU against the matmul peak measured here (an 8192^3 product in the run's precision, best of
several, at the start and after every round) and against the data sheet's dense 16-bit peak
(DATASHEET_TFLOPS); host syncs per step (what torch's sync debug mode catches: .item(), blocking copies,
nonzero, stream syncs; not torch.cuda.synchronize(), event waits or torch.distributed); the CUDA allocator's
peak in its blocks and that peak above the bytes held when its block began (its own working memory).
FLOPs per token as in benchmarks.trainer_vs_plain: 6 N + 12 n_layer d_model seq_len. The targets (trainer at
ZeRO 0 >= 0.95x the plain loop, eager and compiled; compiled MFU >= 35% of the measured peak) are printed
beside the table, never asserted.
"""
from __future__ import annotations

import time

_STARTED = time.monotonic()   # run as a command, the deadline counts from here: imports are part of its time

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import statistics
import sys
import threading
import warnings
from pathlib import Path

import torch

from helpers.model import MODEL_SIZES

from .contenders import AUTOCAST, COMPILED, Setup, TokenData, make_contender
from .tables import ratio_text
from .trainer_vs_plain import flops_per_token, matmul_flops, ratio_stats, versions

# 32 fits an H100 by the planner (52.6 of 72 GB), too close for what the planner does not count (inductor's
# autotuning and cuBLAS workspaces, nine contenders' fragments); 16 needs about half, and the H100 and the H200
# then run the same micro-batch.
MICRO_BATCHES = (16, 8, 4, 2, 1)
MEMORY_SHARE = 0.9
PLANNER_MODEL = {"gpt2": "GPT-2 124M"}   # MODEL_SIZES name -> helpers.memory.formulas.models() name
# Dense 16-bit tensor-core peaks from NVIDIA's data sheets (bf16; fp16 on the T4), matched in this order
# against torch.cuda.get_device_name() (helpers.hardware.GPUS holds the same figures).
DATASHEET_TFLOPS = (("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989), ("H200", 989), ("A100", 312), ("T4", 65))
SYNC_TEXT = "synchronizing CUDA operation"   # torch's warning: "called a synchronizing CUDA operation"
TARGET_RATIO, TARGET_MFU = 0.95, 0.35
LOSS_STEPS = 5   # the loss agreement column compares this many first steps

# The time estimate of --dry-run (seconds on an H100; see estimate()). Per-step: FLOPs / ACHIEVED_TFLOPS
# compiled; eager at EAGER_SLOWDOWN times that (the H200 run of 2026-12-04: plain 0.6 s, plain-compiled 0.3 s
# per 10-step block at micro-batch 8); the trainer and HF Trainer HOST_OVERHEAD_S more per step (that run's
# near-constant 20-25 ms gap to the plain loop).
ACHIEVED_TFLOPS = 400
MEASURED_TFLOPS = 233    # what that H200 run's plain-compiled achieved (8192 tokens x 855 MFLOP in 30 ms): the
                         # cautious estimate (eager: 117, its plain loop's 60 ms per step)
EAGER_SLOWDOWN = 2.0
HOST_OVERHEAD_S = 0.025
IMPORT_S = 20            # torch, DeepSpeed, transformers; the CUDA context
BUILD_S = 3              # per contender: model, deepspeed.initialize, fused AdamW
COLD_COMPILE_S = 45      # inductor, empty cache, GPT-2 124M forward + backward (the CPU's small one: 25-45 s)
WARM_COMPILE_S = 10      # a graph this process already compiled (ds2-compiled after ds0-compiled)

DEFAULTS = {
    "cuda": dict(model_size="gpt2", n_words=4096, vocab_size=50257, seq_len=1024, precision="bf16", steps=10,
                 rounds=5, matmul_size=8192, micro_batch=None, compiled=True, hf=True),
    "smoke": dict(model_size="tiny", n_words=128, vocab_size=None, seq_len=32, precision="fp32", steps=2,
                  rounds=2, matmul_size=256, micro_batch=4, compiled=False, hf=True),
}


class DeadlineReached(BaseException):
    """Raised in the main thread at --deadline-s (SIGALRM), or by a test's hook: the run stops where it is."""


def contender_names(compiled: bool, hf: bool) -> list[str]:
    """plain first (the reference), each trainer beside its compiled twin, plain2 last: as far from plain as
    the order allows (the order flips every other round)."""
    c = [f"plain{COMPILED}"] if compiled else []
    # ds0-autocast: bf16 through DeepSpeed's torch_autocast block, beside ds0's bf16 block (which wraps the optimizer
    # in FP16_UnfusedOptimizer, one host read per parameter a step): the measurement the choice of mode waits for
    names = ["plain", *c, "ds0", f"ds0{AUTOCAST}", *(["hf0"] if hf else []), *([f"ds0{COMPILED}"] if compiled else []),
             "ds2", *([f"ds2{COMPILED}"] if compiled else []), "plain2"]
    return names


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan and its time estimate; run nothing")
    p.add_argument("--gpu", default="H100", help="with --dry-run: the GPU to plan for (a helpers.hardware.GPUS "
                                                 "name or its start: H100, H200, A100, T4)")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks the code path, times nothing")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--deadline-s", type=float, default=230.0,
                   help="stop here, results written, counting from the command's start (default 230)")
    for flag in ("--steps", "--rounds", "--micro-batch", "--seq-len", "--n-words", "--vocab-size", "--matmul-size"):
        p.add_argument(flag, type=int)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES))
    p.add_argument("--precision", choices=["fp32", "bf16"])
    p.add_argument("--no-compiled", dest="compiled", action="store_false", default=None,
                   help="leave out plain-compiled, ds0-compiled, ds2-compiled")
    p.add_argument("--compiled", dest="compiled", action="store_true", help="with --smoke: run them too")
    p.add_argument("--no-hf", dest="hf", action="store_false", default=None, help="leave out hf0")
    p.add_argument("--keep-inductor-cache", action="store_true",
                   help="reuse --work-dir's inductor cache (default: emptied, so compile seconds are a first run's)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/benchmarks/gpu_benchmark.json", help="the JSON; the table beside it (.md)")
    p.add_argument("--work-dir", default="runs/benchmarks/gpu_benchmark",
                   help="scratch: the contenders' output (their log: contenders.log), the inductor cache")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() and not a.smoke and not a.dry_run else "cpu"
    for key, value in DEFAULTS["smoke" if a.smoke else "cuda"].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.device == "cuda" and a.precision == "bf16" and torch.cuda.is_available() \
            and not torch.cuda.is_bf16_supported(including_emulation=False):
        a.precision = "fp32"   # a T4: no bf16 tensor cores (the plain loop has no loss scaler for fp16)
    a.total = a.steps * (a.rounds + 1) + 1   # the LR schedule spans warm-up, the counted step and every round
    a.warmup = max(1, a.total // 10)
    return a


# ---------------------------------------------------------------------------------------------- planning

def plan_micro_batch(memory_gb: float, n_models: int, precision: str, seq_len: int = 1024,
                     model: str = "GPT-2 124M", share: float = MEMORY_SHARE) -> tuple[int | None, list[dict]]:
    """The largest micro-batch of MICRO_BATCHES at which n_models models' states at ZeRO 0 (each contender
    keeps its own), one step's activations and the planner's fixed overhead fit in share x memory_gb (GB,
    10^9 bytes); with every candidate's figures."""
    from helpers.memory import planner
    rows = planner.plan(model, share * memory_gb, seq_len=seq_len, precision=precision, micro_batches=MICRO_BATCHES)
    tried = []
    for mb in MICRO_BATCHES:
        r = planner.row_for(rows, 0, micro_batch=mb)
        need = n_models * r["model_states_gb"] + r["activations_gb"] + r["overhead_gb"]
        tried.append({"micro_batch": mb, "states_gb": r["model_states_gb"], "activations_gb": r["activations_gb"],
                      "overhead_gb": r["overhead_gb"], "need_gb": need, "fits": need <= share * memory_gb})
    return next((t["micro_batch"] for t in tried if t["fits"]), None), tried


def datasheet_peak(device_name: str) -> float | None:
    """FLOP/s of the data sheet's dense 16-bit peak for a torch.cuda.get_device_name(), None if not listed."""
    return next((tflops * 1e12 for key, tflops in DATASHEET_TFLOPS if key in device_name), None)


def block_estimate(name: str, flops_per_step: float, steps: int, tflops: float = ACHIEVED_TFLOPS) -> float:
    """Seconds of one block by the dry-run's model (tflops compiled, EAGER_SLOWDOWN, HOST_OVERHEAD_S)."""
    compiled = name.endswith(COMPILED)
    per_step = flops_per_step / (tflops * 1e12) * (1 if compiled else EAGER_SLOWDOWN)
    if not name.startswith("plain"):
        per_step += HOST_OVERHEAD_S
    return steps * per_step


def estimate(names: list[str], micro_batch: int, seq_len: int, flops_token: float, steps: int, rounds: int,
             tflops: float = ACHIEVED_TFLOPS) -> dict:
    """The run's seconds, part by part, by the constants above."""
    step_flops = flops_token * micro_batch * seq_len
    round_s = sum(block_estimate(n, step_flops, steps, tflops) for n in names)
    compiled = [n for n in names if n.endswith(COMPILED)]
    # plain-compiled (fp32 weights under autocast) and the trainer's (bf16 weights) are two graphs; ds2-compiled
    # runs ds0-compiled's graph again
    compile_s = sum(WARM_COMPILE_S if n.startswith("ds") and f"ds0{COMPILED}" in compiled[:i] else COLD_COMPILE_S
                    for i, n in enumerate(compiled))
    parts = {"imports": IMPORT_S, "builds": BUILD_S * len(names), "warm-up blocks": round_s, "compiles": compile_s,
             "counted sync steps": round_s / steps, f"{rounds} rounds": rounds * round_s}
    return {"step_flops": step_flops, "round_s": round_s, "parts": parts, "total_s": sum(parts.values())}


def dry_run(a) -> dict:
    from helpers.hardware import GPUS, gpu_named
    from helpers.precision import gpu_has_bf16
    gpu = gpu_named(a.gpu)
    spec = GPUS[gpu]
    precision = a.precision if gpu_has_bf16(spec["capability"]) else "fp32"
    names = contender_names(a.compiled, a.hf)
    mb, tried = plan_micro_batch(spec["memory_gb"], len(names), precision, a.seq_len,
                                 PLANNER_MODEL.get(a.model_size, "GPT-2 124M"))
    mb = a.micro_batch or mb
    vocab = a.vocab_size or a.n_words
    fpt, n = flops_per_token(a, vocab)
    lines = [f"gpu_benchmark plan for the {gpu} ({spec['memory_gb']} GB, {precision}): one process, "
             f"{len(names)} contenders alive at once, blocks of {a.steps} steps, 1 warm-up block + 1 counted "
             f"step + up to {a.rounds} rounds each, the order reversed every other round; deadline {a.deadline_s:g} s",
             f"contenders: {', '.join(names)}",
             f"GPT-2 '{a.model_size}', sequence {a.seq_len}, vocabulary {vocab}: N = {n:,} matmul parameters, "
             f"FLOPs/token = 6N + 12 n_layer d seq = {fpt / 1e6:,.1f} M"]
    for t in tried:
        lines.append(f"  micro-batch {t['micro_batch']:>2}: {len(names)} x {t['states_gb']:.2f} GB model states + "
                     f"{t['activations_gb']:.2f} GB activations + {t['overhead_gb']:.1f} GB = {t['need_gb']:.1f} GB "
                     f"{'<=' if t['fits'] else '>'} {MEMORY_SHARE} x {spec['memory_gb']} = "
                     f"{MEMORY_SHARE * spec['memory_gb']:.1f} GB")
    plan = {"gpu": gpu, "precision": precision, "contenders": names, "micro_batch": mb, "tried": tried,
            "deadline_s": a.deadline_s, "steps": a.steps, "rounds": a.rounds, "flops_per_token": fpt}
    if mb is None:
        lines.append(f"micro-batch: none fits; {len(names)} contenders do not fit the {gpu} "
                     "(fewer: --no-compiled, --no-hf)")
        print("\n".join(lines))
        return plan
    est = estimate(names, mb, a.seq_len, fpt, a.steps, a.rounds)
    step_ms = est["step_flops"] / (ACHIEVED_TFLOPS * 1e12) * 1e3
    lines += [f"micro-batch {mb}: {est['step_flops'] / 1e12:.1f} TFLOP per step -> {step_ms:.0f} ms compiled at "
              f"{ACHIEVED_TFLOPS} TFLOP/s achieved, {EAGER_SLOWDOWN:g}x that eager (plain 0.6 s vs plain-compiled "
              f"0.3 s per block on the H200, 2026-12-04), + {HOST_OVERHEAD_S * 1e3:.0f} ms/step for the trainer and "
              f"HF Trainer (that run's gap to the plain loop)",
              "  per block: " + ", ".join(f"{n} {block_estimate(n, est['step_flops'], a.steps):.2f} s" for n in names),
              "estimate: " + " + ".join(f"{k} {v:.0f} s" for k, v in est["parts"].items())
              + f" = {est['total_s']:.0f} s (deadline {a.deadline_s:g} s: rounds that would end past it do not start)"]
    slow = estimate(names, mb, a.seq_len, fpt, a.steps, a.rounds, MEASURED_TFLOPS)
    before_rounds = slow["total_s"] - slow["parts"][f"{a.rounds} rounds"]
    fit = max(0, min(a.rounds, int((a.deadline_s - before_rounds) // slow["round_s"])))
    lines.append(f"cautious: at the H200 run's own speeds ({MEASURED_TFLOPS} TFLOP/s compiled, "
                 f"{MEASURED_TFLOPS / EAGER_SLOWDOWN:.0f} eager) a round takes {slow['round_s']:.0f} s and "
                 f"{fit} of {a.rounds} rounds end before the deadline ({before_rounds:.0f} s before the first)")
    print("\n".join(lines))
    return {**plan, "estimate": est, "cautious": {**slow, "rounds_before_deadline": fit}}


# ------------------------------------------------------------------------------------------------ running

def make_data(a, micro_batch: int) -> TokenData:
    """A few micro-batches' worth of samples (the batches cycle through epochs; speed does not care)."""
    from helpers.data import SyntheticTextDataset
    data = SyntheticTextDataset(n_samples=max(64, 8 * micro_batch), seq_len=a.seq_len, n_words=a.n_words, seed=a.seed)
    return TokenData(torch.stack([data[i]["input_ids"] for i in range(len(data))]), data.tokenizer, a.vocab_size)


def measured_peak(a, dtype: torch.dtype, repeats: int = 3, inner: int = 10) -> float:
    """FLOP/s of an n^3 matmul here, best of `repeats` timings of `inner` back-to-back products (GPU)."""
    if a.device != "cuda":
        return matmul_flops(a.matmul_size, "cpu", dtype)
    n = a.matmul_size
    x, y = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
    x @ y   # cuBLAS picks its kernel
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(inner):
            x @ y
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / inner)
    del x, y
    return 2 * n**3 / best


@contextlib.contextmanager
def into_log(path: Path):
    """The contenders' own printing (DeepSpeed, transformers, inductor) into a log file, at the fd level."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def timed_block(contender, steps: int, device: str) -> dict:
    """One block: wall seconds; on a GPU the allocator's peak in it and the bytes held at its start (host-side
    counters: reading them does not wait for the GPU)."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()   # the previous block's work is done before the clock starts
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    start = time.perf_counter()
    contender.train(steps)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "peak_mb": torch.cuda.max_memory_allocated() / 1e6 if cuda else None,
            "held_mb": held / 1e6 if cuda else None}


def counted_step(contender, device: str) -> int | None:
    """One step under torch's sync debug mode ("warn"): the number of synchronizing CUDA calls it made (the
    warnings are recorded process-wide, so hf0's thread counts too). None on a CPU (the step still runs)."""
    if device != "cuda":
        contender.train(1)
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")   # every occurrence, not once per code location
        torch.cuda.set_sync_debug_mode("warn")
        try:
            contender.train(1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum(SYNC_TEXT in str(w.message) for w in caught)


def is_oom(err: BaseException) -> bool:
    """torch's OutOfMemoryError, or a library's RuntimeError that wraps one in its message."""
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def release(contenders: dict) -> None:
    """Stop hf0's thread (it ends after the step it paused in) and free every contender's memory."""
    for c in contenders.values():
        pause = getattr(c, "pause", None)
        if pause is not None and c.thread.is_alive():
            pause.stop = True
            pause.go.put(-1)
            c.thread.join(timeout=30)
    contenders.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Run:
    """Everything measured so far, and writing it (JSON + markdown) at any moment."""

    def __init__(self, a, names: list[str]):
        self.a, self.names, self.notes = a, names, []
        self.out = Path(a.out)
        self.status, self.phase, self.micro_batch = "running", "start", a.micro_batch
        self.peaks, self.rounds_done, self.last_round_s = [], 0, None
        self.rows, self.micro_batches = {}, {}
        self.machine = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
        self.datasheet = datasheet_peak(self.machine) if a.device == "cuda" else None
        self.vocab_size = None

    def reset_rows(self) -> None:
        self.rows = {n: {"warmup_s": None, "blocks": {}, "syncs_per_step": None, "state_mb": None, "losses": []}
                     for n in self.names}
        self.micro_batches = {}   # a contender's own, where an out-of-memory error halved it

    def micro_batch_of(self, name: str) -> int:
        return self.micro_batches.get(name, self.micro_batch)

    def per_token(self, name: str) -> dict:
        """Its blocks' seconds per token, by round: contenders at different micro-batches compare per token."""
        tokens = self.a.steps * self.micro_batch_of(name) * self.a.seq_len
        return {r: {"wall_s": b["wall_s"] / tokens} for r, b in self.rows[name]["blocks"].items()}

    def summary(self) -> dict:
        a = self.a
        fpt = flops_per_token(a, self.vocab_size)[0] if self.vocab_size else None
        peak = max(self.peaks, default=None)
        plain = self.per_token("plain") if "plain" in self.rows else {}
        out = {}
        for name, row in self.rows.items():
            walls, tokens = row["blocks"], a.steps * self.micro_batch_of(name) * a.seq_len   # per block
            same_batches = self.micro_batch_of(name) == self.micro_batch_of("plain")
            rate = statistics.median(tokens / b["wall_s"] for b in walls.values()) if walls else None
            s = {"tokens_per_s": rate, "rounds": len(walls), "micro_batch": self.micro_batch_of(name),
                 "vs_plain": paired(self.per_token(name), plain), "vs_plain_compiled": None,
                 "mfu_measured": rate * fpt / peak if rate and peak else None,
                 "mfu_datasheet": rate * fpt / self.datasheet if rate and self.datasheet else None,
                 "syncs_per_step": row["syncs_per_step"], "state_mb": row["state_mb"],
                 "peak_mb": max((b["peak_mb"] for b in walls.values() if b["peak_mb"] is not None), default=None),
                 "working_mb": max((b["peak_mb"] - b["held_mb"] for b in walls.values()
                                     if b["peak_mb"] is not None), default=None),
                 "warmup_s": row["warmup_s"],
                 "warmup_extra_s": row["warmup_s"] - statistics.median(b["wall_s"] for b in walls.values())
                 if walls and row["warmup_s"] is not None else None,
                 "max_loss_diff_first_steps": loss_diff(row["losses"], self.rows.get("plain", {}).get("losses", []))
                 if same_batches else None}   # other batches, other losses
            if name.endswith(COMPILED) and f"plain{COMPILED}" in self.rows:
                s["vs_plain_compiled"] = paired(self.per_token(name), self.per_token(f"plain{COMPILED}"))
            out[name] = s
        for name, s in out.items():   # compile: the warm-up's extra seconds beyond the eager twin's
            twin = out.get(name.removesuffix(COMPILED)) if name.endswith(COMPILED) else None
            s["compile_s"] = s["warmup_extra_s"] - twin["warmup_extra_s"] if twin and twin["warmup_extra_s"] is not \
                None and s["warmup_extra_s"] is not None else None
        return out

    def targets(self, summary: dict) -> list[str]:
        lines = []
        for name, ref in (("ds0", "plain"), (f"ds0{COMPILED}", f"plain{COMPILED}")):
            if name in summary:
                key = "vs_plain" if ref == "plain" else "vs_plain_compiled"
                r = summary[name][key]
                lines.append(f"{name} vs {ref}: {ratio_text(r) if r else 'n/a'} (target >= {TARGET_RATIO}: "
                             f"{verdict(r and r['median'] >= TARGET_RATIO, r)})")
        for name, s in summary.items():
            if name.endswith(COMPILED):
                m = s["mfu_measured"]
                lines.append(f"{name} MFU vs the measured peak: {pct(m)} (target >= {TARGET_MFU:.0%}: "
                             f"{verdict(m is not None and m >= TARGET_MFU, m)})")
        if "plain2" in summary and summary["plain2"]["vs_plain"]:
            lines.append(f"noise floor: plain2 vs plain {ratio_text(summary['plain2']['vs_plain'])} "
                         f"(the same loop twice)")
        return lines

    def result(self) -> dict:
        a, summary = self.a, self.summary()
        fpt, n = flops_per_token(a, self.vocab_size) if self.vocab_size else (None, None)
        config = {k: v for k, v in vars(a).items()}
        return {"status": self.status, "phase": self.phase, "notes": self.notes, "machine": self.machine,
                "config": config, "micro_batch": self.micro_batch, "micro_batches_halved": self.micro_batches,
                "contenders_order": self.names,
                "rounds_done": self.rounds_done, "elapsed_s": time.monotonic() - a.started,
                "peak_flops_measured": max(self.peaks, default=None), "peak_flops_datasheet": self.datasheet,
                "flops_per_token": fpt, "n_params_matmul": n, "flops_formula": "6*N + 12*n_layer*d_model*seq_len",
                "versions": versions(), "contenders": summary, "targets": self.targets(summary),
                "raw": self.rows}

    def write(self) -> dict:
        result = self.result()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".json.tmp")   # a kill mid-write leaves the last complete file
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(self.out)
        self.out.with_suffix(".md").write_text(markdown(result) + "\n")
        return result


def paired(mine: dict, theirs: dict) -> dict | None:
    """ratio_stats over the rounds both ran (a deadline can cut a round short)."""
    common = sorted(set(mine) & set(theirs))
    if not common:
        return None
    return ratio_stats([mine[r]["wall_s"] for r in common], [theirs[r]["wall_s"] for r in common])


def loss_diff(mine: list[float], plain: list[float]) -> float | None:
    diffs = [abs(x - y) for x, y in list(zip(mine, plain))[:LOSS_STEPS]]
    return max(diffs) if diffs else None


def verdict(ok, value) -> str:
    return "n/a" if value is None else ("met" if ok else "MISSED")


def pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def num(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def markdown(r: dict) -> str:
    c, v = r["config"], r["versions"]
    peak = r["peak_flops_measured"]
    sheet = r["peak_flops_datasheet"]
    lines = [f"{r['machine']}; torch {v['torch']}, DeepSpeed {v['deepspeed']}, transformers {v['transformers']}. "
             f"Status: {r['status']} (phase: {r['phase']}), {r['rounds_done']} of {c['rounds']} rounds, "
             f"{r['elapsed_s']:.0f} s.",
             f"GPT-2 '{c['model_size']}', sequence {c['seq_len']}, micro-batch {r['micro_batch']}, {c['precision']}, "
             f"blocks of {c['steps']} steps in one process, the order reversed every other round. Measured "
             f"{c['precision']} matmul peak {num(peak and peak / 1e12, ',.1f')} TFLOP/s, data sheet "
             f"{num(sheet and sheet / 1e12, ',.0f')} TFLOP/s; FLOPs/token = {r['flops_formula']} = "
             f"{num(r['flops_per_token'] and r['flops_per_token'] / 1e6, ',.2f')} M.", "",
             "| contender | tokens/s | vs plain, median (min-max) | vs plain-compiled | MFU (measured peak) | "
             "MFU (data sheet) | host syncs / step | peak MB (working) | warm-up s (compile s) | "
             f"max abs Δloss vs plain, first {LOSS_STEPS} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in r["contenders"].items():
        mem = "n/a" if s["peak_mb"] is None else f"{s['peak_mb']:,.0f} ({s['working_mb']:,.0f})"
        warm = num(s["warmup_s"], ".1f") + (f" ({s['compile_s']:.1f})" if s["compile_s"] is not None else "")
        lines.append(f"| {name} | {num(s['tokens_per_s'], ',.0f')} | {ratio_text(s['vs_plain']) or 'n/a'} | "
                     f"{ratio_text(s['vs_plain_compiled'])} | {pct(s['mfu_measured'])} | {pct(s['mfu_datasheet'])} | "
                     f"{num(s['syncs_per_step'], 'd')} | {mem} | {warm} | "
                     f"{num(s['max_loss_diff_first_steps'], '.1e')} |")
    lines += ["", "plain: the hand-written loop; dsN: AdvancedDeepSpeedTrainer at ZeRO N; hf0: HF Trainer(deepspeed= "
              "the same config); -compiled: torch.compile'd; plain2: the plain loop again (its ratio is the noise "
              "floor). Ratios > 1: faster; median of per-round ratios. Host syncs: one step under torch's sync debug "
              "mode. Peak: the CUDA allocator's peak in the contender's blocks, all contenders' states included; "
              "working: above what was held when its block began. Compile s: the warm-up's extra seconds beyond "
              "a steady block, less the eager twin's.", "", "Targets (a benchmark, never asserted):"]
    lines += [f"- {t}" for t in r["targets"]] + [f"- note: {n}" for n in r["notes"]]
    return "\n".join(lines)


REPEAT_S = 0.05   # the deadline's alarm, again until it stops the run


@contextlib.contextmanager
def deadline(seconds: float, started: float):
    """SIGALRM `seconds` after `started` (time.monotonic()) raises DeadlineReached in the main thread (only there can a
    signal be handled; elsewhere only the rounds' own check before each round holds the deadline). The alarm
    repeats every REPEAT_S until the block is left: a raise that lands in a finalizer (a `__del__` that garbage
    collection runs) is printed as "Exception ignored" and lost, and the run would go on past its deadline."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.setitimer(signal.ITIMER_REAL, REPEAT_S)   # again, unless this raise leaves the block
        raise DeadlineReached(f"the {seconds:g} s deadline")
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, max(seconds - (time.monotonic() - started), 0.001))
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def setup_for(run: Run, name: str) -> Setup:
    a = run.a
    return Setup(device=a.device, precision=a.precision, model_size=a.model_size, micro_batch=run.micro_batch_of(name),
                 lr=a.lr, warmup=a.warmup, total=a.total, grad_clip=a.grad_clip, seed=a.seed,
                 threads=torch.get_num_threads(), out_dir=a.work_dir)


def build(run: Run, data: TokenData, log: Path, contenders: dict) -> None:
    """Every contender, into `contenders`; one that runs out of memory is built again at half its micro-batch."""
    for name in run.names:
        build_one(run, name, data, log, contenders)


def build_one(run: Run, name: str, data: TokenData, log: Path, contenders: dict) -> None:
    while True:
        run.phase = f"build {name}"
        start = time.perf_counter()
        try:
            with into_log(log):
                contenders[name] = make_contender(name, data, setup_for(run, name))
            break
        except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
            if run.micro_batch_of(name) == 1 or not is_oom(err):
                raise
        halve(run, name, contenders)   # out of the except block: its traceback no longer holds the tensors
    say(f"built {name} in {time.perf_counter() - start:.1f} s")


def halve(run: Run, name: str, contenders: dict) -> None:
    """Free one contender that ran out of memory and halve its micro-batch; the others stay as they are."""
    release({name: contenders.pop(name)} if name in contenders else {})
    run.micro_batches[name] = run.micro_batch_of(name) // 2
    run.rows[name] |= {"warmup_s": None, "losses": []}
    run.notes.append(f"out of memory in {run.phase}: {name} alone rebuilt at micro-batch {run.micro_batches[name]}"
                     + (" (its graph compiled again, maybe with dynamic shapes)" if name.endswith(COMPILED) else ""))
    say(run.notes[-1])
    run.write()


def warm_up(run: Run, contenders: dict, data: TokenData, log: Path, hook) -> None:
    """One block each (compiles happen here), the results written after each; a contender that runs out of memory
    is rebuilt alone at half its micro-batch and warmed up again."""
    for name in list(contenders):
        while True:
            run.phase = f"warm-up {name}"
            try:
                with into_log(log):
                    block = timed_block(contenders[name], run.a.steps, run.a.device)
                break
            except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
                if run.micro_batch_of(name) == 1 or not is_oom(err):
                    raise
            halve(run, name, contenders)
            build_one(run, name, data, log, contenders)
        run.rows[name]["warmup_s"] = block["wall_s"]
        run.rows[name]["losses"] = list(contenders[name].losses)
        say(f"warm-up {name}: {block['wall_s']:.1f} s")
        run.write()
        hook(run.phase, run)
    order = {name: contenders.pop(name) for name in run.names}   # rebuilt ones back in their place in the order
    contenders.update(order)


def execute(a, hook=lambda phase, run: None) -> dict:
    names = contender_names(a.compiled, a.hf)
    run = Run(a, names)
    run.reset_rows()
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "contenders.log"
    log.write_text("")
    cache = work / "inductor_cache"
    if not a.keep_inductor_cache:
        shutil.rmtree(cache, ignore_errors=True)
    with inductor_cache(cache):
        return measure(a, run, log, hook)


@contextlib.contextmanager
def inductor_cache(path: Path):
    """torch.compile's caches in `path` for this run (empty unless --keep-inductor-cache), as before after it."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def measure(a, run: Run, log: Path, hook) -> dict:
    names = run.names
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.precision]
    if a.device == "cuda" and run.micro_batch is None:
        memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
        run.micro_batch, _ = plan_micro_batch(memory_gb, len(names), a.precision, a.seq_len,
                                              PLANNER_MODEL.get(a.model_size, "GPT-2 124M"))
        if run.micro_batch is None:
            run.status = f"nothing fits: {len(names)} contenders in {memory_gb:.0f} GB"
            return run.write()
        run.notes.append(f"micro-batch {run.micro_batch}: the largest at which {len(names)} contenders fit "
                         f"{MEMORY_SHARE} x {memory_gb:.0f} GB by the planner")
    contenders = {}
    try:
        with deadline(a.deadline_s, a.started):
            phases(a, run, log, hook, dtype, contenders)
        run.status = "done" if run.rounds_done == a.rounds else f"done early: {run.rounds_done} of {a.rounds} " \
                                                                 "rounds fit before the deadline"
    except DeadlineReached as stop:
        run.status = f"stopped by {stop} in {run.phase}"
        run.notes.append(run.status)
    except BaseException as err:
        run.status = f"failed in {run.phase}: {type(err).__name__}: {err}"
        run.write()
        raise
    finally:
        for name, c in contenders.items():
            with contextlib.suppress(Exception):
                run.rows[name]["losses"] = list(c.losses)
    result = run.write()
    say(f"wrote {run.out} and {run.out.with_suffix('.md')}")
    print(markdown(result))
    release(contenders)
    return result


def phases(a, run: Run, log: Path, hook, dtype: torch.dtype, contenders: dict) -> None:
    """Data, the matmul peak, the contenders built and warmed up (one that runs out of memory again, alone, at half
    its micro-batch), their counted steps, then the rounds; the results written after each phase."""
    names = run.names
    run.phase = "data and matmul peak"
    data = make_data(a, run.micro_batch)
    run.vocab_size = data.vocab_size
    run.peaks.append(measured_peak(a, dtype))
    build(run, data, log, contenders)
    warm_up(run, contenders, data, log, hook)
    run.phase = "counted steps"
    with into_log(log):
        for name, c in contenders.items():
            run.rows[name]["syncs_per_step"] = counted_step(c, a.device)
    from .workers import tensor_bytes
    for name, c in contenders.items():   # tensors kept between steps (walks Python objects: host only)
        run.rows[name]["state_mb"] = tensor_bytes(*c.state()) / 1e6
    run.write()
    hook(run.phase, run)
    for r in range(a.rounds):
        left = a.deadline_s - (time.monotonic() - a.started)
        if r and run.last_round_s * 1.1 > left:   # it would be cut short: its blocks could not be paired
            run.notes.append(f"round {r + 1} not started: {left:.1f} s left before the deadline, a round takes "
                             f"{run.last_round_s:.1f} s")
            break
        run.phase = f"round {r + 1}"
        start = time.perf_counter()
        order = list(contenders.items()) if r % 2 == 0 else list(contenders.items())[::-1]
        for name, c in order:
            with into_log(log):
                run.rows[name]["blocks"][r] = timed_block(c, a.steps, a.device)
        run.last_round_s = time.perf_counter() - start
        for name, c in contenders.items():
            run.rows[name]["losses"] = list(c.losses)
        run.peaks.append(measured_peak(a, dtype))
        run.rounds_done = r + 1
        run.write()
        say(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{n} {run.rows[n]['blocks'][r]['wall_s']:.2f}"
                                                      for n in names) + " s per block")
        hook(run.phase, run)


def main(argv=None, hook=lambda phase, run: None, started: float | None = None) -> dict | None:
    """hook(phase, run) is called after each write (tests watch the file grow, or stop the run there).
    The deadline counts from `started` (time.monotonic(); the command passes its start), else from this call."""
    a = parse(argv)
    a.started = time.monotonic() if started is None else started
    if a.dry_run:
        return dry_run(a)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA GPU: use --smoke or --dry-run")
    if a.device == "cpu" and not a.smoke:
        print("no CUDA GPU here: nothing to time (--smoke runs the same code at toy sizes; --dry-run shows the plan)")
        return None
    if a.device == "cpu":
        a.matmul_size = min(a.matmul_size, 1024)
    return execute(a, hook)


if __name__ == "__main__":
    main(started=_STARTED)
