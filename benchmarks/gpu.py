"""Everything here that only a CUDA GPU can prove, in one device command of at most BUDGET_S seconds, the wheels'
install included:

    python -m benchmarks.gpu_wheels               # here, once: the wheels the GPU machine lacks (runs/gpu_wheels)
    python -m benchmarks.gpu --dry-run --gpu H100 # the plan: install, prepare, the lanes, caps, threads, the total
    T0=$(date +%s.%N); python3 -m pip install ... && python3 -m benchmarks.gpu --out $OUT --started $T0   # there
    python -m benchmarks.gpu --work /tmp/gpu_work # where the executed notebooks and logs go (default runs/gpu_work)

1. the packages: every requirements.txt pin's installed version against its pin and helpers.preflight's floors,
   and every tutorial package's own requirements (datasets' fsspec and pyarrow, ...) against what is installed;
2. prepare (benchmarks.gpu_prepare): TORCH_CUDA_ARCH_LIST set to the GPU's plain capability, stale JIT locks
   removed, the CPU ops the notebooks' CPU ranks load built once, the machine's facts;
3. the notebook phase: LANES lanes take jobs from one queue, each job a process with its own run folder: all ten
   notebooks in the GPU's own precision, every failing cell recorded (not only the first); notebooks 01, 03, 05
   and 06 again in T4 emulation (fp16 forced, capability (7, 5), no bf16, 15 GB, no flash or cuDNN attention:
   benchmarks/t4_emulation/sitecustomize.py) after a probe of it; fp16 with dynamic loss scaling started at 2**32
   (the first steps overflow: skipped, the scale moves, the loss falls) and bf16 (sm_80 or newer);
4. benchmarks.gpu_benchmark (GPT-2 124M, sequence 1024; the plain loop, the trainer at ZeRO 0 and 2 and HF
   Trainer, eager and compiled, interleaved block by block in one process), alone on the GPU, until the deadline.

The plan and its numbers are benchmarks.gpu_plan's. Every result goes into --out as soon as it exists: the
summary after every part, the benchmark's JSON and table after every phase of it. Without a CUDA GPU (and
without --dry-run) it says so and exits 0.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from helpers import REPO_ROOT
from benchmarks.gpu_plan import dry_run, plan


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gpu", help="the results (at most 8 files)")
    p.add_argument("--work", type=Path, default=REPO_ROOT / "runs" / "gpu_work",
                   help="executed notebooks, logs, run folders, built ops")
    p.add_argument("--started", type=float, default=None,
                   help="the device command's start (seconds since the epoch, `date +%%s.%%N` before the install): "
                        "the deadline counts from it; default: now, less the planned install time")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its caps; run nothing")
    p.add_argument("--gpu", default="H200", help="with --dry-run: the GPU to plan for (a helpers.hardware.GPUS "
                                                 "name or its start: H100, H200, A100, T4, ...)")
    a = p.parse_args(argv)
    if a.dry_run:
        from helpers.hardware import GPUS, gpu_named
        gpu = gpu_named(a.gpu)
        dry_run(plan(a.work, GPUS[gpu]["capability"], GPUS[gpu]["memory_gb"]), gpu)
        return None
    import torch
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to run (every CPU path runs in `make test`); --dry-run shows the plan")
        return None
    from benchmarks.gpu_plan import INSTALL_S
    from benchmarks.gpu_run import run
    started = a.started if a.started is not None else time.time() - INSTALL_S
    return run(a.out, a.work, started)


if __name__ == "__main__":
    main()
