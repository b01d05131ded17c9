"""What the outputs stored in notebooks/ say about the run that made them, written where a reader looks for it:

    python -m benchmarks.stored_run            # prints the three texts below
    python -m benchmarks.stored_run --write    # writes them into the notebooks and notebooks/README.md

1. each notebook's opening line "**Time:** ...": the stored run's seconds on its machine and the T4 estimate;
2. notebooks/README.md's T4 table (benchmarks.colab_time), at the CPU peak notebook 01's stored output measured;
3. notebooks/README.md's paragraph on how the stored outputs were made: machine, precision, dates.

Nothing here is typed: every figure comes from the stored outputs (cell timings nbclient records, the machine
line each setup cell prints), so a notebook re-stored elsewhere changes them, and tests/test_stored_run.py fails
until they are written again.
"""
from __future__ import annotations

import argparse
import ast
import re

import nbformat

from benchmarks.colab_time import PAGE, cell_seconds, estimate, markdown
from helpers import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))
MACHINE = re.compile(r"([A-Z][\w() -]*? \(\d+ cores\))")   # helpers.runtime's name of a CPU device
PRECISION = re.compile(r"\b(fp32|bf16)\b")
CPU_FLAGS = ("avx512_bf16", "amx_bf16")                     # the flags the precision rule names when it sees them
PEAK = re.compile(r"512x512 matmul, [^:]*: (\{.*\})")         # notebook 01's plot of the rule's matmul speeds
TIME_LINE = re.compile(r"^\*\*Time:\*\*.*$", re.M)
PROVENANCE_HEADING = "## How the stored outputs were made\n\n"


def outputs(path) -> list[str]:
    return ["".join(o.get("text", "")) or "".join(o.get("data", {}).get("text/plain", ""))
            for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code" for o in c.get("outputs", [])]


def facts(path) -> dict:
    """One stored notebook: its seconds, the days it ran, the machine and precision its outputs name."""
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    days = sorted({c.metadata.get("execution", {}).get("iopub.execute_input", "")[:10] for c in cells} - {""})
    lines = [line for text in outputs(path) for line in text.splitlines() if MACHINE.search(line)]
    return {"notebook": path.stem, "seconds": sum(cell_seconds(c) for c in cells), "days": days,
            "machine": MACHINE.search(lines[0])[1] if lines else None,
            "precision": next((PRECISION.search(line)[1] for line in lines if PRECISION.search(line)), None),
            "flags": sorted({flag for line in lines for flag in CPU_FLAGS if flag in line})}


def stored_cpu_peak() -> tuple[str, float]:
    """(precision, TFLOP/s): the stored run's CPU matmul peak in the precision it trained in, from notebook 01."""
    precision = next(f["precision"] for f in map(facts, NOTEBOOKS) if f["precision"])
    speeds = next(ast.literal_eval(m[1]) for text in outputs(NOTEBOOKS[0]) if (m := PEAK.search(text)))
    return precision, float(speeds[precision].split()[0])


def table() -> str:
    return markdown(estimate(stored_cpu_peak()[1]))


def opening_lines() -> dict[str, str]:
    """notebook -> its "**Time:**" line."""
    t4 = {row["notebook"]: row["T4 estimate s"] for row in estimate(stored_cpu_peak()[1])}
    every = list(map(facts, NOTEBOOKS))
    run_machine = next(f["machine"] for f in every if f["machine"])   # for the notebooks that print none
    lines = {}
    for f in every:
        low, high = t4[f["notebook"]]
        machine = f["machine"] or run_machine
        lines[f["notebook"]] = (f"**Time:** {f['seconds']:.0f} s in the stored run (`{machine}`); on a Colab T4 an "
                                f"estimated {low / 60:.1f}-{high / 60:.1f} min, plus the set-up "
                                "([notebooks/README.md](README.md#time-on-a-colab-t4-estimated)).")
    return lines


def provenance() -> str:
    """notebooks/README.md's paragraph under PROVENANCE_HEADING."""
    every = list(map(facts, NOTEBOOKS))
    machines = sorted({f["machine"] for f in every if f["machine"]})
    precisions = sorted({f["precision"] for f in every if f["precision"]})
    flags = sorted({flag for f in every for flag in f["flags"]})
    days = sorted({day for f in every for day in f["days"]})
    silent = [f["notebook"][:2] for f in every if not f["machine"]]
    peak_precision, peak = stored_cpu_peak()
    return (f"The outputs stored in `notebooks/` come from `.venv/bin/python -m helpers.run_notebooks --in-place` on "
            f"{' and '.join(f'`{m}`' for m in machines)}, on {' to '.join(dict.fromkeys([days[0], days[-1]]))}. Its precision rule picked "
            f"{' and '.join(precisions)}" + (f" (the CPU has {' and '.join(f'`{x}`' for x in flags)})" if flags else "")
            + f"; notebook 01 measured its {peak_precision} matmuls at {peak:g} TFLOP/s (512 x 512), the peak the T4 "
            "table above assumes. Each notebook that times or trains prints the machine and the precision in its setup "
            f"cells (notebooks {', '.join(silent)} print none: they train in fp32 on any machine). This paragraph and "
            "each notebook's **Time:** line are written from those outputs by `python -m benchmarks.stored_run --write`. "
            "Cells tagged `nbval-ignore-output` hold measured numbers; every other output must come out the same on "
            "any machine ([tests/README.md](../tests/README.md)).")   # one line: a wrap would cut a code span


def write() -> None:
    for path, line in zip(NOTEBOOKS, opening_lines().values()):
        nb = nbformat.read(path, as_version=4)
        opening = nb.cells[0]
        if not TIME_LINE.search(opening.source):
            raise SystemExit(f"{path.name}: its first cell has no line starting '**Time:**' to write into")
        opening.source = TIME_LINE.sub(lambda _: line, opening.source, count=1)
        nbformat.write(nb, path)
    page = PAGE.read_text()
    header = markdown([])
    before, rest = page.split(header, 1)
    rows = rest.strip("\n").splitlines()
    after = "\n".join(rows[next(i for i, r in enumerate(rows) if not r.startswith("|")):]).lstrip("\n")
    page = before + table() + "\n\n" + after + "\n"
    head, tail = page.split(PROVENANCE_HEADING, 1)
    page = head + PROVENANCE_HEADING + provenance() + tail[tail.index("\n\n"):].lstrip("\n").join(["\n\n", ""])
    PAGE.write_text(page)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="write the texts into the notebooks and notebooks/README.md")
    if p.parse_args(argv).write:
        write()
        return
    print(*opening_lines().values(), "", table(), "", provenance(), sep="\n")


if __name__ == "__main__":
    main()
