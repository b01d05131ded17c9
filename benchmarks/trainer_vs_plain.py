"""A plain PyTorch loop vs AdvancedDeepSpeedTrainer (ZeRO 0-3) vs HF Trainer(deepspeed=the same config).

    python -m benchmarks.trainer_vs_plain            # CPU: 4.3M-param GPT-2, fp32; GPU: GPT-2 124M, bf16
    python -m benchmarks.trainer_vs_plain --smoke    # tiny sizes, under a minute: keeps it runnable in CI

Identical work: same model init, micro-batches and order, precision, and AdamW math (benchmarks.contenders).
Each contender runs in its own process (benchmarks.workers); after one warm-up block each they alternate
in rounds of one --steps block each, the order reversed every other round, so a busy spell of the machine
hits every contender. A block's clock covers all a contender does per step: data, forward, backward,
clipping, update, the loss's host sync, its logging.
Per contender: the median tokens/s over rounds; the median (min-max) of the per-round ratios to the
plain loop (blocks of one round run close together, under similar noise); and the ratio of the fastest
blocks (timeit's rule: other load on a shared machine only ever slows a block down). Page faults per
step: the fresh pages the kernel mapped in (helpers.runtime.keep_freed_memory's target). The JSON also
holds each block's CPU seconds.
plain2, the plain loop a second time in another process, shows the noise floor of those ratios.
MFU = achieved FLOP/s / the machine's peak matmul FLOP/s in the run's precision, measured in this run
(best of measurements between rounds: noise only ever slows a matmul down), with
    FLOPs per token = 6 N + 12 n_layer d_model seq_len
(forward 2N + backward 4N, plus attention's QK^T and AV, as in PaLM's appendix B; N = parameters except
the position embeddings, which do no matmul; the tied token embedding counts once, as the LM head).
Memory per contender (its own process): peak resident set (CPU) or CUDA allocator peak (GPU), with the
baseline after imports, and the tensor bytes kept between steps (parameters, gradients, optimizer state,
DeepSpeed's buffers; on a CPU a buffer's untouched pages are not resident).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from helpers.data import SyntheticTextDataset
from helpers.runtime import detect
from helpers.model import MODEL_SIZES

from .contenders import COMPILED, PLAIN_KEPT, Setup, TokenData
from .tables import markdown
from .workers import Worker

# Per device: the 4.3M-param GPT-2 on a CPU (4 layers, d=256, a 4096-word vocabulary, sequence 256,
# batch 8), GPT-2 124M on a GPU (12 layers, d=768, GPT-2's 50257-token vocabulary, sequence 1024).
DEFAULTS = {
    "cpu": dict(model_size="small", n_words=4096, vocab_size=None, seq_len=256, micro_batch=8, precision="fp32",
                steps=3, rounds=12, matmul_size=2048, stages=[0, 1, 2, 3], hf_stages=[0, 1, 2],
                compiled_stages=[0, 1, 2], hf_compiled_stages=[0], no_control=False),
    "cuda": dict(model_size="gpt2", n_words=4096, vocab_size=50257, seq_len=1024, micro_batch=8, precision="bf16",
                 steps=10, rounds=8, matmul_size=8192, stages=[0, 1, 2, 3], hf_stages=[0, 1, 2],
                 compiled_stages=[0, 1, 2], hf_compiled_stages=[0], no_control=False),
    "smoke": dict(model_size="tiny", n_words=128, vocab_size=None, seq_len=32, micro_batch=4, precision="fp32",
                  steps=2, rounds=1, matmul_size=256, stages=[0], hf_stages=[0], compiled_stages=[0],
                  hf_compiled_stages=[], threads=1, no_control=True),
}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes and one round: checks it runs, times nothing")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    for flag in ("--steps", "--rounds", "--seq-len", "--micro-batch", "--n-words", "--vocab-size", "--threads",
                 "--matmul-size"):
        p.add_argument(flag, type=int)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES))
    p.add_argument("--precision", choices=["fp32", "bf16"])
    p.add_argument("--stages", type=int, nargs="*", help="ZeRO stages of AdvancedDeepSpeedTrainer")
    p.add_argument("--hf-stages", type=int, nargs="*", help="ZeRO stages of HF Trainer")
    p.add_argument("--compiled-stages", type=int, nargs="*",
                   help="ZeRO stages of the trainer to run compiled too (with them: plain-compiled)")
    p.add_argument("--hf-compiled-stages", type=int, nargs="*", help="ZeRO stages of HF Trainer(torch_compile=True)")
    p.add_argument("--no-control", action="store_true", default=None,
                   help="leave out plain2 (the plain loop again) and, on a CPU, plain-kept")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/benchmarks/trainer_vs_plain.json")
    p.add_argument("--work-dir", default="runs/benchmarks/trainer_vs_plain",
                   help="scratch: each worker's log, TensorBoard files and inductor cache (kept apart from --out, "
                        "which may be a folder you commit)")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA GPU: use --device cpu")
    defaults = {"threads": torch.get_num_threads(), **DEFAULTS[a.device], **(DEFAULTS["smoke"] if a.smoke else {})}
    for key, value in defaults.items():   # what the command line left unset
        if getattr(a, key) is None:
            setattr(a, key, value)
    for flag, compiled, eager in (("--compiled-stages", a.compiled_stages, a.stages),
                                  ("--hf-compiled-stages", a.hf_compiled_stages, a.hf_stages)):
        if set(compiled) - set(eager):   # a compiled contender is measured against its eager twin
            p.error(f"{flag} {' '.join(map(str, compiled))}: add {sorted(set(compiled) - set(eager))} to "
                    f"{flag.replace('compiled-', '')} too (each compiled run is compared with its eager twin)")
    a.total = a.steps * (a.rounds + 1)   # the LR schedule spans the warm-up block and every round
    a.warmup = max(1, a.total // 10)
    return a


def load_data(a) -> TokenData:
    """Enough samples that no step repeats one."""
    data = SyntheticTextDataset(n_samples=max(64, a.total * a.micro_batch), seq_len=a.seq_len, n_words=a.n_words,
                                seed=a.seed)
    return TokenData(torch.stack([data[i]["input_ids"] for i in range(len(data))]), data.tokenizer, a.vocab_size)


def matmul_flops(n: int, device: str, dtype: torch.dtype, repeats: int = 5) -> float:
    """Peak matmul FLOP/s of an n x n product here: the best of a few (noise only slows it down)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):   # the first also warms up the BLAS
        start = time.perf_counter()
        (a @ b)[0, 0].item()       # .item() waits for a GPU to finish
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def contender_names(a) -> list[str]:
    """plain first (and plain-compiled when anything runs compiled), then each stage's trainer beside HF
    Trainer at that stage and their compiled twins (the pairs compared run back to back in every round),
    then plain2: the plain loop again in a process of its own, as far from plain as the order allows. Its
    ratio to plain is the noise floor: what separate processes and a shared machine make of two identical
    contenders. On a CPU, plain-kept (after plain-compiled) is the plain loop with the memory setting the
    trainer makes there (helpers.runtime.keep_freed_memory): its ratio to plain is what that setting alone
    is worth."""
    compiled = a.compiled_stages or a.hf_compiled_stages
    names = ["plain"] + ([f"plain{COMPILED}"] if compiled else [])
    names += [PLAIN_KEPT] if a.device == "cpu" and not a.no_control else []
    kinds = (("ds", a.stages, ""), ("hf", a.hf_stages, ""), ("ds", a.compiled_stages, COMPILED),
             ("hf", a.hf_compiled_stages, COMPILED))
    for stage in sorted(set().union(*(stages for _, stages, _ in kinds))):
        names += [f"{kind}{stage}{suffix}" for kind, stages, suffix in kinds if stage in stages]
    return names + ([] if a.no_control else ["plain2"])


def main(argv=None) -> dict:
    a, threads = parse(argv), torch.get_num_threads()
    torch.set_num_threads(a.threads)   # for the matmul peak: the workers' count
    try:
        return run(a)
    finally:
        torch.set_num_threads(threads)


def run(a) -> dict:
    start = time.perf_counter()
    data = load_data(a)
    setup = Setup(device=a.device, precision=a.precision, model_size=a.model_size, micro_batch=a.micro_batch,
                  lr=a.lr, warmup=a.warmup, total=a.total, grad_clip=a.grad_clip, seed=a.seed, threads=a.threads,
                  out_dir=a.work_dir)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.precision]
    workers = [Worker(name, data, setup) for name in contender_names(a)]
    try:
        for w in workers:   # built in parallel, waited for in turn
            w.wait()
        peaks = [matmul_flops(a.matmul_size, a.device, dtype)]
        # Warm-up block: allocator, kernels, optimizer state, and a compiled contender's compilation.
        first = {w.name: w.call("train", a.steps) for w in workers}
        blocks = {w.name: [] for w in workers}   # per round: {"wall_s", "cpu_s", "page_faults"}
        for r in range(a.rounds):
            for w in workers if r % 2 == 0 else workers[::-1]:
                blocks[w.name].append(w.call("train", a.steps))
            peaks.append(matmul_flops(a.matmul_size, a.device, dtype))
            progress(r, a.rounds, blocks)
        reports = {w.name: w.call("report") for w in workers}
    finally:
        for w in workers:
            w.close()
    return report(a, data, first, blocks, reports, max(peaks), time.perf_counter() - start)


def progress(r: int, rounds: int, blocks: dict) -> None:
    """One line per round on stderr: a run of minutes shows it is alive."""
    line = ", ".join(f"{name} {b[-1]['wall_s']:.1f}" for name, b in blocks.items())
    print(f"round {r + 1}/{rounds}, seconds per block: {line}", file=sys.stderr, flush=True)


def flops_per_token(a, vocab_size: int) -> tuple[int, int]:
    """(FLOPs per trained token, N): 6N + 12 n_layer d seq_len, N without the position embeddings."""
    n_layer, d, _ = MODEL_SIZES[a.model_size]
    n = n_layer * (12 * d * d + 13 * d) + vocab_size * d + 2 * d   # helpers.model.gpt2_param_count less n_pos d
    return 6 * n + 12 * n_layer * d * a.seq_len, n


def ratio_stats(mine: list[float], theirs: list[float]) -> dict:
    """Speed of mine relative to theirs, round by round (walls of the same round ran back to back)."""
    ratios = [t / m for m, t in zip(mine, theirs)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "best": min(theirs) / min(mine)}   # fastest block vs fastest block: noise only ever slows one down


def report(a, data, first: dict, blocks: dict, reports: dict, peak: float, seconds: float, k: int = 5) -> dict:
    tokens = a.steps * a.micro_batch * a.seq_len   # per block
    walls = {name: [b["wall_s"] for b in bs] for name, bs in blocks.items()}
    cpus = {name: [b["cpu_s"] for b in bs] for name, bs in blocks.items()}
    # fp32: the contenders differ only in summation order. bf16: DeepSpeed keeps bf16 weights with fp32
    # master copies while the plain loop autocasts fp32 weights, so the losses agree only roughly.
    tol = 1e-3 if a.precision == "fp32" else 5e-2
    fpt, n = flops_per_token(a, data.vocab_size)
    plain = reports["plain"]
    rows = {}
    for name, rep in reports.items():
        rate = statistics.median(tokens / w for w in walls[name])
        hf = f"hf{name[2:]}" if name.startswith("ds") else None
        diffs = [abs(x - y) for x, y in zip(rep["losses"], plain["losses"])]
        rows[name] = {
            "tokens_per_s": rate, "tokens_per_s_rounds": [tokens / w for w in walls[name]],
            "vs_plain": ratio_stats(walls[name], walls["plain"]),
            # CPU seconds the process used (in the JSON only: at 2+ threads, waiting threads spin, so
            # other load inflates it too). Ratio = plain's CPU time / this one's.
            "cpu_s_per_step": statistics.median(cpus[name]) / a.steps,
            # Minor page faults (fresh pages the kernel zeroes), what helpers.runtime.keep_freed_memory saves.
            "page_faults_per_step": statistics.median(b["page_faults"] for b in blocks[name]) / a.steps,
            "vs_plain_cpu": ratio_stats(cpus[name], cpus["plain"]),
            "vs_hf_same_stage_cpu": ratio_stats(cpus[name], cpus[hf]) if hf in cpus else None,
            "vs_hf_same_stage": ratio_stats(walls[name], walls[hf]) if hf in walls else None,
            "mfu": rate * fpt / peak,
            # What the warm-up block took beyond a steady block of as many steps: compilation, for a compiled one.
            "first_block_s": first[name]["wall_s"],
            "first_block_extra_s": first[name]["wall_s"] - statistics.median(walls[name]),
            "peak_memory_mb": rep["peak_bytes"] / 1e6, "baseline_memory_mb": rep["baseline_bytes"] / 1e6,
            "state_mb": rep["state_bytes"] / 1e6, "final_loss": rep["losses"][-1], "losses": rep["losses"],
            "max_loss_diff_first_steps": max(diffs[:k]), "max_loss_diff_all_steps": max(diffs),
            "max_lr_diff": max(abs(x - y) for x, y in zip(rep["lrs"], plain["lrs"]))}
    runtime = detect()
    result = {"config": vars(a), "machine": runtime.device_name, "threads": a.threads,
              "versions": versions(), "vocab_size": data.vocab_size,
              "peak_flops": peak, "flops_per_token": fpt, "n_params_matmul": n,
              "flops_formula": "6*N + 12*n_layer*d_model*seq_len",
              "memory_kind": "CUDA allocator peak" if a.device == "cuda" else "peak RSS (VmHWM)",
              "first_losses_agree": all(r["max_loss_diff_first_steps"] <= tol for r in rows.values()),
              "loss_tolerance": tol, "wall_s": seconds, "contenders": rows,
              "compiled": compiled_rows(rows, walls, a.steps)}
    table = markdown(result, min(k, len(plain["losses"])))
    print(table)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    return result


def compiled_rows(rows: dict, walls: dict, steps: int) -> dict:
    """Each compiled contender against its eager twin (the same name without -compiled), round by round:
    the steady-state speed-up, the compile time (the extra seconds of its warm-up block beyond the twin's)
    and the break-even: after how many steps the compiled run, compilation included, has caught up."""
    out = {}
    for name in (n for n in rows if n.endswith(COMPILED)):
        eager = name.removesuffix(COMPILED)
        compile_s = rows[name]["first_block_extra_s"] - rows[eager]["first_block_extra_s"]
        saved_per_step = (statistics.median(walls[eager]) - statistics.median(walls[name])) / steps
        out[name] = {"eager": eager, "vs_eager": ratio_stats(walls[name], walls[eager]),
                     "vs_plain_compiled": ratio_stats(walls[name], walls[f"plain{COMPILED}"]),
                     "compile_s": compile_s,
                     "break_even_steps": compile_s / saved_per_step if saved_per_step > 0 else None}
    return out


def versions() -> dict:
    from importlib.metadata import version   # importing deepspeed here would print its accelerator notice
    return {"python": sys.version.split()[0], "torch": torch.__version__, "deepspeed": version("deepspeed"),
            "transformers": version("transformers")}


if __name__ == "__main__":
    main()
