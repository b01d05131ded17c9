"""Every notebook runs top to bottom twice in one kernel, without a restart (nbval runs each once).

The second pass re-runs every cell against the state the first left behind (an initialised process
group, existing checkpoints, open engines), which is what a reader does when they press Run All again.
"""
import copy
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9]*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_twice_in_one_kernel(path, tmp_path, monkeypatch):
    monkeypatch.setenv("TUTORIAL_RUN_DIR", str(tmp_path))   # the kernel inherits it: write nothing in runs/
    nb = nbformat.read(path, as_version=4)
    nb.cells = nb.cells + copy.deepcopy(nb.cells)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    checks = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("# Check")]
    passed = [c for c in checks if any("✓" in o.get("text", "") for o in c.outputs)]
    assert checks and len(passed) == len(checks)   # every check cell printed its ✓, both times
