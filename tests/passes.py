"""Which cells each notebook test runs. A notebook's ↻ sections (a `## ` heading marked ↻, cell tag
`restart-point`) run on their own after a kernel restart: tests/test_notebook_sections.py runs every ↻ section
but the first that way, in the precision the rule did not pick (where that precision is emulated bf16, a
reading of the code stands in: names_a_restart_lacks). nbval's second pass (tests/conftest.py, in that
precision too) therefore stops where the first of those sections starts: what follows would repeat them, and a
section after them without ↻ may read their variables, which the second pass would then hold from the first
pass. So such a section (05's decision table, 07's combined dimensions, 08's serving) runs in one precision.
A notebook whose code never reads the precision (10: its scripts and configs name fp32 themselves) gets no second
pass: it would repeat the first exactly."""
import ast
import builtins
import re
from pathlib import Path

import nbformat

RESTART_TAG, RESTART_MARK = "restart-point", "↻"


def other_precision() -> str:
    """The CPU precision the rule (or $TUTORIAL_PRECISION) did not pick: fp32 <-> bf16."""
    from helpers.runtime import detect
    return "bf16" if detect().precision == "fp32" else "fp32"


def other_precision_emulated() -> bool:
    """Whether the other precision is bf16 on a CPU without bf16 instructions (avx512_bf16, amx_bf16), where torch
    emulates it 13-30x slower than fp32. There the second notebook pass is left out and the restart test runs in
    the rule's precision: measured on a 2-core AMD EPYC without them, the emulated passes took CI from about 45 to
    about 85 minutes (the hard limit is 90). CPUs with the instructions run the bf16 path."""
    from helpers.precision import CPU_BF16_FLAGS, cpu_flags
    return other_precision() == "bf16" and not set(CPU_BF16_FLAGS) & cpu_flags()


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


def reads_precision(cells: list) -> bool:
    """Whether any code cell reads the precision, itself or through a helper that picks one: the word `precision`
    (TUTORIAL_PRECISION, `rt.precision`, `resolve_precision`...), `detect(`, the trainer, `build_config`, a rank
    program (`run_program`, `run_here`), or the modules that decide it (hardware, precision), in its code,
    comments left out. Where none does, a run in the other precision computes what the first run computed."""
    code = "\n".join(re.sub(r"#.*", "", c.source) for c in cells if c.cell_type == "code")
    return re.search(r"precision|detect\(|AdvancedDeepSpeedTrainer|build_config|run_program|run_here"
                     r"|helpers(\.| import )(trainer|hardware|precision)\b", code, re.IGNORECASE) is not None


def second_pass_cut(path: Path) -> int:
    """How many of the notebook's cells nbval's second pass runs: none where no cell reads the precision; else
    those before the first restart-tested ↻ section (all of them when there is none)."""
    cells = nbformat.read(path, as_version=4).cells
    if not reads_precision(cells):
        return 0
    return (restart_tested(cells) or [len(cells)])[0]


# What IPython itself puts in a kernel's namespace, beside Python's builtins.
IPYTHON_NAMES = {"get_ipython", "display", "In", "Out", "exit", "quit"}


def names_a_restart_lacks(cells: list, start: int) -> set[str]:
    """The names the ↻ section at cells[start] reads that neither the setup cells (those before the first ↻) nor
    the section itself define: after a restart they raise NameError. Read from the code (IPython's magics
    turned into Python first), not run: what the restart test checks by running, on machines where it skips
    (tests/test_notebook_sections.py). It sees names, not files or order: a section reading another one's
    files, or a name before its own later cell defines it, is only caught by running it."""
    setup, section = cells[:restart_points(cells)[0]], cells[start:section_end(cells, start)]
    trees = {id(c): python_of(c.source) for c in setup + section if c.cell_type == "code"}
    defined = set(dir(builtins)) | IPYTHON_NAMES
    for tree in trees.values():
        defined |= stored_names(tree)
    read = {n.id for c in section if id(c) in trees for n in ast.walk(trees[id(c)])
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return read - defined


# Magics whose argument (line magics) or body (cell magics) IPython runs as Python in the kernel's namespace.
PYTHON_MAGICS = {"time", "timeit", "prun", "capture"}


def python_of(source: str) -> ast.Module:
    """A cell as the Python IPython runs: magics become get_ipython() calls, and the code a magic runs is parsed too."""
    from IPython.core.inputtransformer2 import TransformerManager
    tree = ast.parse(TransformerManager().transform_cell(source))
    for node in list(ast.walk(tree)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("run_line_magic", "run_cell_magic") and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in PYTHON_MAGICS):
            tree.body.extend(python_of(node.args[-1].value).body)   # the line magic's code, or the cell's body
    return tree


def stored_names(tree: ast.AST) -> set[str]:
    """Every name the code binds anywhere (assignments, loop and with targets, parameters, defs, imports, except
    and match captures): a superset of what it binds at the top, so a name is never missed for being local."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
    return names
