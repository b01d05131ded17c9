"""Run the whole tutorial headless: execute every notebook in order, as a reader would.

    python -m helpers.run_notebooks               # executed copies -> runs/executed/, plots -> runs/<notebook>/figures/
                                                  # (runs/ is $TUTORIAL_RUN_DIR when set)
    python -m helpers.run_notebooks --only 03     # one notebook
    python -m helpers.run_notebooks --in-place    # refresh the outputs stored in notebooks/ (maintainers)
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from helpers import REPO_ROOT
from helpers.runtime import run_dir

NOTEBOOKS = REPO_ROOT / "notebooks"


def execute(path: Path, out_path: Path, timeout: int = 1200) -> float:
    """Execute one notebook in its own folder with a fresh kernel; returns seconds taken."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:   # a failed run is saved too: the cell that failed shows its traceback
        out_path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out_path)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run only notebooks whose name starts with this, e.g. 03")
    parser.add_argument("--in-place", action="store_true", help="overwrite notebooks/ with the executed copies")
    parser.add_argument("--out", type=Path, default=None, help="default: $TUTORIAL_RUN_DIR/executed or runs/executed")
    args = parser.parse_args(argv)
    args.out = args.out or run_dir("executed")
    paths = sorted(p for p in NOTEBOOKS.glob("[0-9]*.ipynb") if not args.only or p.name.startswith(args.only))
    if not paths:
        raise SystemExit(f"no notebook in {NOTEBOOKS} starts with {args.only!r}")
    for path in paths:
        out = path if args.in_place else args.out / path.name
        print(f"running {path.name} ...", flush=True)
        print(f"  done in {execute(path, out):.0f} s -> {out}", flush=True)
    print(f"\nExecuted notebooks: {NOTEBOOKS if args.in_place else args.out}\n"
          f"Plots and run files: {args.out.parent}/<notebook>/ (figures/, tensorboard/, checkpoints/)")


if __name__ == "__main__":
    main()
