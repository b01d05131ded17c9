"""The small package behind the DeepSpeed tutorial notebooks: notebooks tell the story, helpers do the work."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent   # notebooks/, configs/ and runs/ live here


def with_repo_on_path(env: dict) -> dict:
    """`env` with the repository first on PYTHONPATH, so a child process (a rank, a measuring child)
    imports helpers from wherever it starts."""
    return {**env, "PYTHONPATH": ":".join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))}
