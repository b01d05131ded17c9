"""Notebook 06's AutoEP script, run as the notebook writes it, at whatever transformers this venv has: CI runs it at
the pin (5.23, whose output-capture registry clashes with DeepSpeed 0.19.8's AutoEP) and, in .ci/floors, at the
floor (5.3, a plain dict registry, where the old unguarded patch raised AttributeError before any rank started)."""
import json

import nbformat

from helpers import REPO_ROOT
from helpers.launch import rank_lines, run_script

NOTEBOOK = REPO_ROOT / "notebooks" / "06_advanced_features.ipynb"


def written_files(folder) -> dict[str, str]:
    """The notebook's AutoEP cells, executed as the notebook does: the config cell with RUN = folder, then each
    %%writefile cell's file written where the config cell named it. {variable: path}."""
    import os
    cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    [config_cell] = [s for s in cells if s.startswith("EP_CONFIG, EP_SCRIPT, EP_FIX")]
    names = {"RUN": folder, "os": os, "json": json, "print": lambda *a, **k: None}
    exec(config_cell, names)
    for source in cells:
        first, _, body = source.partition("\n")
        if first in ("%%writefile {EP_SCRIPT}", "%%writefile {EP_FIX}"):
            with open(names[first.split("{")[1].rstrip("}")], "w") as f:
                f.write(body)
    return {key: names[key] for key in ("EP_CONFIG", "EP_SCRIPT", "EP_FIX")}


def test_the_autoep_script_trains_at_this_transformers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the config cell names its files relative to the working directory
    files = written_files(tmp_path)
    code, output = run_script(files["EP_SCRIPT"], 2, files["EP_CONFIG"], timeout=300)
    assert code == 0, output[-3000:]
    lines = rank_lines(output)
    assert any("holds experts [0, 1] of 4" in line for line in lines), lines
    assert any("holds experts [2, 3] of 4" in line for line in lines), lines
    assert sum("step 20: loss" in line for line in lines) == 2, lines
