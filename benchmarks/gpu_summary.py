"""What `python -m benchmarks.gpu` writes under --out after every part, in at most MAX_FILES files:

    summary.json   every part: status, seconds, problems; every notebook's failing cells (source and error line);
                   the installed packages against their pins and floors
    summary.md     the same to read: the machine, the packages' problems, a table per part, each failing cell, what
                   emulation does not prove, the benchmark's table (from gpu_benchmark.md beside it)
    logs.txt       the last lines of the log of every part that did not pass
    gpu_benchmark.json, gpu_benchmark.md   benchmarks.gpu_benchmark's own, rewritten after every phase of it

The executed notebooks stay in the work folder (too large to bring back); what a reader needs of them, the
failing cells' source and error, is copied here.
"""
from __future__ import annotations

import json
from pathlib import Path

MAX_FILES = 8
SOURCE_LINES = 6    # of a failing cell's source, in the summary
LOG_TAIL = 40       # lines of a failing part's log, in logs.txt
T4_NOT_PROVEN = ("the emulation runs the real GPU's kernels: it proves the tutorial's choices on a T4 (fp16 with "
                 "loss scaling, no bf16, no flash or cuDNN attention, 15 GB), not that Turing's kernels run or are fast "
                 "enough, nor that Triton (torch.compile) builds for sm_75; its seconds are not a T4's")


def notebook_report(path: Path) -> dict:
    """An executed notebook's cells: how many ran, which failed (index, first source lines, error line), which
    check cells (source starting '# Check') printed their ✓, and which did not."""
    import nbformat
    nb = nbformat.read(path, as_version=4)
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    ran = [(i, c) for i, c in code if c.get("execution_count") is not None or c.outputs]
    failing, ticks, no_tick = [], 0, []
    for i, cell in ran:
        error = next((o for o in cell.outputs if o.output_type == "error"), None)
        if error is not None:
            failing.append({"cell": i, "source": "\n".join(cell.source.splitlines()[:SOURCE_LINES]),
                            "error": f"{error.ename}: {error.evalue}"[:400]})
        elif cell.source.startswith("# Check"):
            if any("✓" in o.get("text", "") for o in cell.outputs):
                ticks += 1
            else:
                no_tick.append({"cell": i, "source": cell.source.splitlines()[0]})
    last = ran[-1] if ran else None   # where a notebook stopped at its cap: the cell that was running
    return {"cells": len(code), "cells_run": len(ran), "failing": failing, "checks_passed": ticks,
            "checks_without_tick": no_tick, "last_run": {"cell": last[0], "source": last[1].source.splitlines()[0]
                                                         if last[1].source else ""} if last else None}


def cell_text(text: str) -> str:
    """Text that stays inside one cell of a markdown table."""
    return text.replace("\n", " ").replace("|", "\\|")


def prepare_line(prep: dict) -> str:
    if "error" in prep:
        return f"Prepare failed after {prep['seconds']:.0f} s: {prep['error']}"
    return (f"Prepare ({prep['seconds']:.0f} s): TORCH_CUDA_ARCH_LIST={prep['TORCH_CUDA_ARCH_LIST']}; stale JIT locks "
            f"removed: {len(prep['stale locks removed'])}; ops: " + "; ".join(f"{k} {v}" for k, v in prep["ops"].items()))


def package_lines(check: dict) -> list[str]:
    rows = check.get("packages", {})
    lines = ["| package | installed | from | pin | floor |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {r['installed'] or 'missing'} | {r.get('from', '-')} | {r['pin']} | {r.get('floor') or '-'} |"
              for name, r in rows.items()]
    return lines + [""] + [f"- package problem: {p}" for p in check.get("problems", [])] + [""]


def markdown(summary: dict, table: str | None = None) -> str:
    """The summary to read; `table`: the benchmark's markdown, where it has written one."""
    facts = summary.get("prepare", {}).get("facts", {})
    lines = [f"# GPU run: {facts.get('GPU', 'no GPU')} ({facts.get('capability', '?')})", "",
             f"Total {summary['seconds']:.0f} s of a {summary['deadline_s']} s deadline, "
             f"{summary.get('started_before_s', 0):.0f} s of it before the kit started (the wheels' install).", ""]
    if facts:
        lines += ["| fact | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in facts.items()], ""]
    if summary.get("packages"):
        lines += package_lines(summary["packages"])
    if summary.get("prepare"):
        lines += [prepare_line(summary["prepare"]), ""]
    lines += ["| lane | part | status | seconds | cap (granted) | cells run | failing cells | checks ✓ | problems |",
              "|---|---|---|---:|---:|---:|---:|---:|---|"]
    parts = sorted(summary["parts"], key=lambda p: p.get("lane", ""))   # by lane, each in its order of running
    for p in parts:
        nb = p.get("notebook") or {}
        lines.append(f"| {p.get('lane', '-')} | {p['name']} | {p['status']} | {p['seconds']:.0f} | {p.get('cap', '-')} "
                     f"({p.get('granted', '-')}) | "
                     f"{nb.get('cells_run', '-')}/{nb.get('cells', '-')} | {len(nb.get('failing', [])) if nb else '-'} | "
                     f"{nb.get('checks_passed', '-')} | {cell_text('; '.join(p.get('problems', [])) or '-')} |")
    for p in parts:
        for cell in (p.get("notebook") or {}).get("failing", []):
            lines += ["", f"**{p['lane']} / {p['name']}, cell {cell['cell']}**: `{cell['error']}`", "```python",
                      cell["source"], "```"]
    if any(p["name"].startswith("T4") or p["name"].endswith("(T4)") for p in summary["parts"]):
        lines += ["", f"T4 emulation: {T4_NOT_PROVEN}."]
    if table:
        lines += ["", "## Benchmark", "", table]
    return "\n".join(lines) + "\n"


def log_tails(summary: dict) -> str:
    out = []
    for p in summary["parts"]:
        log = Path(p.get("log", ""))
        if p["status"] != "passed" and log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
            out += [f"===== {p.get('lane', '-')} / {p['name']}: {p['status']} ({log})", *tail, ""]
    return "\n".join(out) + "\n"


def write(out: Path, summary: dict) -> list[Path]:
    """Write the summary's files (rewritten whole each time: a stopped run keeps what ran)."""
    out.mkdir(parents=True, exist_ok=True)
    bench = out / "gpu_benchmark.md"   # benchmarks.gpu_benchmark writes it there itself
    table = bench.read_text() if bench.is_file() else None
    files = {"summary.json": json.dumps(summary, indent=2, default=str) + "\n", "summary.md": markdown(summary, table),
             "logs.txt": log_tails(summary)}
    assert len(files) + 3 <= MAX_FILES   # and the benchmark's .json, .md and .json.tmp
    for name, text in files.items():
        (out / name).write_text(text)
    return [out / name for name in files]
