"""Which cells each notebook test runs. A notebook's ↻ sections (a `## ` heading marked ↻, cell tag
`restart-point`) run on their own after a kernel restart: tests/test_notebook_sections.py runs every ↻ section
but the first that way, in the precision the rule did not pick. nbval's second pass (tests/conftest.py, in that
precision too) therefore stops where the first of those sections starts: what follows would repeat them, and a
section after them without ↻ may read their variables, which the second pass would then hold from the first
pass. So such a section (05's decision table, 07's combined dimensions, 08's serving) runs in one precision."""
from pathlib import Path

import nbformat

RESTART_TAG, RESTART_MARK = "restart-point", "↻"


def other_precision() -> str:
    """The CPU precision the rule (or $TUTORIAL_PRECISION) did not pick: fp32 <-> bf16."""
    from helpers.runtime import detect
    return "bf16" if detect().precision == "fp32" else "fp32"


def is_section_heading(cell) -> bool:
    return cell.cell_type == "markdown" and cell.source.startswith("## ")


def restart_points(cells: list) -> list[int]:
    return [i for i, c in enumerate(cells) if RESTART_TAG in c.metadata.get("tags", [])]


def section_end(cells: list, start: int) -> int:
    """The index after the last cell of the section whose heading is cells[start]: the next `## ` heading."""
    return next((i for i in range(start + 1, len(cells)) if is_section_heading(cells[i])), len(cells))


def restart_tested(cells: list) -> list[int]:
    """The headings of the ↻ sections the restart test runs: all but the first, which is how a full pass starts
    (setup cells, then it, in a fresh kernel)."""
    return restart_points(cells)[1:]


def second_pass_cut(path: Path) -> int:
    """How many of the notebook's cells nbval's second pass runs: those before the first restart-tested ↻
    section (all of them when there is none)."""
    cells = nbformat.read(path, as_version=4).cells
    return (restart_tested(cells) or [len(cells)])[0]
