"""Everything here that only a CUDA GPU can run, in one command (under 8 minutes on one GPU):

    python -m benchmarks.gpu                      # -> runs/gpu/summary.json and summary.md
    python -m benchmarks.gpu --out benchmarks/measured/gpu_h200   # (maintainers: keep the result)

1. notebooks 01 and 03 executed on the GPU (their check cells must hold there too);
2. the fp16 engine with dynamic loss scaling (configs/fp16.json): overflowing steps are skipped and the
   scale lowered, the loss still falls;
3. the bf16 engine (configs/bf16.json);
4. benchmarks.trainer_vs_plain in its GPU mode (GPT-2 124M, bf16, sequence 1024), eager and compiled.

Each part runs in a process of its own with a time limit, so one failure is reported and the rest still
run. Without a CUDA GPU it says so and exits 0: nothing here can run on a CPU (CI runs the CPU paths).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from helpers import REPO_ROOT

# Commands after `python -m`, sized to keep the whole under 8 minutes on one GPU.
TRAIN = ["helpers.programs.train", "--model-size", "small", "--seq-len", "128", "--steps", "60"]
BENCHMARK = ["benchmarks.trainer_vs_plain", "--device", "cuda", "--steps", "10", "--rounds", "4",
             "--stages", "0", "2", "--hf-stages", "0", "--compiled-stages", "0", "2", "--hf-compiled-stages",
             "--no-control"]


def parts(out: Path) -> list[dict]:
    """Each part: its name, its command, its time limit, and the JSON it writes (None: pass/fail only)."""
    bench = out / "benchmark" / "trainer_vs_plain.json"
    return [
        {"name": "notebook 01", "command": ["helpers.run_notebooks", "--only", "01", "--out", str(out / "notebooks")],
         "limit": 90, "result": None},
        {"name": "notebook 03", "command": ["helpers.run_notebooks", "--only", "03", "--out", str(out / "notebooks")],
         "limit": 180, "result": None},
        {"name": "fp16, dynamic loss scaling", "command": [*TRAIN, "--config", "configs/fp16.json", "--out",
                                                           str(out / "fp16")], "limit": 90, "result": out / "fp16" / "rank0.json"},
        {"name": "bf16", "command": [*TRAIN, "--config", "configs/bf16.json", "--out", str(out / "bf16")],
         "limit": 60, "result": out / "bf16" / "rank0.json"},
        {"name": "benchmark, eager and compiled", "command": [*BENCHMARK, "--out", str(bench)], "limit": 240,
         "result": bench},
    ]


def run_part(part: dict, out: Path) -> dict:
    name, command, limit = part["name"], part["command"], part["limit"]
    log = out / "logs" / (name.split(",")[0].replace(" ", "_") + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"{name} ...", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run([sys.executable, "-m", *command], cwd=REPO_ROOT, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.perf_counter() - start
    status = "passed" if code == 0 else f"timed out after {limit} s" if code is None else f"failed (exit {code})"
    print(f"  {status} in {seconds:.0f} s (log: {log})", flush=True)
    result = read_result(part["result"]) if part["result"] is not None and part["result"].is_file() else None
    return {"name": name, "command": "python -m " + " ".join(command), "status": status,
            "seconds": seconds, "log": str(log), "result": result}


def read_result(path: Path) -> dict:
    """The figures a part wrote: a training run's (helpers.programs.train) or the benchmark's."""
    run = json.loads(path.read_text())
    if "history" in run:
        losses = [m["loss"] for m in run["history"]]
        return {"first_loss": losses[0], "final_loss": losses[-1], "eval_loss": run["eval_loss"],
                "skipped_steps": run["history"][-1]["skipped_steps"],
                "tokens_per_s": run["summary"]["tokens_per_s"], "peak_memory_mib": run["summary"]["peak_memory_mib"]}
    return {"contenders": {n: {"tokens_per_s": r["tokens_per_s"], "vs_plain": r["vs_plain"]["median"],
                               "mfu": r["mfu"]} for n, r in run["contenders"].items()},
            "compiled": run["compiled"], "table": str(path.with_suffix(".md"))}


def markdown(summary: dict) -> str:
    lines = [f"{summary['gpu']}; torch {summary['torch']}. Total {summary['seconds']:.0f} s.", "",
             "| part | status | seconds |", "|---|---|---:|"]
    lines += [f"| {p['name']} | {p['status']} | {p['seconds']:.0f} |" for p in summary["parts"]]
    for p in summary["parts"]:
        if p["result"] and "final_loss" in p["result"]:
            r = p["result"]
            lines.append(f"\n{p['name']}: loss {r['first_loss']:.3f} -> {r['final_loss']:.3f} (held-out "
                         f"{r['eval_loss']:.3f}), {r['skipped_steps']} skipped steps, {r['tokens_per_s']:,.0f} "
                         f"tokens/s, peak {r['peak_memory_mib']:,.0f} MiB")
        elif p["result"]:
            lines += ["", Path(p["result"]["table"]).read_text()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gpu")
    a = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to run (every CPU path runs in `make test`)")
        return None
    a.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = [run_part(part, a.out) for part in parts(a.out)]
    summary = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "seconds": time.perf_counter() - start, "parts": results}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (a.out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return summary


if __name__ == "__main__":
    main()
