"""Every helpers module imports on its own, in a fresh interpreter, and helpers' imports form no circle.

The graph is read from the source (every `import` and `from ... import` naming a helpers module, at module
level or inside a function: a deferred import that closes a circle is still a circle in the design), and
checked for a cycle by depth-first search."""
import ast
import subprocess
import sys
from pathlib import Path

from tests.repository import ROOT

HELPERS = ROOT / "helpers"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(HELPERS.rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """The helpers modules `path` imports (a name imported from a package counts as its submodule if one exists)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
            source = ".".join(filter(None, (base, node.module)))
            found |= {f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names}
    return {m for m in found if m in MODULES and m != name}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, as [a, b, ..., a], or None."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return None

    return next((found for node in sorted(graph) if node not in state and (found := visit(node))), None)


def test_the_cycle_finder_finds_a_circle_and_passes_a_tree():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_reads_relative_and_absolute_imports():
    graph = {name: imported(name, path) for name, path in MODULES.items()}
    assert "helpers.memory.formulas" in graph["helpers.memory.measured"]   # absolute
    assert "helpers.checkpoints" in graph["helpers.trainer"]               # `from . import checkpoints`
    assert "helpers.precision" in graph["helpers.topics.activations"]      # `from ..precision import`


def program_imports(where: str, source: str) -> list[str]:
    """`where:line: import` for each import of `source` (the file `where`, relative to the repository) that names
    helpers.programs or a module in it: `import helpers.programs.x`, `from helpers.programs.x import y`,
    `from helpers import programs`, and the relative forms (`from ..programs.x import y`), at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node, where)
            names = [module, *(f"{module}.{a.name}" for a in node.names)]
        else:
            continue
        if any(n == "helpers.programs" or n.startswith("helpers.programs.") for n in names):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_program_import_check_reads_every_form():
    module = "helpers/memory/example.py"
    caught = ["import helpers.programs.zero_stages", "from helpers.programs.zero_stages import run_here",
              "from helpers import programs", "from ..programs.zero_stages import run_here", "from .. import programs",
              "def f():\n    from ..programs import zero_stages"]
    passed = ["from helpers import launch", "from ..precision import dtype", "from .formulas import GB",
              "import helpers.topics.moe"]
    assert all(program_imports(module, source) for source in caught)
    assert not any(program_imports(module, source) for source in passed)
    # the one arrow this test was written against: notebook 05's offload runs imported zero_stages.run_here
    assert program_imports(module, "from ..programs.zero_stages import run_here") == \
        ["helpers/memory/example.py:1: from ..programs.zero_stages import run_here"]


def test_no_library_module_imports_a_program():
    """A program may import a library module, never the other way round: a library module (anything in helpers/
    outside helpers/programs/) that needs what a program runs takes it as an argument from its caller (as
    helpers.topics.offload.compare takes `run`), so the library does not depend on a script that runs as a rank."""
    programs = HELPERS / "programs"
    found = [hit for path in sorted(HELPERS.rglob("*.py")) if not path.is_relative_to(programs)
             for hit in program_imports(str(path.relative_to(ROOT)), path.read_text())]
    assert not found, "a library module imports a program:\n" + "\n".join(found)


def test_helpers_imports_form_no_circle():
    graph = {name: imported(name, path) for name, path in MODULES.items()}
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_every_helpers_module_imports_in_a_fresh_interpreter():
    names = sorted(MODULES)
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-c", script, *names], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def defined_names(path: Path) -> set[str]:
    """The names a module defines itself (def, class, assignment); the names it imports do not count."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return found


def code_files():
    """(where, source) for every Python file and every notebook code cell that may import helpers."""
    import nbformat
    for path in [*HELPERS.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        yield str(path.relative_to(ROOT)), path.read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "code":   # IPython magics and shell lines are not Python: `pass` in their place
                yield f"{path.name} cell {i}", "\n".join(
                    line[:len(line) - len(line.lstrip())] + "pass" if line.lstrip().startswith(("%", "!")) else line
                    for line in cell.source.splitlines())


def absolute(node: ast.ImportFrom, where: str) -> str:
    """The module an import names, a relative one (`from ..precision import`) resolved against its file."""
    if not node.level:
        return node.module
    name = module_name(ROOT / where)
    package = name if where.endswith("__init__.py") else name.rpartition(".")[0]
    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
    return ".".join(filter(None, (*parts, node.module)))


def test_every_name_is_imported_from_the_module_that_defines_it():
    """One import path per name: `from helpers.config import ConfigError` would work while ConfigError lives in
    helpers.errors (config imports it), and a reader would then look for it in the wrong file."""
    defined = {name: defined_names(path) for name, path in MODULES.items()}
    wrong = []
    for where, source in code_files():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (module := absolute(node, where)) in MODULES:
                wrong += [f"{where}: from {module} import {a.name}" for a in node.names
                          if a.name not in defined[module] and f"{module}.{a.name}" not in MODULES]
    assert not wrong, "import each name from the module that defines it:\n" + "\n".join(wrong)
