"""Wheels for a borrowed GPU machine that reaches no package registry, built here (Python 3.12, x86-64 Linux):

    .venv/bin/python -m benchmarks.gpu_wheels                 # -> runs/gpu_wheels/*.whl, its size, the install line
    .venv/bin/python -m benchmarks.gpu_wheels --out DIR

The machine's image (torch 2.11, transformers, accelerate, numpy, pandas, pyarrow, ...) lacks what the notebooks
and `python -m benchmarks.gpu` need: DeepSpeed, datasets, ipywidgets, and nbclient/nbformat/ipykernel to run
notebooks (requirements.txt's pins of each, less IMAGE_HAS and NOT_CARRIED).
pip resolves those for the machine's platform here (metadata only), every package the image already holds is
dropped (IMAGE_HAS), and the rest is downloaded as binary wheels; DeepSpeed has only a source release, so its
wheel is built here (pure Python: its ops are JIT-built on the GPU by `python -m benchmarks.gpu`'s prepare step).
Fails if the folder exceeds LIMIT_MIB: a device call carries at most 64 MiB with the working tree.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from helpers import REPO_ROOT

LIMIT_MIB = 60
NOT_CARRIED = {"nbval"}   # a pytest plugin: the GPU run executes the notebooks with nbclient, not under pytest
# What DeepSpeed needs at import (its setup.py's requirements, less torch): resolved with the rest, since
# pip cannot resolve an sdist for another platform without building it.
DEEPSPEED_NEEDS = ["hjson", "msgpack", "ninja", "numpy", "packaging>=20.0", "psutil", "py-cpuinfo", "pydantic>=2.0.0",
                   "tqdm", "einops", "nvidia-ml-py"]
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
            *[a for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
              for a in ("--platform", tag)]]
# The packages of the GPU machine's image ('cuda', as its maintainers listed them on 2026-11-17), those the
# resolution could pull in: carrying them again would only risk a second version of each.
IMAGE_HAS = set("""accelerate aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer
click cloudpickle colorama contourpy cycler einops filelock fonttools frozenlist fsspec h11 hf-xet httpcore httpx
huggingface-hub idna jinja2 kiwisolver markupsafe matplotlib msgpack multidict networkx ninja numpy nvidia-ml-py
packaging pandas pillow pip propcache protobuf psutil pyarrow py-cpuinfo pygments pyparsing python-dateutil pyyaml
regex requests rich safetensors setuptools shellingham six sympy tokenizers torch tqdm transformers triton typer
typing-extensions urllib3 wheel xxhash yarl zipp tensorboard peft pytest hypothesis""".split())


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(wanted: list[str]) -> dict[str, str]:
    """{name: version} pip would install for the GPU machine's platform (a dry run: metadata, no wheels)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--target", str(Path(tmp) / "target"), *PLATFORM, "--report", str(report), *wanted], check=True)
        items = json.loads(report.read_text())["install"]
    return {normalized(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def missing_on_image(resolved: dict[str, str]) -> list[str]:
    return sorted(f"{name}=={version}" for name, version in resolved.items() if name not in IMAGE_HAS)


def wanted() -> list[str]:
    """requirements.txt's pins of what the image lacks (ipywidgets too: notebook 01's preflight checks it, and
    notebooks 04 and 05 build the memory explorer with it)."""
    lines = (REPO_ROOT / "requirements.txt").read_text().splitlines()
    pins = [line.split("#")[0].strip() for line in lines if "==" in line.split("#")[0]]
    return [pin for pin in pins if normalized(pin.split("==")[0]) not in IMAGE_HAS | NOT_CARRIED]


def build(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):   # one version of each: two stop the whole install there
        old.unlink()
    deepspeed = next(w for w in wanted() if w.startswith("deepspeed=="))
    pins = missing_on_image(resolve([w for w in wanted() if w != deepspeed] + DEEPSPEED_NEEDS))
    print("to carry:", " ".join(pins), flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *PLATFORM, "-d", str(out), *pins],
                   check=True)
    # --no-build-isolation: DeepSpeed's setup.py imports torch, which this venv has (an isolated build would fetch
    # torch again); DS_BUILD_OPS unset builds no op, so the wheel is pure Python and fits any torch.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out),
                    deepspeed], check=True)
    return sorted(out.glob("*.whl"))


def install_command(folder: str) -> str:
    """The line that installs them on the machine (it holds root's python3; --no-deps: IMAGE_HAS is there)."""
    return (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "
            f"{folder}/*.whl && export PYTHONPATH=/tmp/site")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gpu_wheels")
    a = p.parse_args(argv)
    wheels = build(a.out)
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"{len(wheels)} wheels, {mib:.1f} MiB in {a.out} (limit {LIMIT_MIB} MiB)")
    folder = a.out.relative_to(REPO_ROOT) if a.out.is_relative_to(REPO_ROOT) else a.out
    print(f"carry {folder} and run there first:\n  {install_command(str(folder))}")
    if mib > LIMIT_MIB:
        print(f"too large: {mib:.1f} MiB > {LIMIT_MIB} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
