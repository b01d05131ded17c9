"""Wheels for a borrowed GPU machine that reaches no package registry, built here (Python 3.12, x86-64 Linux):

    .venv/bin/python -m benchmarks.gpu_wheels                 # -> runs/gpu_wheels/*.whl, each size, the install line
    .venv/bin/python -m benchmarks.gpu_wheels --out DIR

Chosen by version, against requirements.txt's pins: a pin is carried unless the image holds that very version
(IMAGE_VERSIONS, as read there) or the image's own must stay (IMAGE_KEEPS); pip resolves the carried pins for the
machine's platform here (metadata only), and each package of that resolution is carried too unless the image
holds it at the resolved version, or at a version never read there (those, and every kept package, are checked
on the machine: installed_check(), the first thing `python -m benchmarks.gpu` records). DeepSpeed has only a
source release, so its wheel is built here (pure Python: its ops are JIT-built on the GPU by the prepare step).
Fails if the folder exceeds LIMIT_MIB: a device call carries at most 64 MiB with the working tree (~4 MiB).
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
NOT_CARRIED = {"nbval", "pytest", "hypothesis"}   # test tools: the GPU run executes the notebooks with nbclient
# Their requirements pull torch into a resolution (pip would fetch torch's metadata and CUDA wheels): carried as
# pinned without one, their requirements checked on the machine.
NO_RESOLVE = {"peft", "accelerate"}
# What DeepSpeed needs at import (its setup.py's requirements, less torch): resolved with the rest, since
# pip cannot resolve an sdist for another platform without building it.
DEEPSPEED_NEEDS = ["hjson", "msgpack", "ninja", "numpy", "packaging>=20.0", "psutil", "py-cpuinfo", "pydantic>=2.0.0",
                   "tqdm", "einops", "nvidia-ml-py"]
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
            *[a for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
              for a in ("--platform", tag)]]
# The packages of the GPU machine's image ('cuda', as its maintainers listed them on 2026-11-17), those the
# resolution could pull in.
IMAGE_HAS = set("""accelerate aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer
click cloudpickle colorama contourpy cycler einops filelock fonttools frozenlist fsspec h11 hf-xet httpcore httpx
huggingface-hub idna jinja2 kiwisolver markupsafe matplotlib msgpack multidict networkx ninja numpy nvidia-ml-py
packaging pandas pillow pip propcache protobuf psutil pyarrow py-cpuinfo pygments pyparsing python-dateutil pyyaml
regex requests rich safetensors setuptools shellingham six sympy tokenizers torch tqdm transformers triton typer
typing-extensions urllib3 wheel xxhash yarl zipp tensorboard peft pytest hypothesis markdown-it-py mdurl""".split())
# Their versions where a session read them there (the device tool's KINDS.md, 2026-11); the rest of IMAGE_HAS was
# never read: installed_check() reads it on the machine.
IMAGE_VERSIONS = {"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
                  "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0"}
# Never carried, whatever the pin: torch and triton are the image's CUDA builds, numpy the ABI its compiled packages
# were built against; pyarrow (~42 MiB), pandas (~12), matplotlib (~9) and tensorboard (~6) would crowd the 64 MiB
# carry, and the tutorial's use of them holds across versions: checked there against the floors and requirements.
IMAGE_KEEPS = {"torch", "triton", "numpy", "pyarrow", "pandas", "matplotlib", "tensorboard"}


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


def pins() -> dict[str, str]:
    """requirements.txt's pins: {normalized name: version}."""
    lines = (REPO_ROOT / "requirements.txt").read_text().splitlines()
    pairs = [line.split("#")[0].strip().split("==") for line in lines if "==" in line.split("#")[0]]
    return {normalized(name): version.strip() for name, version in pairs}


def wanted() -> list[str]:
    """The pins to carry: those the image lacks or holds at another or an unread version, less NOT_CARRIED and
    IMAGE_KEEPS (ipywidgets is one: notebook 01's preflight checks it, 04 and 05 build the memory explorer)."""
    return [f"{name}=={version}" for name, version in pins().items()
            if name not in NOT_CARRIED | IMAGE_KEEPS and IMAGE_VERSIONS.get(name) != version]


def to_carry(resolved: dict[str, str], pinned: set[str]) -> list[str]:
    """Of a resolution, what to carry: every pin wanted(), and each other package the image lacks or holds at a
    version read there that is not the resolved one (huggingface-hub 1.33 where datasets needs 2.x, say)."""
    def carried(name, version):
        if name in pinned or name not in IMAGE_HAS:
            return True
        return name not in IMAGE_KEEPS and IMAGE_VERSIONS.get(name, version) != version
    return sorted(f"{name}=={version}" for name, version in resolved.items() if carried(name, version))


def build(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):   # one version of each: two stop the whole install there
        old.unlink()
    want = wanted()
    deepspeed = next(w for w in want if w.startswith("deepspeed=="))
    unresolved = [w for w in want if w.split("==")[0] in NO_RESOLVE]
    resolvable = [w for w in want if w != deepspeed and w not in unresolved]
    pinned = {w.split("==")[0] for w in want}
    carry = to_carry(resolve(resolvable + DEEPSPEED_NEEDS), pinned) + unresolved
    print("to carry:", " ".join(carry), flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *PLATFORM, "-d", str(out), *carry],
                   check=True)
    # --no-build-isolation: DeepSpeed's setup.py imports torch, which this venv has (an isolated build would fetch
    # torch again); DS_BUILD_OPS unset builds no op, so the wheel is pure Python and fits any torch.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out),
                    deepspeed], check=True)
    return sorted(out.glob("*.whl"))


def installed_check() -> dict:
    """On the machine (carried wheels on PYTHONPATH): each pin's installed version, where it comes from, its pin
    and helpers.preflight's floor; problems: a floor not met, a tutorial package missing, or a requirement of an
    installed pinned package (datasets' fsspec and pyarrow, transformers' tokenizers, ...) that what is installed
    does not meet."""
    import os
    from importlib import metadata

    from helpers.preflight import DEEPSPEED, MINIMUM_VERSIONS, version_problems
    carried_dirs = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    rows, installed = {}, {}
    for name, pin in pins().items():
        if name in NOT_CARRIED:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            rows[name] = {"pin": pin, "installed": None}
            continue
        installed[name] = dist.version
        where = str(dist.locate_file(""))
        rows[name] = {"pin": pin, "installed": dist.version, "floor": MINIMUM_VERSIONS.get(name),
                      "from": "carried" if any(where.startswith(d) for d in carried_dirs) else "image"}
    problems = version_problems(installed, {**MINIMUM_VERSIONS, "deepspeed": DEEPSPEED})
    problems += [f"{name} is not installed (pinned {row['pin']})" for name, row in rows.items()
                 if row["installed"] is None and name not in MINIMUM_VERSIONS and name != "deepspeed"]
    for name in installed:
        problems += unmet_requirements(name)
    return {"packages": rows, "problems": problems}


def unmet_requirements(name: str) -> list[str]:
    """The requirements of installed package `name` (no extras) that the installed packages do not meet."""
    from importlib import metadata

    from packaging.requirements import Requirement
    dist, problems = metadata.distribution(name), []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} {dist.version} needs {req}: not installed")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{name} {dist.version} needs {req}: {have} installed")
    return problems


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
    for w in sorted(wheels, key=lambda w: w.stat().st_size, reverse=True):
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
