"""colab_setup.sh without Colab: its arguments, what it skips for a notebook that does not need it, and what it tells
the reader after pip ran (pip's resolver complaints, a package replaced under a kernel that had imported it). pip
itself is replaced by a stand-in that "upgrades" a fake old ipywidgets and prints a canned resolver block."""
import os
import subprocess
import sys

import pytest

from helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "colab_setup.sh"


def setup(*args, env=None):
    """Run the set-up; its output, stdout and stderr in the order printed (as the notebook cell shows them)."""
    done = subprocess.run(["bash", str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600, env={**os.environ, "PYTHON": sys.executable, **(env or {})})
    return done.returncode, done.stdout


@pytest.mark.parametrize("args, says", [(["99"], "there is no notebook 99"), (["five"], "usage:"),
                                        (["--imported"], "--imported needs a list")])
def test_a_wrong_argument_is_refused_before_anything_runs(args, says):
    code, out = setup(*args)
    assert code == 2 and says in out and "pip" not in out


RESOLVER = """\
ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. \
This behaviour is the source of the following dependency conflicts.
sentence-transformers 5.1.0 requires transformers<5.0.0,>=4.41.0, but you have transformers 5.23.0 which is incompatible.
gradio 5.1.0 requires huggingface-hub<1.0, but you have huggingface-hub 1.3.0 which is incompatible.
datasets 4.0.0 requires fsspec<=2025.3.0, but you have fsspec 2026.1.0 which is incompatible.
"""


@pytest.fixture
def colab_like(tmp_path):
    """A python whose ipywidgets reads as 7.0 (below the floor, so the set-up installs it) and whose `pip install`
    turns that into 8.1.9 and prints RESOLVER, touching nothing else."""
    site = tmp_path / "site"
    info = site / "ipywidgets-7.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ipywidgets\nVersion: 7.0\n")
    (info / "top_level.txt").write_text("ipywidgets\n")
    (tmp_path / "resolver.txt").write_text(RESOLVER)
    python = tmp_path / "python"
    python.write_text(f"""#!/usr/bin/env bash
if [ "$1 $2 $3" = "-m pip install" ]; then
    echo "pip $*" >> {tmp_path}/pip_calls
    mv {info} {site}/ipywidgets-8.1.9.dist-info
    sed -i 's/^Version: 7.0/Version: 8.1.9/' {site}/ipywidgets-8.1.9.dist-info/METADATA
    cat {tmp_path}/resolver.txt
    exit 0
fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    return tmp_path, {"PYTHON": str(python), "PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT)])}


def test_a_notebook_that_steps_no_cpu_adam_skips_its_build_and_libaio_and_pip_talks_in_one_line(colab_like):
    tmp_path, env = colab_like
    code, out = setup("2", "--imported", "os,sys,ipywidgets,IPython", env=env)
    assert "set-up for notebook 02" in out
    [call] = (tmp_path / "pip_calls").read_text().splitlines()
    assert " -q " in call and "ipywidgets==8.1.9" in call and " -c " in call   # quiet, under the constraints
    assert "ERROR: pip's dependency resolver" not in out   # its block is summed up instead:
    assert "conflicts for 2 of Colab's own packages (gradio, sentence-transformers)" in out and "harmless" in out
    assert "warning from pip: datasets 4.0.0 requires fsspec" in out   # a package the tutorial uses is shown whole
    assert "replaced: ipywidgets 7.0 -> 8.1.9" in out
    assert "--no-cpu-adam" in out and "DeepSpeedCPUAdam not built" in out and "libaio" not in out
    # the kernel had imported ipywidgets before pip replaced it: restart, and no "ready"
    assert code == 3, out
    assert "RESTART NEEDED: this kernel had imported ipywidgets before" in out and "Runtime > Restart session" in out
    assert "ready" not in out


def test_a_kernel_that_imported_nothing_replaced_is_ready_without_a_restart(colab_like):
    tmp_path, env = colab_like
    (tmp_path / "resolver.txt").write_text("")
    code, out = setup("04", "--imported", "os,sys,IPython", env=env)
    assert code == 0, out
    assert out.rstrip().endswith("ready") and "RESTART" not in out and "resolver" not in out
    assert "replaced: ipywidgets 7.0 -> 8.1.9" in out
