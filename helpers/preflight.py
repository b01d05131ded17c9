"""Before the first GPU step: can DeepSpeed build its CUDA ops here, and are the packages new enough?
(`python -m helpers.preflight`, run by colab_setup.sh; exit 1 on a problem.)

DeepSpeed JIT-compiles FusedAdam with the nvcc under CUDA_HOME, and its CUDA-version check runs only for
ahead-of-time builds, so an nvcc of another CUDA major than torch's fails later as a compiler error; torch
2.12+ compiles with -std=c++20, which nvcc has from CUDA 12. On a CPU it builds DeepSpeedCPUAdam instead.
"""
from __future__ import annotations

import os
import re
import sys
from importlib.metadata import PackageNotFoundError, version

# What the helpers need of the packages Colab keeps (its own torch, transformers, ...) and of the rest.
MINIMUM_VERSIONS = {
    "torch": "2.6",          # torch.compiler.set_stance, torch.nn.utils.get_total_norm
    "transformers": "4.56",  # from_pretrained(dtype=...) (earlier: torch_dtype=)
    "accelerate": "1.1",     # HF Trainer(deepspeed=...) with transformers 4.56+
    "datasets": "3.0",
    "ipywidgets": "7.7",
}
DEEPSPEED = "0.19.8"         # the facts the notebooks state were read from this version's source
NVCC_MIN_MAJOR = 12          # -std=c++20, which torch 2.12+ passes to nvcc


def release(text: str) -> tuple[int, ...]:
    """'2.13.0+cu126' -> (2, 13, 0), '1.15.0rc1' -> (1, 15, 0): the release numbers of a version (packaging's
    parse, as pip reads them), without a local build tag or a pre-release mark."""
    from packaging.version import Version
    return Version(text).release


def version_problems(installed: dict[str, str | None], minimum: dict[str, str] = MINIMUM_VERSIONS) -> list[str]:
    """One line per package that is missing or older than `minimum` ({name: installed version or None})."""
    problems = []
    for name, least in minimum.items():
        have = installed.get(name)
        if have is None:
            problems.append(f"{name} is not installed: pip install '{name}>={least}'")
        elif release(have) < release(least):
            problems.append(f"{name} {have} is older than {least}, which the helpers need: pip install -U '{name}>={least}'")
    return problems


def cuda_problem(torch_cuda: str | None, nvcc: tuple[int, int] | None) -> str | None:
    """Why DeepSpeed could not JIT-build a CUDA op with this nvcc for this torch, or None when it can."""
    if torch_cuda is None:
        return "torch is a CPU build: install a CUDA build of torch (Colab's own has one)"
    if nvcc is None:
        return ("no nvcc under CUDA_HOME: DeepSpeed compiles FusedAdam with it on first use; install the CUDA "
                f"toolkit {torch_cuda} (e.g. apt-get install cuda-toolkit-{torch_cuda.replace('.', '-')}) or set CUDA_HOME to one")
    want = release(torch_cuda)[0]
    if nvcc[0] != want:
        return (f"nvcc is CUDA {nvcc[0]}.{nvcc[1]} but torch was built for CUDA {torch_cuda}: DeepSpeed's JIT build of "
                f"FusedAdam needs the same major version; point CUDA_HOME at a CUDA {want}.x toolkit, or install the "
                f"torch build for CUDA {nvcc[0]}")
    if nvcc[0] < NVCC_MIN_MAJOR:
        return f"nvcc is CUDA {nvcc[0]}.{nvcc[1]}: torch 2.12+ compiles with -std=c++20, which needs nvcc {NVCC_MIN_MAJOR}+"
    return None


def installed_versions() -> dict[str, str | None]:
    found = {}
    for name in [*MINIMUM_VERSIONS, "deepspeed"]:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def nvcc_version() -> tuple[int, int] | None:
    """nvcc's (major, minor) as DeepSpeed reads it (CUDA_HOME/bin/nvcc -V), or None where there is none."""
    from deepspeed.ops.op_builder.builder import MissingCUDAException, installed_cuda_version
    try:
        return installed_cuda_version()
    except MissingCUDAException:
        return None


def adam_op_matches_torch(device: str) -> float:
    """Build DeepSpeed's Adam op for `device` (JIT, once: cached in ~/.cache/torch_extensions): FusedAdam on a
    GPU (the trainer's optimizer there), DeepSpeedCPUAdam on a CPU (ZeRO-Offload's, notebook 05). Take one step
    and return its largest difference from torch's AdamW taking the same step (~1e-7 when it works)."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    if device == "cuda":
        build = lambda p: FusedAdam([p], lr=1e-3, adam_w_mode=True, weight_decay=0.01)
    else:   # the same update; DeepSpeed spells the AdamW switch differently here
        build = lambda p: DeepSpeedCPUAdam([p], lr=1e-3, adamw_mode=True, weight_decay=0.01)
    torch.manual_seed(0)
    ours, theirs = (torch.randn(1024, device=device, requires_grad=True) for _ in range(2))
    with torch.no_grad():
        theirs.copy_(ours)
    grad = torch.randn(1024, device=device)
    for param, optimizer in ((ours, build(ours)), (theirs, torch.optim.AdamW([theirs], lr=1e-3, weight_decay=0.01))):
        param.grad = grad.clone()
        optimizer.step()
    return (ours - theirs).abs().max().item()


def arch_list_problem(arch_list: str | None) -> str | None:
    """Why DeepSpeed's JIT builder would fail on this TORCH_CUDA_ARCH_LIST, or None. It reads each entry as
    numbers (builder.py's compute_capability_args): torch's suffixed forms such as "9.0a" raise
    "invalid literal for int() with base 10: '0a'" at the first op it builds (seen on an H200 image)."""
    entries = (arch_list or "").replace(" ", ";").split(";")
    if all(re.fullmatch(r"\d+\.\d+(\+PTX)?", e.strip()) for e in entries if e.strip()):
        return None
    plain = ";".join(re.sub(r"(\d)[a-zA-Z]+", r"\1", e.strip()) for e in entries if e.strip())
    return (f"TORCH_CUDA_ARCH_LIST={arch_list!r}: DeepSpeed {DEEPSPEED} cannot read suffixed entries and fails "
            f"building FusedAdam; set TORCH_CUDA_ARCH_LIST='{plain}' (or unset it) before the first DeepSpeed op is built")


def report() -> list[dict]:
    """Every check as a row {check, ok, detail}: packages on any machine, CUDA and FusedAdam on a GPU."""
    import torch
    installed = installed_versions()
    rows = []
    for name, least in MINIMUM_VERSIONS.items():
        problem = version_problems({name: installed[name]}, {name: least})
        rows.append({"check": f"{name} >= {least}", "ok": not problem, "detail": problem[0] if problem else installed[name]})
    rows.append({"check": f"deepspeed == {DEEPSPEED}", "ok": installed["deepspeed"] == DEEPSPEED,
                 "detail": installed["deepspeed"] or "missing"})
    if not torch.cuda.is_available():
        gap = adam_op_matches_torch("cpu")
        return rows + [{"check": "DeepSpeedCPUAdam built, one step = torch AdamW's", "ok": gap < 1e-5,
                        "detail": f"max |Δ| {gap:.1e}"}]
    arch_problem = arch_list_problem(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    rows.append({"check": "TORCH_CUDA_ARCH_LIST readable by DeepSpeed", "ok": arch_problem is None,
                 "detail": arch_problem or (os.environ.get("TORCH_CUDA_ARCH_LIST") or "unset: the GPU's own")})
    nvcc = nvcc_version()
    problem = cuda_problem(torch.version.cuda, nvcc) or arch_problem
    rows.append({"check": "nvcc matches torch's CUDA", "ok": problem is None,
                 "detail": problem or f"nvcc {nvcc[0]}.{nvcc[1]}, torch built for CUDA {torch.version.cuda}"})
    if problem is None:
        gap = adam_op_matches_torch("cuda")
        rows.append({"check": "FusedAdam built, one step = torch AdamW's", "ok": gap < 1e-5, "detail": f"max |Δ| {gap:.1e}"})
    return rows


def main() -> int:
    rows = report()
    for row in rows:
        print(f"{'ok ' if row['ok'] else 'NO '} {row['check']}: {row['detail']}")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
