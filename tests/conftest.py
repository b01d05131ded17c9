"""Shared test set-up, and how the notebooks are tested.

nbval runs each notebook's code cells as test items and compares every output not tagged
`nbval-ignore-output` with the stored one. Here every notebook runs twice in the same kernel
(`--notebook-passes 2`, the default): first in the precision the rule picks, then, after a cell that sets
TUTORIAL_PRECISION to the other one (fp32 <-> bf16), again. The second pass is what a reader does who
changes the precision and presses Run All again, against the state the first pass left behind (a live
process group, checkpoints on disk, open engines); its compared outputs must be the stored ones too, so a
sentence or figure that holds in one precision only fails here, on any machine. It stops where the ↻ sections
that tests/test_notebook_sections.py runs after a restart, in that other precision, begin (tests/passes.py):
their checks hold there, and running them once more cost minutes of CI. Around the two passes the
notebook must create or delete no file in the repository (everything goes to $TUTORIAL_RUN_DIR, a
temporary folder unless you set one). `--notebook-passes 1` runs each notebook once, as plain nbval does.
"""
import copy
import os
import tempfile
import time
from collections import defaultdict

import nbformat
import pytest

from tests.passes import other_precision, other_precision_emulated, second_pass_cut
from tests.repository import repo_files

DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def pytest_addoption(parser):
    parser.addoption("--notebook-passes", type=int, choices=(1, 2), default=2,
                     help="run each notebook once, or twice in one kernel (default): the second time in the precision "
                          "the rule did not pick; outputs are compared with the stored ones every time")


def pytest_configure(config):
    # Kernels and rank programs inherit it: no notebook run writes inside the checkout.
    os.environ.setdefault("TUTORIAL_RUN_DIR", tempfile.mkdtemp(prefix="tutorial-runs-"))
    # A DeepSpeed op build killed in an earlier run (a Ctrl-C, CI's time limit) must not stall this one.
    from torch.utils.cpp_extension import get_default_build_root
    from helpers.runtime import remove_stale_locks
    for lock in remove_stale_locks(get_default_build_root()):
        print(f"removed a stale JIT build lock no process holds: {lock}")
    config.pluginmanager.register(Timeline(config), "timeline")


class Timeline:
    """CI's log reads as a timeline: each file's line says when the file started ("tests/x.py [312 s] ...."),
    so a run cut off by CI's time limit still shows where the minutes went. A plugin, not a hook of this
    conftest: those see only the items under tests/, not the notebooks'."""

    def __init__(self, config):
        self.config, self.started, self.file = config, time.monotonic(), None

    @pytest.hookimpl(trylast=True)   # after the terminal reporter has written the file's name
    def pytest_runtest_logstart(self, nodeid, location):
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if location[0] != self.file and reporter is not None and reporter.verbosity <= 0:   # -v: a line per test
            self.file = location[0]
            reporter.write(f"[{time.monotonic() - self.started:.0f} s] ")


def pytest_collection_modifyitems(config, items):
    from nbval.plugin import IPyNbCell
    passes = config.getoption("--notebook-passes")
    arranged, notebook = [], []
    for item in items + [None]:   # None: flush the last notebook
        if isinstance(item, IPyNbCell) and (not notebook or notebook[0].parent is item.parent):
            notebook.append(item)
            continue
        if notebook:
            arranged += notebook_items(notebook, passes)
            notebook = []
        if isinstance(item, IPyNbCell):
            notebook.append(item)
        elif item is not None:
            arranged.append(item)
    items[:] = arranged


def notebook_items(cells: list, passes: int) -> list:
    """A notebook's cell items, run `passes` times in its kernel (the second time in the other precision, up
    to the sections the restart test runs), between a snapshot of the repository's files and the check that the runs left them as they were."""
    from nbval.plugin import IPyNbCell
    parent = cells[0].parent
    again = []
    ids = {c.id for c in nbformat.read(parent.path, as_version=4).cells[:second_pass_cut(parent.path)]}
    # No ids: no cell reads the precision. Emulated: bf16 without the CPU's bf16 instructions (tests/passes.py).
    if passes == 2 and ids and not other_precision_emulated():
        other = other_precision()
        switch = nbformat.v4.new_code_cell(f"import os\nos.environ['TUTORIAL_PRECISION'] = '{other}'\n")
        again = [IPyNbCell.from_parent(parent, name=f"TUTORIAL_PRECISION={other}", cell_num=-1, cell=switch,
                                       options=defaultdict(bool, check=False))]
        # A copy of each cell: nbval's coalesce_streams merges a cell's stdout outputs into the first one in place,
        # so after the first pass a cell stored with two stdout outputs would be compared with its second one twice.
        again += [IPyNbCell.from_parent(parent, name=f"{c.name} ({other})", cell_num=c.cell_num,
                                        cell=copy.deepcopy(c.cell), options=c.options)
                  for c in cells if c.cell.get("id") in ids]
    return [RepositorySnapshot.from_parent(parent, name="repository files before"), *cells, *again,
            RepositoryUnchanged.from_parent(parent, name="repository files after")]


SNAPSHOT = pytest.StashKey[set]()


class RepositorySnapshot(pytest.Item):
    def runtest(self):
        self.parent.stash[SNAPSHOT] = repo_files()

    def reportinfo(self):
        return self.path, None, f"{self.parent.name}: {self.name}"


class RepositoryUnchanged(pytest.Item):
    """New or deleted files only: edits you make while the tests run are yours."""

    def runtest(self):
        changed = sorted(self.parent.stash[SNAPSHOT] ^ repo_files())
        assert not changed, f"the notebook created or deleted files in the repository, not under $TUTORIAL_RUN_DIR: {changed}"

    def reportinfo(self):
        return self.path, None, f"{self.parent.name}: {self.name}"


@pytest.fixture(autouse=True, scope="module")
def restore_distributed_env():
    """Tests that build an engine set RANK/MASTER_PORT/... in this process. Put them back afterwards:
    notebook kernels started later by nbval inherit the environment, and would try to bind a port
    this process already holds."""
    saved = {k: os.environ.get(k) for k in DISTRIBUTED_VARS}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_terminal_summary(terminalreporter):
    """Where CI's time goes, per test file and notebook (its budget: 40 minutes on a quiet 2-core box). Read
    from the terminal's own reports: a hook here would see only the items under tests/, not the notebooks."""
    seconds = defaultdict(float)   # file -> seconds of its set-ups, calls and tear-downs
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                seconds[report.nodeid.split("::")[0]] += report.duration
    if not seconds:
        return
    terminalreporter.section("seconds per test file")
    for path, total in sorted(seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{total:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(seconds.values()):8.1f}  in all")
