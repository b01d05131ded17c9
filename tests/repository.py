"""The files of the checkout, for the tests that check a notebook run wrote nothing into it."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Python's bytecode cache is the one thing an import may write next to the code.
NOT_OURS = {".git", ".venv", ".venv-floors", "__pycache__", ".pytest_cache", ".ipynb_checkpoints"}


def repo_files() -> set[str]:
    """Every file in the checkout, outside NOT_OURS."""
    files = set()
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in NOT_OURS]
        files |= {str(Path(folder, name).relative_to(ROOT)) for name in names}
    return files
