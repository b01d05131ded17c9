"""Before the first step: are the packages new enough, and what can this machine build?
(`python -m helpers.preflight`, run by colab_setup.sh; exit 1 only when a package is missing or too old.)

Each check is a row. A package row that fails is fatal: the notebooks would fail on it. The other rows are
informative: a failing one prints `warn` and its reason, and the set-up goes on. The notebooks train with
torch's AdamW (fused on a GPU) and JIT-build one DeepSpeed op, DeepSpeedCPUAdam (ZeRO-Offload, notebook 05),
with the C++ compiler. DeepSpeed's CUDA ops (FusedAdam, ...) are JIT-compiled with the nvcc under CUDA_HOME,
and its CUDA-version check runs only for ahead-of-time builds, so an nvcc of another CUDA major than torch's
would fail later as a compiler error (torch 2.12+ compiles with -std=c++20, which nvcc has from CUDA 12):
those rows say whether such a build would work here; `--fused-adam` also builds FusedAdam and takes a step.
"""
from __future__ import annotations

import os
import re
import sys
from importlib.metadata import PackageNotFoundError, version

# The oldest versions the tutorial runs with, as `.ci/floors` tests them (those below torch are installed at
# exactly these versions there, over the main venv's). colab_setup.sh upgrades a Colab package below its floor
# to the version requirements.txt pins; torch is Colab's own, always.
MINIMUM_VERSIONS = {
    "torch": "2.6",           # torch.compiler.set_stance, torch.nn.utils.get_total_norm
    "transformers": "5.3",    # transformers.integrations.deepspeed.initialize_weights_zero3 (helpers/programs/zero3.py;
                              # new in 5.3), transformers.initialization.no_init_weights and from_pretrained(dtype=) (5.0);
                              # utils.output_capturing, whose registry notebook 06's AutoEP fix reads (tests/test_autoep.py
                              # runs it here and in .ci/floors); 07's AutoTP and Ulysses scripts were run at 5.3 by hand
    "accelerate": "1.3",      # HF Trainer (helpers/hf_trainer.py): transformers 5.3's calls unwrap_model(keep_torch_compile=),
                              # new in accelerate 1.3 (transformers states 1.1, which fails there)
    "datasets": "3.0",        # Dataset.from_dict, train_test_split, load_dataset("text"), load_from_disk
                              # (helpers/data.py, own_text.py); tested offline, with huggingface_hub 1.x
    "ipywidgets": "7.7",      # the memory explorer (helpers/memory/widget.py) uses only what 7.7 and 8.x share
    "peft": "0.18",           # transformers 5's own floor for it: an older peft breaks on transformers 5's imports
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
    """Why DeepSpeed could not JIT-build a CUDA op (FusedAdam, ...) with this nvcc for this torch, or None when it
    can. The notebooks build none: a problem here is a warning."""
    if torch_cuda is None:
        return "torch is a CPU build: install a CUDA build of torch (Colab's own has one)"
    if nvcc is None:
        return ("no nvcc under CUDA_HOME: DeepSpeed compiles its CUDA ops (FusedAdam, ...) with it on first use; install the "
                f"CUDA toolkit {torch_cuda} (e.g. apt-get install cuda-toolkit-{torch_cuda.replace('.', '-')}) or set CUDA_HOME to one")
    want = release(torch_cuda)[0]
    if nvcc[0] != want:
        return (f"nvcc is CUDA {nvcc[0]}.{nvcc[1]} but torch was built for CUDA {torch_cuda}: DeepSpeed's JIT build of "
                f"a CUDA op (FusedAdam, ...) needs the same major version; point CUDA_HOME at a CUDA {want}.x toolkit, or "
                f"install the torch build for CUDA {nvcc[0]}")
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
    GPU (`python -m helpers.preflight --fused-adam`; the notebooks do not use it), DeepSpeedCPUAdam on a CPU
    (ZeRO-Offload's, notebook 05). Take one step and return its largest difference from torch's AdamW taking the
    same step (~1e-7 when it works)."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    if device == "cuda":
        build = lambda p: FusedAdam([p], lr=1e-3, adam_w_mode=True, weight_decay=0.01)
    else:   # the same update; DeepSpeed spells the AdamW switch differently here
        build = lambda p: DeepSpeedCPUAdam([p], lr=1e-3, adamw_mode=True, weight_decay=0.01)
    return _step_gap(device, build)


def fused_adamw_matches_torch() -> float:
    """torch's fused AdamW (the notebooks' optimizer on a GPU: no build of ours) takes one step on the GPU; its
    largest difference from the for-each AdamW taking the same step."""
    import torch
    return _step_gap("cuda", lambda p: torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True))


def _step_gap(device: str, build) -> float:
    import torch
    torch.manual_seed(0)
    ours, theirs = (torch.randn(1024, device=device, requires_grad=True) for _ in range(2))
    with torch.no_grad():
        theirs.copy_(ours)
    grad = torch.randn(1024, device=device)
    reference = lambda p: torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=False, fused=False)
    for param, optimizer in ((ours, build(ours)), (theirs, reference(theirs))):
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


def report(fused_adam: bool = False, cpu_adam: bool = True) -> list[dict]:
    """Every check as a row {check, ok, fatal, detail}: a failing `fatal` row (a package missing or too old, a
    GPU whose torch cannot step its AdamW) stops the set-up; a failing other one is a warning, its detail the
    reason. DeepSpeedCPUAdam's build on any machine (unless `cpu_adam` is False: colab_setup.sh skips it for the
    notebooks that never step it); on a GPU torch's fused AdamW, and whether DeepSpeed could JIT-build a CUDA op
    here (TORCH_CUDA_ARCH_LIST, nvcc), and with `fused_adam` FusedAdam's build and one step."""
    import torch
    installed = installed_versions()
    rows = []
    for name, least in MINIMUM_VERSIONS.items():
        problem = version_problems({name: installed[name]}, {name: least})
        rows.append({"check": f"{name} >= {least}", "ok": not problem, "fatal": True,
                     "detail": problem[0] if problem else installed[name]})
    rows.append({"check": f"deepspeed == {DEEPSPEED}", "ok": installed["deepspeed"] == DEEPSPEED, "fatal": True,
                 "detail": installed["deepspeed"] or "missing"})
    if cpu_adam:
        rows.append(_built("DeepSpeedCPUAdam built (ZeRO-Offload, notebook 05), one step = torch AdamW's",
                           lambda: adam_op_matches_torch("cpu"), fatal=False))
    if not torch.cuda.is_available():
        return rows
    rows.append(_built("torch's fused AdamW on the GPU (the notebooks' optimizer), one step = torch AdamW's",
                       fused_adamw_matches_torch, fatal=True))
    arch_problem = arch_list_problem(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    rows.append({"check": "TORCH_CUDA_ARCH_LIST readable by DeepSpeed (its CUDA ops only)", "ok": arch_problem is None,
                 "fatal": False, "detail": arch_problem or (os.environ.get("TORCH_CUDA_ARCH_LIST") or "unset: the GPU's own")})
    nvcc = nvcc_version()
    problem = cuda_problem(torch.version.cuda, nvcc)
    rows.append({"check": "nvcc matches torch's CUDA (DeepSpeed's CUDA ops only)", "ok": problem is None, "fatal": False,
                 "detail": problem or f"nvcc {nvcc[0]}.{nvcc[1]}, torch built for CUDA {torch.version.cuda}"})
    if fused_adam:
        if problem or arch_problem:
            rows.append({"check": "FusedAdam built, one step = torch AdamW's", "ok": False, "fatal": False,
                         "detail": "not tried: see the rows above"})
        else:
            rows.append(_built("FusedAdam built, one step = torch AdamW's", lambda: adam_op_matches_torch("cuda"),
                               fatal=False))
    return rows


def _built(check: str, step_gap, fatal: bool) -> dict:
    """A row for a build-and-step check: ok when one step lands within 1e-5 of torch's AdamW; a build or step that
    raises is a failed row whose detail is the error's last line."""
    try:
        gap = step_gap()
    except Exception as error:   # a compiler or loader error: its message is the reason
        lines = str(error).strip().splitlines() or [""]
        return {"check": check, "ok": False, "fatal": fatal, "detail": f"{type(error).__name__}: {lines[-1]}"}
    return {"check": check, "ok": gap < 1e-5, "fatal": fatal, "detail": f"max |Δ| {gap:.1e}"}


def verdict(row: dict) -> str:
    return "ok  " if row["ok"] else "NO  " if row["fatal"] else "warn"


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fused-adam", action="store_true", help="on a GPU, also JIT-build DeepSpeed's FusedAdam "
                        "and take one step with it (a minute or more; the notebooks do not need it)")
    parser.add_argument("--no-cpu-adam", action="store_true", help="skip DeepSpeedCPUAdam's build and step (a minute "
                        "or two the first time on 2 cores; a notebook that steps it builds it on first use)")
    args = parser.parse_args(argv)
    rows = report(fused_adam=args.fused_adam, cpu_adam=not args.no_cpu_adam)
    for row in rows:
        print(f"{verdict(row)} {row['check']}: {row['detail']}")
    if args.no_cpu_adam:
        print("preflight: DeepSpeedCPUAdam not built (--no-cpu-adam): a notebook that steps it builds it on first use")
    fatal = [row for row in rows if row["fatal"] and not row["ok"]]
    warned = [row for row in rows if not row["fatal"] and not row["ok"]]
    if warned:
        print(f"preflight: {len(warned)} warning(s) (warn): the notebooks run without them; the line says what "
              "would fail and how to fix it")
    if fatal:
        print(f"preflight: {len(fatal)} problem(s) (NO): the notebooks would fail; the line says what to install or change")
    return 1 if fatal else 0


if __name__ == "__main__":
    sys.exit(main())
