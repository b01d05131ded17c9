"""The notebooks' two nbval passes (tests/conftest.py) on a probe notebook: a stored output that holds in one
precision only passes the first pass and fails the second, on whichever precision this machine's rule picks."""
import subprocess
import sys

import nbformat
import pytest

from helpers.runtime import detect
from tests.passes import other_precision_emulated
from tests.repository import ROOT

# The probes count the second pass's items; where it is left out (emulated bf16, tests/passes.py) there is none.
needs_second_pass = pytest.mark.skipif(other_precision_emulated(), reason="no second pass: the other precision is "
                                       "bf16, which this CPU emulates (tests/passes.py)")


@needs_second_pass
def test_an_output_of_one_precision_fails_the_second_pass(tmp_path):
    rule = detect().precision
    cell = nbformat.v4.new_code_cell(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                                     "from helpers.runtime import detect\nprint(detect().precision)")
    cell.execution_count, cell.outputs = 1, [nbformat.v4.new_output("stream", name="stdout", text=f"{rule}\n")]
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), tmp_path / "probe.ipynb")
    run = run_probe(tmp_path / "probe.ipynb")
    other = "bf16" if rule == "fp32" else "fp32"
    failed = [line.split(" - ")[0] for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].endswith(f"Cell 0 ({other})"), run.stdout[-3000:]   # the second pass only
    assert f"'{rule}\\n' == '{other}\\n'" in run.stdout
    assert "1 failed, 5 passed" in run.stdout, run.stdout[-3000:]


@needs_second_pass
def test_a_cell_stored_with_two_stdout_outputs_passes_both_passes(tmp_path):
    """A kernel may send one cell's prints as two stream messages (a slow call between them: 03's resume check).
    nbval merges them in place in the stored cell; the second pass compares against a copy of it (CI failed here)."""
    cell = nbformat.v4.new_code_cell("print('one')\nprint('two')\nprecision = 'any'   # the word keeps it in the second pass")
    cell.execution_count = 1
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=t) for t in ("one\n", "two\n")]
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), tmp_path / "probe.ipynb")
    run = run_probe(tmp_path / "probe.ipynb")
    assert "6 passed" in run.stdout and "failed" not in run.stdout, run.stdout[-3000:]


@needs_second_pass
def test_a_notebook_that_never_reads_the_precision_runs_once(tmp_path):
    """No code cell names the precision or a helper that picks one (tests/passes.py): a second pass would repeat
    the first, so there is none. The same cell reading the precision gets its second pass."""
    probes = []
    for name, source in (("same", "print('same')"), ("reads", "print('same')\nrt.precision if False else None")):
        cell = nbformat.v4.new_code_cell(source)
        cell.execution_count, cell.outputs = 1, [nbformat.v4.new_output("stream", name="stdout", text="same\n")]
        nbformat.write(nbformat.v4.new_notebook(cells=[cell]), tmp_path / f"{name}.ipynb")
        probes.append(tmp_path / f"{name}.ipynb")
    run = run_probe(*probes)
    # same.ipynb: its cell between the repository snapshot and check (3); reads.ipynb: also the switch and the
    # cell again (5); test_nothing (1). A second pass of same.ipynb would make it 11.
    assert "9 passed" in run.stdout and "failed" not in run.stdout, run.stdout[-3000:]


def run_probe(*notebooks):
    """pytest on the probe notebooks from the repository root, with tests/conftest.py loaded (test_nothing)."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", f"--rootdir={ROOT}",
                           "-c", str(ROOT / "pyproject.toml"), *map(str, notebooks),
                           "tests/test_notebook_passes.py::test_nothing"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_nothing():
    """Collected beside the probe so that pytest loads tests/conftest.py, the two passes' home."""
