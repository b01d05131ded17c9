"""Everything here that only a CUDA GPU can run, in one command, under 8 minutes on one GPU:

    python -m benchmarks.gpu --dry-run            # each part, its time cap and their sum (no GPU needed)
    python -m benchmarks.gpu --dry-run --gpu T4   # what would run on another GPU, and what is skipped
    python -m benchmarks.gpu                      # -> runs/gpu/summary.json and summary.md
    python -m benchmarks.gpu --out benchmarks/measured/gpu_h200   # (maintainers: keep the result)

1. notebooks 01 and 03 executed on the GPU: every check cell must print its ✓ there too;
2. fp16 with dynamic loss scaling (configs/fp16.json, the scale started at 2**32 so that the first steps
   overflow): overflowing steps are skipped and counted, the scale moves, the loss still falls;
3. bf16 (configs/bf16.json; Ampere or newer, skipped below sm_80): the loss falls;
4. benchmarks.trainer_vs_plain in its GPU mode (GPT-2 124M, sequence 1024), eager and compiled: the
   contenders' first losses agree with the plain loop's, each compiled one follows its eager twin,
   tokens/s and MFU reported. Its micro-batch is the largest whose contenders (one process each, all
   alive at once) fit the GPU by the tutorial's memory planner.

Each part runs in a process of its own under a time cap; the summary is rewritten after every part, so a
failed or timed-out part (or the whole command stopped) leaves the results so far. Without a CUDA GPU it
says so and exits 0: nothing here can run on a CPU (CI runs the CPU paths).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from helpers import REPO_ROOT
from helpers.config import load_json, save_json

BUDGET_S = 480   # one command on a borrowed GPU machine may run 600 s; start-up and copying need the rest
TRAIN = ["helpers.programs.train", "--model-size", "small", "--seq-len", "128", "--steps", "60"]
BENCHMARK_STAGES = ["--stages", "0", "2", "--hf-stages", "0", "--compiled-stages", "0", "2", "--hf-compiled-stages",
                    "--no-control"]
BENCHMARK_CONTENDERS = 7   # plain, plain-compiled, ds0, hf0, ds0-compiled, ds2, ds2-compiled: alive at once
FP16_OVERFLOW_POWER = 32   # 2**32 x a loss of ~5 overflows fp16 (max 65504): the first steps must be skipped


def benchmark_micro_batch(memory_gb: float, precision: str, share: float = 0.9) -> int | None:
    """The largest micro-batch of (8, 4, 2, 1) at which BENCHMARK_CONTENDERS processes of GPT-2 124M (sequence
    1024, the benchmark's GPU defaults) fit in `share` of the GPU's memory (GB, 10^9 bytes) by the planner of
    notebook 05: model states at ZeRO 0, activations, the fixed overhead per process; None if none does."""
    from helpers.memory import planner
    rows = planner.plan("GPT-2 124M", share * memory_gb / BENCHMARK_CONTENDERS, precision=precision,
                        micro_batches=(8, 4, 2, 1))
    fitting = [r["micro_batch"] for r in rows if (r["stage"], r["offload"], r["checkpointing"]) == (0, "none", False)
               and r["fits"]]
    return max(fitting, default=None)


def parts(out: Path, capability: tuple, memory_gb: float) -> list[dict]:
    """Each part: name, command (after `python -m`; None: skipped), cap in seconds, what it writes, its check,
    and why it is skipped where it is."""
    from helpers.hardware import gpu_has_bf16
    bf16 = gpu_has_bf16(capability)
    precision = "bf16" if bf16 else "fp32"   # the benchmark's choices (no fp16 mode: the plain loop has no scaler)
    micro_batch = benchmark_micro_batch(memory_gb, precision)
    bench = out / "benchmark" / "trainer_vs_plain.json"
    notebooks = out / "notebooks"
    return [
        {"name": "notebook 01", "cap": 75, "check": check_notebook, "result": notebooks / "01_setup.ipynb",
         "command": ["helpers.run_notebooks", "--only", "01", "--out", str(notebooks)]},
        {"name": "notebook 03", "cap": 150, "check": check_notebook, "result": notebooks / "03_trainer.ipynb",
         "command": ["helpers.run_notebooks", "--only", "03", "--out", str(notebooks)]},
        {"name": "fp16, dynamic loss scaling", "cap": 45, "check": check_fp16, "result": out / "fp16" / "rank0.json",
         "command": [*TRAIN, "--config", str(out / "fp16_overflow.json"), "--out", str(out / "fp16")],
         "config": fp16_overflow_config()},
        {"name": "bf16", "cap": 35, "check": check_loss_falls, "result": out / "bf16" / "rank0.json",
         "command": [*TRAIN, "--config", "configs/bf16.json", "--out", str(out / "bf16")] if bf16 else None,
         "skipped": None if bf16 else f"sm_{capability[0]}{capability[1]} has no bf16 tensor cores"},
        {"name": "benchmark, eager and compiled", "cap": 150, "check": check_benchmark, "result": bench,
         "command": ["benchmarks.trainer_vs_plain", "--device", "cuda", "--precision", precision, "--micro-batch",
                     str(micro_batch), "--steps", "10", "--rounds", "4", *BENCHMARK_STAGES, "--out", str(bench)]
         if micro_batch else None,
         "skipped": None if micro_batch else f"{BENCHMARK_CONTENDERS} contenders of GPT-2 124M do not fit {memory_gb:g} GB"},
    ]


def fp16_overflow_config() -> dict:
    config = load_json(REPO_ROOT / "configs" / "fp16.json")
    return {**config, "fp16": {**config["fp16"], "initial_scale_power": FP16_OVERFLOW_POWER}}


def check_notebook(path: Path) -> list[str]:
    """Problems of an executed notebook: a cell that raised, a check cell without its ✓."""
    import nbformat
    problems = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        if any(o.output_type == "error" for o in cell.outputs):
            problems.append(f"cell {i} raised: {next(o.evalue for o in cell.outputs if o.output_type == 'error')}"[:300])
        elif cell.source.startswith("# Check") and not any("✓" in o.get("text", "") for o in cell.outputs):
            problems.append(f"cell {i} printed no ✓: {cell.source.splitlines()[0]}")
    return problems


def losses(path: Path) -> list[float]:
    return [m["loss"] for m in json.loads(path.read_text())["history"]]


def check_loss_falls(path: Path) -> list[str]:
    seen = losses(path)
    first, last = sum(seen[:5]) / 5, sum(seen[-5:]) / 5
    return [] if last < first else [f"the loss did not fall: first five steps {first:.3f}, last five {last:.3f}"]


def check_fp16(path: Path) -> list[str]:
    history = json.loads(path.read_text())["history"]
    scales, skipped = [m["loss_scale"] for m in history], history[-1]["skipped_steps"]
    problems = check_loss_falls(path)
    if skipped < 1:
        problems.append(f"no step was skipped, though the scale started at 2**{FP16_OVERFLOW_POWER}")
    if min(scales) >= 2.0**FP16_OVERFLOW_POWER:
        problems.append(f"the loss scale never moved from 2**{FP16_OVERFLOW_POWER}")
    return problems


def check_benchmark(path: Path) -> list[str]:
    from helpers.precision import relative_loss_tolerance
    run = json.loads(path.read_text())
    problems = [] if run["first_losses_agree"] else [f"first losses differ from the plain loop's by more than "
                                                     f"{run['loss_tolerance']}"]
    rows, tolerance = run["contenders"], relative_loss_tolerance(run["config"]["precision"])
    for name, row in rows.items():
        if not row["mfu"] > 0:
            problems.append(f"{name}: no MFU")
        twin = rows.get(name.removesuffix("-compiled")) if name.endswith("-compiled") else None
        if twin is not None:
            worst = max(abs(c - e) / e for c, e in zip(row["losses"], twin["losses"]))
            if worst > tolerance:
                problems.append(f"{name}: losses differ from the eager twin's by {worst:.1e} (relative)")
    return problems


def run_part(part: dict, out: Path) -> dict:
    name, command, cap = part["name"], part["command"], part["cap"]
    if command is None:
        print(f"{name}: skipped ({part['skipped']})", flush=True)
        return {"name": name, "status": f"skipped: {part['skipped']}", "seconds": 0.0, "problems": []}
    if "config" in part:
        save_json(part["config"], command[command.index("--config") + 1])
    part["result"].unlink(missing_ok=True)   # an earlier run's file must not be judged as this run's
    log = out / "logs" / (name.split(",")[0].replace(" ", "_") + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"{name} (cap {cap} s) ...", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run([sys.executable, "-m", *command], cwd=REPO_ROOT, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=cap).returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.perf_counter() - start
    problems = part["check"](part["result"]) if part["result"].is_file() else [f"it wrote no {part['result'].name}"]
    status = ("timed out" if code is None else f"failed (exit {code})" if code else
              "passed" if not problems else "ran, but its check failed")
    print(f"  {status} in {seconds:.0f} s (log: {log})" + "".join(f"\n  - {p}" for p in problems), flush=True)
    return {"name": name, "command": "python -m " + " ".join(command), "status": status, "seconds": seconds,
            "log": str(log), "problems": problems, "result": str(part["result"])}


def markdown(summary: dict) -> str:
    lines = [f"{summary['gpu']}; torch {summary['torch']}. Total {summary['seconds']:.0f} s.", "",
             "| part | status | seconds | problems |", "|---|---|---:|---|"]
    lines += [f"| {p['name']} | {p['status']} | {p['seconds']:.0f} | {'; '.join(p['problems']) or '-'} |"
              for p in summary["parts"]]
    bench = next((p for p in summary["parts"] if p["name"].startswith("benchmark") and "result" in p), None)
    if bench and Path(bench["result"]).with_suffix(".md").is_file():
        lines += ["", Path(bench["result"]).with_suffix(".md").read_text()]
    return "\n".join(lines) + "\n"


def dry_run(planned: list[dict], gpu: str) -> None:
    total = sum(p["cap"] for p in planned if p["command"])
    for p in planned:
        what = "python -m " + " ".join(p["command"]) if p["command"] else f"skipped: {p['skipped']}"
        print(f"{p['name']:<32} cap {p['cap']:>4} s   {what}")
    print(f"sum of caps on the {gpu}: {total} s (budget {BUDGET_S} s)")


def main(argv=None) -> dict | None:
    from helpers.hardware import GPUS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gpu")
    p.add_argument("--dry-run", action="store_true", help="print the parts and their caps; run nothing")
    p.add_argument("--gpu", choices=sorted(GPUS), default="H200", help="with --dry-run: the GPU to plan for")
    a = p.parse_args(argv)
    if a.dry_run:
        spec = GPUS[a.gpu]
        dry_run(parts(a.out, spec["capability"], spec["memory_gb"]), a.gpu)
        return None
    import torch
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to run (every CPU path runs in `make test`); --dry-run shows the plan")
        return None
    props = torch.cuda.get_device_properties(0)
    a.out.mkdir(parents=True, exist_ok=True)
    summary = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "seconds": 0.0, "parts": []}
    start = time.perf_counter()
    for part in parts(a.out, (props.major, props.minor), props.total_memory / 1e9):
        summary["parts"].append(run_part(part, a.out))
        summary["seconds"] = time.perf_counter() - start   # written after every part: a stop loses nothing run
        (a.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (a.out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return summary


if __name__ == "__main__":
    main()
