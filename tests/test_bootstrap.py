"""The first cell of every notebook (clone and set up on Colab, find helpers/ elsewhere): one text in all ten,
and its set-up output reaches the reader line by line while the set-up runs (minutes on Colab), not at the end."""
import ast
import subprocess

import nbformat

from helpers import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))


def bootstrap(path) -> str:
    [cell] = [c for c in nbformat.read(path, as_version=4).cells if c.source.startswith("# Bootstrap")]
    return cell.source


def test_every_notebook_has_the_same_bootstrap_and_names_itself():
    """One text in all ten but the NOTEBOOK line, which hands colab_setup.sh the notebook's own number (it sets up
    only what that notebook needs)."""
    import re
    own = re.compile(r'^NOTEBOOK = "(\d\d)"', re.M)
    assert [own.search(bootstrap(p))[1] for p in NOTEBOOKS] == [p.name[:2] for p in NOTEBOOKS]
    assert len({own.sub('NOTEBOOK = "NN"', bootstrap(p)) for p in NOTEBOOKS}) == 1


def test_the_bootstrap_shows_each_line_of_the_setup_while_it_runs(tmp_path):
    """The command waits for a file that the cell's printing creates when the first line reaches it: a cell that
    printed only at the end would never create it, and the command gives up without its second line."""
    source = bootstrap(NOTEBOOKS[0])
    [sh] = [n for n in ast.parse(source.replace("%matplotlib inline", "")).body
            if isinstance(n, ast.FunctionDef) and n.name == "sh"]
    seen, flag = [], tmp_path / "first-line-shown"

    def shown(text, **_):   # the notebook's print, as the reader's cell output
        seen.append(text)
        if text.strip() == "first":
            flag.touch()
    space = {"subprocess": subprocess, "print": shown}
    exec(ast.get_source_segment(source, sh), space)   # noqa: S102 (the notebook's own function)
    space["sh"]("bash", "-c", f"echo first; for i in $(seq 300); do [ -e {flag} ] && break; sleep 0.1; done; "
                              f"[ -e {flag} ] && echo second")
    assert [t.strip() for t in seen] == ["first", "second"]
