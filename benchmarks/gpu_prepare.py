"""The prepare step of `python -m benchmarks.gpu` (run it alone to see a GPU machine's facts and build its ops):

    python -m benchmarks.gpu_prepare [--ext-dir DIR]    # facts, stale JIT locks removed, DeepSpeed's ops built
    PYTHONPATH=benchmarks/t4_emulation python -m benchmarks.gpu_prepare --t4-probe probe.json   # what a T4 lane sees

- TORCH_CUDA_ARCH_LIST set to the GPU's plain capability ("9.0"): some images set torch's suffixed form
  ("9.0a"), which DeepSpeed's JIT builder cannot read (helpers.preflight.arch_list_problem);
- stale JIT locks removed: torch's builder holds a file named `lock` open in the op's build folder while it
  builds, and a builder killed mid-build leaves it behind, where every later build of that op waits forever;
- the ops the notebooks load built once (OPS), so the lanes start from copies of the folder instead of each
  building them again, and each prints its seconds. On a one-GPU machine every multi-rank launch runs its ranks
  on the CPU (helpers.launch.child_env: CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR=cpu), where DeepSpeed's CPU
  accelerator hands out its own builders (accelerator/cpu_accelerator.py, ops/op_builder/cpu/): they are built
  in that environment (CPU_RANK_ENV), with the flags the ranks' builds will have;
- the machine's facts: GPU, capability, memory, CPU model and its bf16 flags, package versions.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from helpers import REPO_ROOT
from helpers.launch import kill_tree
from helpers.runtime import remove_stale_locks

# What the notebooks load, as DeepSpeed 0.19.8 builds it (each op's folder is named by the op alone, so a CUDA
# build and a CPU build of one op would rebuild each other in a shared folder):
# - CPUAdamBuilder (cpu_adam): DeepSpeedCPUAdam (05's offload, in the kernel on the GPU and in CPU ranks); the CUDA
#   accelerator hands out the CPU accelerator's builder for it (cuda_accelerator.py, "Host-side optimizers"), so
#   one build serves both;
# - AsyncIOBuilder (async_io, after pin_memory, which its load() builds first): 08's NVMe run, in 2 CPU ranks:
#   op_builder/cpu/async_io.py (CPUOpBuilder's flags, -laio -fopenmp), not the CUDA one (-lcudart, CUDA includes);
# - ShareMemCommBuilder (deepspeed_shm_comm): every CPU-rank launch (comm/torch.py build_shm_op, when the CPU
#   accelerator's ops probe compatible), in 04-10.
# Not FusedAdam: every config trains with torch's AdamW ("torch_adam": true), DeepSpeedCPUAdam where offloaded.
OPS = ("CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder")
CPU_RANK_ENV = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}   # helpers.launch.child_env's, on one GPU
BUILD = """
import sys, time
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder(sys.argv[1])
if builder is None or not builder.is_compatible(False):
    print("not buildable here (libaio missing?)" if builder else "no such op on this accelerator"); sys.exit(3)
start = time.perf_counter(); builder.load(verbose=False)
print(f"{type(builder).__module__} built in {time.perf_counter() - start:.0f} s")   # whose builder: the CPU's
"""


def plain_arch(capability: tuple) -> str:
    """TORCH_CUDA_ARCH_LIST's entry for a capability, in the form DeepSpeed reads: (9, 0) -> "9.0"."""
    return f"{capability[0]}.{capability[1]}"


def build_ops(ext_dir: Path, ops=OPS, cap: float = 300, env: dict | None = None) -> dict[str, str]:
    """Build each op in a process of its own, all at once (their build folders differ), in the CPU ranks'
    environment unless `env` says otherwise: {op: what happened}."""
    env = {**os.environ, **CPU_RANK_ENV, **(env or {}), "TORCH_EXTENSIONS_DIR": str(ext_dir),
           "MAX_JOBS": str(max(1, (os.cpu_count() or 2) // len(ops)))}

    def build(op):
        proc = subprocess.Popen([sys.executable, "-c", BUILD, op], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)   # kill_tree's group
        try:
            output, _ = proc.communicate(timeout=cap)
        except subprocess.TimeoutExpired:
            kill_tree(proc)   # ninja and the compilers too: left alone they compile on beside the lanes
            proc.communicate()
            return f"not built within {cap:.0f} s (each lane goes on from the objects built so far)"
        lines = output.strip().splitlines() or ["no output"]
        return lines[-1] if proc.returncode in (0, 3) else f"failed (exit {proc.returncode}): {lines[-1][:200]}"

    with ThreadPoolExecutor(len(ops)) as pool:
        return dict(zip(ops, pool.map(build, ops)))


def copy_ext_dir(source: Path, target: Path) -> None:
    """A lane's own copy of the prebuilt ops: a lane killed mid-build then leaves its lock in its own copy."""
    shutil.rmtree(target, ignore_errors=True)
    if source.is_dir():
        shutil.copytree(source, target, symlinks=True)
        remove_stale_locks(target)
    else:
        target.mkdir(parents=True)


def facts() -> dict[str, str]:
    """What the summary says of the machine."""
    import platform

    import psutil
    import torch
    from helpers.precision import CPU_BF16_FLAGS, cpu_flags, cpuinfo_field
    flags = cpu_flags()
    row = {"python": platform.python_version(), "torch": torch.__version__, "CUDA (torch)": str(torch.version.cuda),
           "CPU": f"{cpuinfo_field('model name') or platform.machine()}, {os.cpu_count()} cores, "
                  f"{psutil.virtual_memory().total / 1e9:.0f} GB",
           "CPU bf16/fp16 flags": " ".join(sorted(flags & {*CPU_BF16_FLAGS, "avx512f", "avx512_fp16", "amx_fp16",
                                                           "amx_tile", "avx2"})) or "none",
           "libaio": "yes" if Path("/usr/include/libaio.h").exists() or shutil.which("ldconfig") and
           "libaio" in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout else "no",
           "nvcc": shutil.which("nvcc") or "none"}
    for name in ("deepspeed", "transformers", "triton", "accelerate", "datasets", "nbclient"):
        try:
            row[name] = __import__(name).__version__
        except Exception as e:   # a missing or broken package is a fact to report, not a reason to stop
            row[name] = f"missing ({type(e).__name__})"
    try:
        from helpers.runtime import detect
        rt = detect()
        row["tutorial's precision"] = f"{rt.precision}: {rt.reason}"
    except Exception as e:
        row["tutorial's precision"] = f"unknown ({type(e).__name__}: {e})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        row |= {"GPU": props.name, "capability": f"sm_{props.major}{props.minor}",
                "GPU memory": f"{props.total_memory / 1e9:.1f} GB", "bf16 supported": str(torch.cuda.is_bf16_supported())}
    return row


def prepare(ext_dir: Path, cap: float = 60) -> dict:
    """Everything before the lanes: arch list, stale locks, the ops built, facts. The T4 jobs use the same ops:
    none of them is a CUDA op, so TORCH_CUDA_ARCH_LIST (7.5+PTX there) does not enter their builds."""
    import torch
    start = time.perf_counter()
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if capability:
        os.environ["TORCH_CUDA_ARCH_LIST"] = plain_arch(capability)
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    default_cache = Path.home() / ".cache" / "torch_extensions"
    stale = [str(p) for root in (ext_dir, default_cache) for p in remove_stale_locks(root)]
    built = build_ops(ext_dir, cap=cap - 5)
    return {"TORCH_CUDA_ARCH_LIST": arch, "stale locks removed": stale, "ops": built, "facts": facts(),
            "seconds": time.perf_counter() - start}


def t4_probe() -> dict:
    """What a process of a T4 emulation lane sees (run there: its sitecustomize applies): the capability, bf16,
    the tutorial's precision, and whether 16 GB (past a T4's memory) can be allocated. Empty where no GPU is."""
    import torch
    if not torch.cuda.is_available():
        return {}
    from helpers.runtime import detect
    rt = detect()
    row = {"capability": list(torch.cuda.get_device_capability()), "bf16 supported": torch.cuda.is_bf16_supported(),
           "name": torch.cuda.get_device_name(), "precision": rt.precision, "reason": rt.reason,
           "flash sdp": torch.backends.cuda.flash_sdp_enabled(), "cudnn sdp": torch.backends.cuda.cudnn_sdp_enabled(),
           "mem-efficient sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
           "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST")}
    try:
        torch.empty(16 * 10**9, dtype=torch.uint8, device="cuda")
        row["16 GB allocated"] = True
    except torch.OutOfMemoryError:
        row["16 GB allocated"] = False
    return row


def check_t4_probe(path: Path) -> list[str]:
    """Problems of a T4 lane's probe: any answer a T4 would not give."""
    import json
    seen = json.loads(Path(path).read_text())
    wanted = {"capability": [7, 5], "bf16 supported": False, "precision": "fp16", "flash sdp": False,
              "cudnn sdp": False, "mem-efficient sdp": True, "16 GB allocated": False}
    return [f"{key}: {seen.get(key)!r}, a T4 gives {value!r}" for key, value in wanted.items() if seen.get(key) != value]


def main(argv=None) -> None:
    import json
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ext-dir", type=Path, default=REPO_ROOT / "runs" / "gpu_work" / "torch_extensions")
    p.add_argument("--t4-probe", type=Path, metavar="JSON", help="only write what this process sees of the GPU "
                                                                  "(run in a T4 emulation lane) to JSON")
    a = p.parse_args(argv)
    if a.t4_probe:
        a.t4_probe.parent.mkdir(parents=True, exist_ok=True)
        a.t4_probe.write_text(json.dumps(t4_probe(), indent=2) + "\n")
        return
    print(json.dumps(prepare(a.ext_dir), indent=2))


if __name__ == "__main__":
    main()
