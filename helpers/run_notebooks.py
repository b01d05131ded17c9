"""Run the whole tutorial headless: execute every notebook in order, as a reader would.

    python -m helpers.run_notebooks               # executed copies -> runs/executed/, plots -> runs/<notebook>/figures/
                                                  # (runs/ is $TUTORIAL_RUN_DIR when set)
    python -m helpers.run_notebooks --only 03     # one notebook
    python -m helpers.run_notebooks --in-place    # refresh the outputs stored in notebooks/ (maintainers)
    python -m helpers.run_notebooks --only 05 --allow-errors --cap 240   # every failing cell recorded, not only
                                                  # the first; stopped after 240 s with the cells run so far saved
"""
from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from helpers import REPO_ROOT
from helpers.runtime import run_dir

NOTEBOOKS = REPO_ROOT / "notebooks"


class CapReached(Exception):
    """A notebook ran past its --cap."""


def execute(path: Path, out_path: Path, timeout: int = 1200, allow_errors: bool = False, cap: int | None = None) -> float:
    """Execute one notebook in its own folder with a fresh kernel; returns seconds taken. allow_errors: a cell
    that raises is recorded and the next one runs. cap: seconds for the whole notebook, then CapReached."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    if cap:   # an alarm, not a timeout around the process: the cells run so far are still written below
        signal.signal(signal.SIGALRM, _cap_reached)
        signal.alarm(cap)
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:   # a failed run is saved too: the cell that failed shows its traceback
        signal.alarm(0)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out_path)
    return time.perf_counter() - start


def _cap_reached(signum, frame):
    raise CapReached("the notebook ran past its --cap")


def end_children() -> None:
    """End the processes a stopped notebook left (its kernel, which runs in a session of its own, and the rank
    programs it launched): an alarm leaves no time for nbclient's own clean-up."""
    import psutil
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:   # it ended on its own meanwhile
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run only notebooks whose name starts with this, e.g. 03")
    parser.add_argument("--in-place", action="store_true", help="overwrite notebooks/ with the executed copies")
    parser.add_argument("--out", type=Path, default=None, help="default: $TUTORIAL_RUN_DIR/executed or runs/executed")
    parser.add_argument("--allow-errors", action="store_true",
                        help="record a failing cell and run on (default: stop at the first error)")
    parser.add_argument("--cap", type=int, default=None,
                        help="seconds per notebook; past it the notebook stops with the cells run so far saved")
    args = parser.parse_args(argv)
    args.out = args.out or run_dir("executed")
    paths = sorted(p for p in NOTEBOOKS.glob("[0-9]*.ipynb") if not args.only or p.name.startswith(args.only))
    if not paths:
        raise SystemExit(f"no notebook in {NOTEBOOKS} starts with {args.only!r}")
    for path in paths:
        out = path if args.in_place else args.out / path.name
        print(f"running {path.name} ...", flush=True)
        try:
            print(f"  done in {execute(path, out, allow_errors=args.allow_errors, cap=args.cap):.0f} s -> {out}",
                  flush=True)
        except CapReached:
            end_children()
            raise SystemExit(f"  stopped at its cap of {args.cap} s -> {out} (the cells run so far)")
    print(f"\nExecuted notebooks: {NOTEBOOKS if args.in_place else args.out}\n"
          f"Plots and run files: {args.out.parent}/<notebook>/ (figures/, tensorboard/, checkpoints/)")


if __name__ == "__main__":
    main()
