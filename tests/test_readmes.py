"""The front page and the pages it links stay true to the repository: every relative link reaches a file or
folder that exists (and, with `#anchor`, a heading of that page), every module a command in a page runs with
`python -m` (or a launcher's `-m` / `--module`) exists, every notebook has its Colab badge, and README.md stays a
front page a newcomer reads in two minutes."""
from __future__ import annotations

import importlib.machinery
import re
from pathlib import Path

import pytest

from helpers import REPO_ROOT

FRONT_PAGE = REPO_ROOT / "README.md"
MAX_FRONT_PAGE_LINES = 150
PAGES = [FRONT_PAGE, *sorted(p for folder in ("notebooks", "helpers", "benchmarks", "tests")
                             for p in (REPO_ROOT / folder).rglob("*.md")
                             if "measured" not in p.relative_to(REPO_ROOT).parts)]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(r"(?:\bpython3?\s+-m|\s-m|--module)\s+([A-Za-z_][\w.]*)")
BADGE = "https://colab.research.google.com/github/deepspeed-tutorial/deepspeed-llm-tutorial/blob/main/"


def ids(pages):
    return [str(p.relative_to(REPO_ROOT)) for p in pages]


def headings(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, markup and punctuation dropped, spaces to hyphens."""
    anchors, seen = set(), {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def module_exists(name: str) -> bool:
    """Found on sys.path without importing it (a package's __init__ would run DeepSpeed's start-up)."""
    top, *rest = name.split(".")
    spec = importlib.machinery.PathFinder.find_spec(top)   # sys.path only: no import hook runs
    if spec is None:
        return False
    places = [Path(p) for p in (spec.submodule_search_locations or [])]
    for i, part in enumerate(rest):
        last = i == len(rest) - 1
        found = [p / part for p in places if (p / part).is_dir()]
        if last and any((p / f"{part}.py").is_file() or (p / part / "__init__.py").is_file() for p in places):
            return True
        if not found:
            return False
        places = found
    return not rest or bool(places)


def commands(page: Path) -> list[str]:
    """The code a page shows: fenced blocks, and `inline code` that runs python."""
    text = page.read_text()
    inline = [span for span in INLINE_CODE.findall(FENCE.sub("", text)) if "python" in span]
    return FENCE.findall(text) + inline


def test_the_pages_are_found():
    names = set(ids(PAGES))
    assert {"README.md", "notebooks/README.md", "notebooks/troubleshooting.md", "helpers/README.md",
            "helpers/programs/README.md", "benchmarks/README.md", "tests/README.md"} <= names, names


def test_the_front_page_is_short():
    lines = len(FRONT_PAGE.read_text().splitlines())
    assert lines <= MAX_FRONT_PAGE_LINES, f"README.md has {lines} lines: move detail to the pages it links"


@pytest.mark.parametrize("page", PAGES, ids=ids(PAGES))
def test_every_relative_link_reaches_a_file_and_a_heading(page):
    text = INLINE_CODE.sub("", FENCE.sub("", page.read_text()))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):   # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {file.relative_to(REPO_ROOT) if file.is_relative_to(REPO_ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in headings(file):
            broken.append(f"{target}: no heading with that anchor in {file.relative_to(REPO_ROOT)}")
    assert not broken, broken


@pytest.mark.parametrize("page", PAGES, ids=ids(PAGES))
def test_every_module_a_command_runs_exists(page):
    named = {m for block in commands(page) for m in MODULE.findall(block)}
    assert all(module_exists(m) for m in named), sorted(m for m in named if not module_exists(m))


def test_every_notebook_has_its_colab_badge_on_the_front_page():
    text = FRONT_PAGE.read_text()
    badged = re.findall(re.escape(BADGE) + r"(\S+?\.ipynb)\)", text)
    notebooks = [str(p.relative_to(REPO_ROOT)) for p in sorted((REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))]
    assert badged == notebooks


def test_the_checks_catch_what_they_are_for(tmp_path):
    """A missing file, a missing heading and a missing module are found (the tests above would pass on nothing)."""
    page = tmp_path / "page.md"
    page.write_text("# A heading, with `code`\n\n[ok](#a-heading-with-code) [gone](#nope) [file](missing.md)\n\n"
                    "```bash\npython -m helpers.run_notebooks\npython -m helpers.no_such_module\n```\n")
    assert headings(page) == {"a-heading-with-code"}
    assert LINK.findall(page.read_text()) == ["#a-heading-with-code", "#nope", "missing.md"]
    assert module_exists("helpers.run_notebooks") and module_exists("helpers.programs.train")
    assert module_exists("deepspeed.checkpoint.ds_to_universal") and module_exists("pytest")
    assert not module_exists("helpers.no_such_module") and not module_exists("no_such_package")
    assert {m for b in commands(page) for m in MODULE.findall(b)} == {"helpers.run_notebooks", "helpers.no_such_module"}

