"""What nbval's two passes over each notebook (tests/conftest.py) do not cover: where a notebook says a
section runs on its own (a `## ` heading marked ↻, cell tag `restart-point`), it does, from its heading to
the next `## ` heading, in a fresh kernel after only the setup cells (every cell before the first ↻
section): what a reader does after restarting the kernel and jumping there. It runs in the precision the rule
did not pick: nbval's first pass ran the section in the other one, after every earlier section, and its second
pass leaves these sections out (tests/passes.py). The first ↻ section is not run here: setup cells and then it
is how the full pass starts, in a fresh kernel too. Like them, it creates no file inside the repository:
everything goes under the run directory ($TUTORIAL_RUN_DIR).
Where the other precision is emulated bf16 (tests/passes.py) the run would repeat the first pass's computation in
the same precision, minutes of CI for the restart alone: there a reading of the code stands in for it (every name
a section reads is defined by the setup cells or the section), which runs on every machine.
"""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.passes import (RESTART_MARK, is_section_heading, names_a_restart_lacks, other_precision,
                          other_precision_emulated, restart_points, restart_tested, section_end)
from tests.repository import ROOT, repo_files

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))


def execute(cells: list, path: Path, run_dir: Path, monkeypatch) -> list:
    """Run `cells` in a fresh kernel in the notebook's folder; return the check cells that did not print ✓.
    Fails if the run created or deleted a file in the repository instead of writing under `run_dir`."""
    monkeypatch.setenv("TUTORIAL_RUN_DIR", str(run_dir))   # the kernel inherits it
    before = repo_files()
    nb = nbformat.v4.new_notebook(cells=cells, metadata=nbformat.read(path, as_version=4).metadata)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    changed = sorted(before ^ repo_files())
    assert not changed, f"the notebook created or deleted files in the repository, not under $TUTORIAL_RUN_DIR: {changed}"
    assert any(run_dir.iterdir()), "nothing reached the run directory: is TUTORIAL_RUN_DIR still honoured?"
    checks = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("# Check")]
    assert checks, "no check cell ran"
    return [c.source.splitlines()[0] for c in checks if not any("✓" in o.get("text", "") for o in c.outputs)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_restart_marks_agree_with_tags(path):
    """The reader sees ↻ in a heading; the tests see the tag. They must name the same cells."""
    cells = nbformat.read(path, as_version=4).cells
    marked = [i for i, c in enumerate(cells) if c.cell_type == "markdown"
              and any(line.startswith("#") and RESTART_MARK in line for line in c.source.splitlines())]
    assert marked == restart_points(cells)
    for i in marked:   # the mark sits on the section's heading, the cell's first line
        assert is_section_heading(cells[i]), f"cell {i}: start the cell with the ↻ section's '## ' heading"


SECTIONS = [(path, i) for path in NOTEBOOKS for i in restart_tested(nbformat.read(path, as_version=4).cells)]


@pytest.mark.parametrize("path, start", SECTIONS, ids=[f"{p.stem}-cell{i}" for p, i in SECTIONS])
def test_marked_section_reads_only_names_the_setup_or_itself_defines(path, start):
    assert names_a_restart_lacks(nbformat.read(path, as_version=4).cells, start) == set()


def test_the_reading_names_what_an_earlier_section_defined():
    """It can fail: a ↻ section reading a variable of the section before it, through a magic too."""
    code, text = nbformat.v4.new_code_cell, nbformat.v4.new_markdown_cell
    cells = [code("import os\nRUN = 'runs'"),
             text("## 1 · First ↻", metadata={"tags": ["restart-point"]}), code("losses = [1.0]"),
             text("## 2 · Second ↻", metadata={"tags": ["restart-point"]}),
             code("def last(xs):\n    return xs[-1]\nprint(last(losses), os.sep, RUN)"),
             code("%time total = sum(steps)")]
    assert names_a_restart_lacks(cells, 3) == {"losses", "steps"}
    assert names_a_restart_lacks(cells, 1) == set()


@pytest.mark.skipif(other_precision_emulated(), reason="the other precision is emulated bf16: the run would repeat the "
                    "first pass's computation; the reading of the code above stands in (tests/passes.py)")
@pytest.mark.parametrize("path, start", SECTIONS, ids=[f"{p.stem}-cell{i}" for p, i in SECTIONS])
def test_marked_section_runs_after_a_restart(path, start, tmp_path, monkeypatch):
    cells = nbformat.read(path, as_version=4).cells
    section = cells[:restart_points(cells)[0]] + cells[start:section_end(cells, start)]   # setup cells, then this one
    monkeypatch.setenv("TUTORIAL_PRECISION", other_precision())   # the kernel inherits it
    assert execute(section, path, tmp_path, monkeypatch) == []
