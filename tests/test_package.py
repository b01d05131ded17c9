"""`pip install .` gives a working package: installed into a fresh venv, every module of helpers imports from
there (not from the checkout). The venv sees the main venv's packages through a .pth file, as .ci/floors does, so
nothing is downloaded; the source is copied first, because setuptools writes its egg-info next to the source."""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.repository import ROOT


def test_pip_install_dot_gives_every_module(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT / "helpers", source / "helpers", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", source)
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "zz_main_venv.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the checkout must not be importable
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", str(source)], check=True, env=env, cwd=tmp_path)
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for p in (ROOT / "helpers").rglob("*.py"))
    code = ("import importlib, helpers\n"
            f"assert helpers.__file__.startswith({site!r}), helpers.__file__\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(len(" + repr(modules) + "))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == str(len(modules))   # DeepSpeed may log to stdout first
