"""Everything here that only a CUDA GPU can prove, in one command under BUDGET_S seconds on one borrowed GPU:

    python -m benchmarks.gpu_wheels               # here, once: the wheels the GPU machine lacks (runs/gpu_wheels)
    python -m benchmarks.gpu --dry-run --gpu H100 # the plan: every lane, notebook, cap and their sum (no GPU needed)
    python -m benchmarks.gpu --out $OUT           # on the GPU -> summary.json, summary.md, logs.txt in --out
    python -m benchmarks.gpu --work /tmp/gpu_work # where the executed notebooks and logs go (default runs/gpu_work)

1. prepare (benchmarks.gpu_prepare): TORCH_CUDA_ARCH_LIST set to the GPU's plain capability, stale JIT locks
   removed, DeepSpeed's ops built once (natively, and at 7.5+PTX for the T4 lanes), the machine's facts;
2. the notebooks, in lanes running at once, each lane a process at a time with its own TUTORIAL_RUN_DIR and a
   copy of the built ops: all ten in the GPU's own precision, every failing cell recorded (not only the
   first); notebooks 01, 03, 05 and 06 again in T4 emulation lanes (fp16 forced, capability (7, 5), no bf16,
   15 GB, no flash or memory-efficient attention: benchmarks/t4_emulation/sitecustomize.py); and a programs
   lane: fp16 with dynamic loss scaling started at 2**32 (the first steps overflow: skipped, the scale moves,
   the loss falls) and bf16 (sm_80 or newer);
3. benchmarks.gpu_benchmark (GPT-2 124M, sequence 1024; the plain loop, the trainer at ZeRO 0 and 2 and HF Trainer,
   eager and compiled, interleaved block by block in one process), alone on the GPU, under its own deadline.

Each notebook's cap comes from its stored CPU run (1.3x its seconds + 25 s); lanes are packed so that none
runs past the notebook phase's cap. A parallel phase counts its cap once, and the caps sum to BUDGET_S at most;
the whole run also stops at that deadline. The summary is rewritten after every part, so a stop keeps what
ran. Without a CUDA GPU (and without --dry-run) it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.gpu_prepare import plain_arch
from helpers import REPO_ROOT
from helpers.config import load_json

BUDGET_S = 560           # one device command may run 590 s: the wheels' install and the copy back need the rest
PREPARE_CAP = 90
NOTEBOOK_PHASE_CAP = 240
BENCHMARK_CAP = 230      # its own deadline 10 s sooner: the table is written after every round, kept at a cap
CAP_FACTOR, CAP_EXTRA, CAP_FLOOR = 1.3, 25, 45   # a notebook's cap from its stored CPU seconds
NATIVE_LANES, T4_LANES = 6, 3
T4_NOTEBOOKS = ("01", "03", "05", "06")
T4_SITE = REPO_ROOT / "benchmarks" / "t4_emulation"
T4_PROBE_CAP = 20       # one process: capability, bf16, precision, a 16 GB allocation refused
GRACE_S = 20             # past a notebook's own --cap, before its process tree is killed
TRAIN = ["helpers.programs.train", "--model-size", "small", "--seq-len", "128", "--steps", "60"]
FP16_OVERFLOW_POWER = 32   # 2**32 x a loss of ~5 overflows fp16 (max 65504): the first steps must be skipped


def stored_seconds() -> dict[str, float]:
    """Each notebook's seconds in the run stored in notebooks/ (a CPU run; nbclient's cell timings)."""
    import nbformat
    from benchmarks.colab_time import cell_seconds
    return {p.stem: sum(cell_seconds(c) for c in nbformat.read(p, as_version=4).cells if c.cell_type == "code")
            for p in sorted((REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))}


def notebook_cap(cpu_seconds: float) -> int:
    """A GPU box has 16 cores to the CPU run's 2, but the lanes share them and the GPU's models are larger."""
    return max(CAP_FLOOR, round(CAP_FACTOR * cpu_seconds + CAP_EXTRA))


def pack(caps: dict[str, int], lanes: int) -> list[list[str]]:
    """Longest first, each onto the lane with the least so far: lanes that end close together."""
    packed = [[] for _ in range(lanes)]
    for name in sorted(caps, key=caps.get, reverse=True):
        min(packed, key=lambda lane: sum(caps[n] for n in lane)).append(name)
    return [lane for lane in packed if lane]


def notebook_job(stem: str, cap: int, executed: Path) -> dict:
    return {"name": stem, "cap": cap, "result": executed / f"{stem}.ipynb", "check": None,
            "command": ["helpers.run_notebooks", "--only", stem[:2], "--allow-errors", "--cap", str(cap),
                        "--out", str(executed)]}


def program_jobs(work: Path, bf16: bool) -> list[dict]:
    return [{"name": "fp16, dynamic loss scaling", "cap": 45, "check": check_fp16, "result": work / "fp16" / "rank0.json",
             "command": [*TRAIN, "--config", str(work / "fp16_overflow.json"), "--out", str(work / "fp16")],
             "config": fp16_overflow_config()},
            {"name": "bf16", "cap": 35, "check": check_loss_falls, "result": work / "bf16" / "rank0.json",
             "command": [*TRAIN, "--config", "configs/bf16.json", "--out", str(work / "bf16")] if bf16 else None,
             "skipped": None if bf16 else "no bf16 tensor cores below sm_80"}]


def t4_probe_job(work: Path) -> dict:
    from benchmarks.gpu_prepare import check_t4_probe
    probe = work / "t4_probe.json"
    return {"name": "T4 emulation probe", "cap": T4_PROBE_CAP, "check": check_t4_probe, "result": probe,
            "command": ["benchmarks.gpu_prepare", "--t4-probe", str(probe)]}


def lane_env(work: Path, lane: str, t4: bool) -> dict:
    """What a lane's processes see differently: their run folder, their copy of the built ops, for T4 lanes the
    emulation (first on PYTHONPATH, absolute: rank programs start elsewhere) and fp16 forced."""
    env = {"TUTORIAL_RUN_DIR": str(work / lane / "runs"), "TORCH_EXTENSIONS_DIR": str(work / lane / "torch_extensions"),
           "TUTORIAL_PRECISION": None}
    if t4:
        env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(T4_SITE), os.environ.get("PYTHONPATH")])),
                "TUTORIAL_PRECISION": "fp16", "TORCH_CUDA_ARCH_LIST": "7.5+PTX"}
    return env


def plan(work: Path, capability: tuple, memory_gb: float) -> dict:
    """The whole run: the prepare step, the lanes of the notebook phase, the benchmark; each with its cap."""
    from helpers.precision import gpu_has_bf16
    bf16 = gpu_has_bf16(capability)
    caps = {stem: notebook_cap(s) for stem, s in stored_seconds().items()}
    lanes = [{"name": f"native-{i + 1}", "t4": False, "jobs": [notebook_job(s, caps[s], work / "executed")
                                                               for s in stems]}
             for i, stems in enumerate(pack(caps, NATIVE_LANES))]
    t4_caps = {s: c for s, c in caps.items() if s[:2] in T4_NOTEBOOKS}
    if bf16:   # on a GPU without bf16 the native lanes already are what the emulation imitates
        lanes += [{"name": f"t4-{i + 1}", "t4": True, "jobs": [notebook_job(s, caps[s], work / "executed_t4")
                                                               for s in stems]}
                  for i, stems in enumerate(pack(t4_caps, T4_LANES))]
        shortest = min((lane for lane in lanes if lane["t4"]), key=lane_cap_sum)
        shortest["jobs"].insert(0, t4_probe_job(work))   # the emulation's answers, checked before its notebooks
    lanes.append({"name": "programs", "t4": False, "jobs": program_jobs(work, bf16)})
    for lane in lanes:
        lane["env"] = lane_env(work, lane["name"], lane["t4"])
    return {"prepare": {"name": "prepare", "cap": PREPARE_CAP, "arch": plain_arch(capability)}, "lanes": lanes, "lanes_cap": NOTEBOOK_PHASE_CAP,
            "benchmark": benchmark_job(work, bf16, memory_gb), "t4_skipped": None if bf16 else
            f"sm_{capability[0]}{capability[1]} is itself below sm_80: the native lanes run as a T4 would"}


def benchmark_micro_batch(memory_gb: float, precision: str, share: float = 0.9) -> int | None:
    """The largest micro-batch of (8, 4, 2, 1) at which BENCHMARK_CONTENDERS processes of GPT-2 124M (sequence
    1024, the benchmark's GPU defaults) fit in `share` of the GPU's memory (GB, 10^9 bytes) by the planner of
    notebook 05: model states at ZeRO 0, activations, the fixed overhead per process; None if none does."""
    from helpers.memory import planner
    rows = planner.plan("GPT-2 124M", share * memory_gb / BENCHMARK_CONTENDERS, precision=precision,
                        micro_batches=(8, 4, 2, 1))
    fitting = [r["micro_batch"] for r in rows if (r["stage"], r["offload"], r["checkpointing"]) == (0, "none", False)
               and r["fits"]]
    return max(fitting, default=None)


def benchmark_job(work: Path, bf16: bool, memory_gb: float) -> dict:
    """benchmarks.gpu_benchmark, which picks its own micro-batch for the contenders it keeps alive at once."""
    from benchmarks import gpu_benchmark
    precision = "bf16" if bf16 else "fp32"   # the benchmark's choices (no fp16 mode: the plain loop has no scaler)
    names = gpu_benchmark.contender_names(compiled=True, hf=True)
    micro_batch, _ = gpu_benchmark.plan_micro_batch(memory_gb, len(names), precision)
    bench = work / "benchmark" / "gpu_benchmark.json"
    return {"name": "benchmark, eager and compiled", "cap": BENCHMARK_CAP, "check": check_benchmark, "result": bench,
            "micro_batch": micro_batch,
            "command": ["benchmarks.gpu_benchmark", "--precision", precision, "--micro-batch", str(micro_batch),
                        "--deadline-s", str(BENCHMARK_CAP - 10),
                        "--out", str(bench), "--work-dir", str(work / "benchmark" / "runs")]
            if micro_batch else None,
            "skipped": None if micro_batch else f"{len(names)} contenders of GPT-2 124M do not fit {memory_gb:g} GB"}


def parts(work: Path, capability: tuple, memory_gb: float) -> list[dict]:
    """Every part of the plan after the prepare step, lanes flattened (tests/device_matrix.py reads their configs)."""
    planned = plan(work, capability, memory_gb)
    return [job for lane in planned["lanes"] for job in lane["jobs"]] + [planned["benchmark"]]


def lane_cap_sum(lane: dict) -> int:
    return sum(j["cap"] for j in lane["jobs"] if j["command"])


def caps_total(planned: dict) -> int:
    """A parallel phase counts once, at its cap; the lanes' own sums stay within it (dry_run prints both)."""
    bench = planned["benchmark"]["cap"] if planned["benchmark"]["command"] else 0
    return planned["prepare"]["cap"] + planned["lanes_cap"] + bench


def fp16_overflow_config() -> dict:
    config = load_json(REPO_ROOT / "configs" / "fp16.json")
    return {**config, "fp16": {**config["fp16"], "initial_scale_power": FP16_OVERFLOW_POWER}}


def losses(path: Path) -> list[float]:
    return [m["loss"] for m in json.loads(path.read_text())["history"]]


def check_loss_falls(path: Path) -> list[str]:
    seen = losses(path)
    first, last = sum(seen[:5]) / 5, sum(seen[-5:]) / 5
    return [] if last < first else [f"the loss did not fall: first five steps {first:.3f}, last five {last:.3f}"]


def check_fp16(path: Path) -> list[str]:
    history = json.loads(path.read_text())["history"]
    scales, skipped = [m["loss_scale"] for m in history], history[-1]["skipped_steps"]
    problems = check_loss_falls(path)
    if skipped < 1:
        problems.append(f"no step was skipped, though the scale started at 2**{FP16_OVERFLOW_POWER}")
    if min(scales) >= 2.0**FP16_OVERFLOW_POWER:
        problems.append(f"the loss scale never moved from 2**{FP16_OVERFLOW_POWER}")
    return problems


def check_benchmark(path: Path) -> list[str]:
    """Problems of benchmarks.gpu_benchmark's result: no round timed, a contender without a speed, or first losses
    unlike the plain loop's beyond the precision's tolerance (the same model, data and AdamW math)."""
    from helpers.precision import loss_tolerance
    run = json.loads(path.read_text())
    problems = [] if run["rounds_done"] else [f"no round was timed ({run['status']})"]
    tolerance = loss_tolerance(run["config"]["precision"])
    for name, row in run["contenders"].items():
        if not row.get("tokens_per_s"):
            problems.append(f"{name}: no tokens/s")
        if (row.get("max_loss_diff_first_steps") or 0) > tolerance:
            problems.append(f"{name}: first losses differ from the plain loop's by {row['max_loss_diff_first_steps']:.1e}")
    return problems


def dry_run(planned: dict, gpu: str) -> None:
    p = planned["prepare"]
    t4 = " (and at 7.5+PTX for the T4 lanes)" if not planned["t4_skipped"] else ""
    print(f"{'prepare':<34} cap {p['cap']:>4} s   TORCH_CUDA_ARCH_LIST={p['arch']}, stale JIT locks removed, "
          f"ops built: cpu_adam fused_adam async_io{t4}; the machine's facts")
    phase = f"notebooks and programs, {len(planned['lanes'])} lanes"
    print(f"{phase:<34} cap {planned['lanes_cap']:>4} s   (the lanes run at once)")
    for lane in planned["lanes"]:
        jobs = ", ".join(f"{j['name']} {j['cap']} s" if j["command"] else f"{j['name']} skipped ({j['skipped']})"
                         for j in lane["jobs"])
        what = " [T4 emulation: fp16, sm_75, no bf16, 15 GB, no flash/mem-efficient SDPA, 7.5+PTX]" if lane["t4"] else ""
        print(f"  lane {lane['name']:<10} sum {lane_cap_sum(lane):>4} s: {jobs}{what}")
    if planned["t4_skipped"]:
        print(f"  T4 emulation skipped: {planned['t4_skipped']}")
    b = planned["benchmark"]
    what = "python -m " + " ".join(b["command"]) if b["command"] else f"skipped: {b['skipped']}"
    print(f"{b['name']:<34} cap {b['cap']:>4} s   {what}")
    print(f"sum of caps on the {gpu}: {caps_total(planned)} s (budget {BUDGET_S} s)")


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gpu", help="the summary's files (at most 8)")
    p.add_argument("--work", type=Path, default=REPO_ROOT / "runs" / "gpu_work",
                   help="executed notebooks, logs, run folders, built ops")
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
    from benchmarks.gpu_run import run
    return run(a.out, a.work, BUDGET_S)


if __name__ == "__main__":
    main()
