"""The plan of `python -m benchmarks.gpu` (what runs, in what order, with which caps and threads), built without a
GPU, so that `--dry-run` and the tests can read it; benchmarks.gpu_run runs it.

The whole device command, the wheels' install included, must end within BUDGET_S of its start (the device tool
kills at 600 s). Its parts, one after another:

    install + start-up   INSTALL_S (estimated; the run measures it from --started, the shell's clock at its start)
    prepare              PREPARE_CAP: TORCH_CUDA_ARCH_LIST, stale JIT locks, the CPU ops the notebooks load
    notebook phase       lanes_cap: LANES lanes take jobs from one queue (longest first), each job capped at its
                         GPU estimate x MARGIN; time a job leaves unused goes to the next job its lane takes, and
                         time the queue will not need goes to the job that starts now
    benchmark            BENCHMARK_CAP at least: benchmarks.gpu_benchmark, alone on the GPU, writing into --out
    the last write       END_S

Threads: a notebook's kernel waits while its ranks run, so a job runs at most its widest launch's ranks at once
(NOTEBOOK_RANKS). Each job's environment sets OMP_NUM_THREADS (helpers.launch.child_env only sets it where it is
unset: threads_per_rank), and a lane starts the first queued job whose ranks x threads fit the cores beside the
jobs running (fits): lanes x ranks x threads stay within the machine's cores at every moment.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from benchmarks.gpu_prepare import plain_arch
from helpers import REPO_ROOT
from helpers.config import load_json

BUDGET_S = 540           # the device tool kills a command at 600 s: 60 s for a slow install or the copy back
INSTALL_S = 30           # the wheels' pip install (--no-compile) and the interpreter's start: an estimate
PREPARE_CAP = 60         # three CPU ops built at once (benchmarks.gpu_prepare.OPS) and the machine's facts
BENCHMARK_CAP = 180      # its own deadline BENCHMARK_END_S sooner: the table is written after every round
BENCHMARK_END_S = 10
END_S = 10               # the summary's last write and the kill of whatever is still running
LANES = 7                # x 2 ranks x 1 thread: 14 of 16 cores; a 4-rank job (04, 07) waits for room (fits)
LENT_CORES = 16          # both lent kinds (H100, H200); the run reads os.cpu_count() there
GRACE_S = 20             # past a notebook's own --cap, before its process tree is killed
MIN_START_S = 15         # a job with less time left than this is not started

# A notebook's seconds on the lent GPU machine: its stored CPU run (its rank launches run on the CPU there too,
# and the GPU is no slower than 2 cores at the kernel's small models), plus CUDA_START_S per process that starts
# CUDA, plus GPU_WORK_S where the GPU trains a larger model. The cap is MARGIN x that: one notebook was ever
# timed on a GPU.
CUDA_START_S = 13        # notebook 01: 74 s on the H200 (2026-12-04) against 23 s stored, with four processes
                         # that start CUDA (its kernel, two 1-rank torchrun launches, plain_pytorch.py): 51 / 4
CUDA_PROCESSES = {"01": 4}   # default 1, the kernel: 2-rank launches (and 1-rank references placed like them)
                             # run on the CPU, one GPU hosting one rank
GPU_WORK_S = {
    "03": 45,   # the "base" model (auto_model_size on a GPU of 25.7 GB or more) in place of "tiny": ~700 steps
                # and section 7's cold torch.compile of it (GPT-2 124M's takes ~45 s, gpu_benchmark.COLD_COMPILE_S)
    "09": 20,   # sections 3 and 5 train the "base" model 700 steps (~25 ms of host work a step, DESIGN.md)
    "08": 10,   # its in-kernel steps on the "base" model
}
MARGIN = 1.3
CAP_FLOOR = 30
# The most ranks one launch of the notebook starts (04: 4 where there are 4 cores or more; 07: TP 2 x DP 2);
# default 2. 01-03 launch at most 1 rank.
NOTEBOOK_RANKS = {"01": 1, "02": 1, "03": 1, "04": 4, "07": 4}

T4_NOTEBOOKS = ("01", "03", "05", "06")
T4_SITE = REPO_ROOT / "benchmarks" / "t4_emulation"
T4_PROBE_CAP = 20       # one process: capability, bf16, precision, attention kernels, a 16 GB allocation refused
TRAIN = ["helpers.programs.train", "--model-size", "small", "--seq-len", "128", "--steps", "60"]
PROGRAM_CAPS = {"fp16": 45, "bf16": 35}
FP16_OVERFLOW_POWER = 32   # 2**32 x a loss of ~5 overflows fp16 (max 65504): the first steps must be skipped


def stored_seconds() -> dict[str, float]:
    """Each notebook's seconds in the run stored in notebooks/ (a CPU run; nbclient's cell timings)."""
    import nbformat
    from benchmarks.colab_time import cell_seconds
    return {p.stem: sum(cell_seconds(c) for c in nbformat.read(p, as_version=4).cells if c.cell_type == "code")
            for p in sorted((REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))}


def gpu_estimate(stem: str, cpu_seconds: float) -> float:
    """Seconds the notebook is expected to take on the lent machine (see CUDA_START_S)."""
    nb = stem[:2]
    return cpu_seconds + CUDA_START_S * CUDA_PROCESSES.get(nb, 1) + GPU_WORK_S.get(nb, 0)


def notebook_cap(estimate: float) -> int:
    return max(CAP_FLOOR, math.ceil(MARGIN * estimate))


def job_env(work: Path, job_id: str, threads: int, t4: bool) -> dict:
    """What a job's processes see differently: a run folder of its own (a T4 run of 03 must not resume from the
    native run's checkpoints), its threads, and for a T4 job the emulation (first on PYTHONPATH, absolute: rank
    programs start elsewhere) and fp16 forced. The lane adds its copy of the built ops (TORCH_EXTENSIONS_DIR)."""
    env = {"TUTORIAL_RUN_DIR": str(work / "runs" / job_id), "OMP_NUM_THREADS": str(threads), "TUTORIAL_PRECISION": None}
    if t4:
        env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(T4_SITE), os.environ.get("PYTHONPATH")])),
                "TUTORIAL_PRECISION": "fp16", "TORCH_CUDA_ARCH_LIST": "7.5+PTX"}
    return env


def notebook_job(stem: str, seconds: float, work: Path, t4: bool) -> dict:
    estimate = gpu_estimate(stem, seconds)
    cap, executed = notebook_cap(estimate), work / ("executed_t4" if t4 else "executed")
    return {"id": f"{'t4' if t4 else 'native'}-{stem}", "name": stem + (" (T4)" if t4 else ""), "t4": t4,
            "estimate": estimate, "cap": cap, "ranks": NOTEBOOK_RANKS.get(stem[:2], 2),
            "result": executed / f"{stem}.ipynb", "check": None,
            "command": ["helpers.run_notebooks", "--only", stem[:2], "--allow-errors", "--cap", str(cap),
                        "--out", str(executed)]}


def program_jobs(work: Path, bf16: bool) -> list[dict]:
    common = {"t4": False, "ranks": 1}
    return [{**common, "id": "fp16", "name": "fp16, dynamic loss scaling", "cap": PROGRAM_CAPS["fp16"],
             "check": check_fp16, "result": work / "fp16" / "rank0.json", "config": fp16_overflow_config(),
             "command": [*TRAIN, "--config", str(work / "fp16_overflow.json"), "--out", str(work / "fp16")]},
            {**common, "id": "bf16", "name": "bf16", "cap": PROGRAM_CAPS["bf16"], "check": check_loss_falls,
             "result": work / "bf16" / "rank0.json",
             "command": [*TRAIN, "--config", "configs/bf16.json", "--out", str(work / "bf16")] if bf16 else None,
             "skipped": None if bf16 else "no bf16 tensor cores below sm_80"}]


def t4_probe_job(work: Path) -> dict:
    from benchmarks.gpu_prepare import check_t4_probe
    probe = work / "t4_probe.json"
    return {"id": "t4-probe", "name": "T4 emulation probe", "t4": True, "ranks": 1, "cap": T4_PROBE_CAP,
            "check": check_t4_probe, "result": probe, "command": ["benchmarks.gpu_prepare", "--t4-probe", str(probe)]}


def queue(work: Path, bf16: bool) -> list[dict]:
    """Every job of the notebook phase in the order lanes take them: the T4 probe first (its answers judge the
    emulation the T4 jobs stand on), then longest cap first, so that the short ones fill the lanes' ends."""
    seconds = stored_seconds()
    jobs = [notebook_job(stem, s, work, t4=False) for stem, s in seconds.items()]
    if bf16:   # on a GPU without bf16 the native jobs already are what the emulation imitates
        jobs += [notebook_job(stem, s, work, t4=True) for stem, s in seconds.items() if stem[:2] in T4_NOTEBOOKS]
    programs = program_jobs(work, bf16)
    jobs += [j for j in programs if j["command"]]
    jobs.sort(key=lambda j: j["cap"], reverse=True)
    return ([t4_probe_job(work)] if bf16 else []) + jobs + [j for j in programs if not j["command"]]


def threads_per_rank(lanes: int, cores: int) -> int:
    """OMP_NUM_THREADS for every job: `lanes` jobs of the usual 2-rank launch at once fill the cores at most."""
    return max(1, cores // (lanes * 2))


def fits(ranks: int, running: int, threads: int, cores: int) -> bool:
    """Whether a job whose launches start `ranks` ranks may start beside jobs running `running`: their threads
    stay within the cores (a job alone always may)."""
    return running == 0 or (running + ranks) * threads <= cores


def pick(jobs: list[dict], running: int, threads: int, cores: int) -> dict | None:
    """The first queued job that fits beside the running ones (a 4-rank one waits while 4 ranks would not fit)."""
    return next((j for j in jobs if fits(j["ranks"], running, threads, cores)), None)


def granted(cap: float, left: float, queued_caps: float, lanes: int) -> float:
    """A job's time when a lane starts it: its cap, plus what the phase has to spare beyond the jobs still queued
    (their caps spread over the lanes); never past the phase's end. The last job taken gets the rest."""
    spare = left - queued_caps / lanes - cap
    return min(left, cap + max(0.0, spare))


def simulate(jobs: list[dict], lanes: int, phase_s: float, threads: int, cores: int) -> list[list[dict]]:
    """Which lane takes which job if every job runs to its cap, by the run's own rules (queue order, the cores'
    limit, granted()): per lane, [{job, start, granted}]; one with under MIN_START_S left gets granted 0."""
    queued, free, taken = [j for j in jobs if j["command"]], [0.0] * lanes, [[] for _ in range(lanes)]
    ends = []   # (end, ranks) of the jobs started so far
    while queued:
        lane = min(range(lanes), key=free.__getitem__)
        now = free[lane]
        running = sum(r for end, r in ends if end > now)
        job = pick(queued, running, threads, cores)
        if job is None:   # the lane waits for the next job to end
            free[lane] = min(end for end, _ in ends if end > now)
            continue
        queued.remove(job)
        left = phase_s - now
        time = granted(job["cap"], left, sum(j["cap"] for j in queued), lanes) if left >= MIN_START_S else 0
        taken[lane].append({"job": job, "start": now, "granted": time})
        free[lane] = now + min(job["cap"], time)
        ends.append((free[lane], job["ranks"]))
    return taken


def most_threads(simulated: list[list[dict]], threads: int) -> int:
    """The most threads the simulated phase runs at once (at each job's start, the jobs running then)."""
    spans = [(t["start"], t["start"] + min(t["job"]["cap"], t["granted"]), t["job"]["ranks"])
             for lane in simulated for t in lane]
    return max((sum(r for s, e, r in spans if s <= at < e) * threads for at, _, _ in spans), default=0)


def plan(work: Path, capability: tuple, memory_gb: float, cores: int = LENT_CORES) -> dict:
    """The whole run: install, prepare, the queue of the notebook phase and its lanes, the benchmark, with caps."""
    from helpers.precision import gpu_has_bf16
    bf16 = gpu_has_bf16(capability)
    jobs = queue(work, bf16)
    lanes = min(LANES, len([j for j in jobs if j["command"]]))
    threads = threads_per_rank(lanes, cores)
    for job in jobs:
        job["env"] = job_env(work, job["id"], threads, job["t4"])
    lanes_cap = BUDGET_S - INSTALL_S - PREPARE_CAP - BENCHMARK_CAP - END_S
    simulated = simulate(jobs, lanes, lanes_cap, threads, cores)
    return {"install_s": INSTALL_S, "budget_s": BUDGET_S, "end_s": END_S, "cores": cores, "threads": threads,
            "most_threads": most_threads(simulated, threads),
            "prepare": {"name": "prepare", "cap": PREPARE_CAP, "arch": plain_arch(capability)},
            "queue": jobs, "lanes_cap": lanes_cap,
            "lanes": [{"name": f"lane-{i + 1}", "jobs": [t["job"] for t in taken], "simulated": taken}
                      for i, taken in enumerate(simulated)],
            "benchmark": benchmark_job(work, bf16, memory_gb), "t4_skipped": None if bf16 else
            f"sm_{capability[0]}{capability[1]} is itself below sm_80: the native jobs run as a T4 would"}


def benchmark_job(work: Path, bf16: bool, memory_gb: float) -> dict:
    """benchmarks.gpu_benchmark at the micro-batch its planner picks; its JSON and table go where the run says
    (--out, rewritten after every phase); its --deadline-s is set when it starts, from the time left."""
    from benchmarks import gpu_benchmark
    precision = "bf16" if bf16 else "fp32"   # the benchmark's choices (no fp16 mode: the plain loop has no scaler)
    names = gpu_benchmark.contender_names(compiled=True, hf=True)
    micro_batch, _ = gpu_benchmark.plan_micro_batch(memory_gb, len(names), precision)
    bench = work / "benchmark" / "gpu_benchmark.json"
    return {"id": "benchmark", "name": "benchmark, eager and compiled", "cap": BENCHMARK_CAP, "check": check_benchmark,
            "result": bench, "micro_batch": micro_batch,
            "command": ["benchmarks.gpu_benchmark", "--precision", precision, "--micro-batch", str(micro_batch),
                        "--deadline-s", str(BENCHMARK_CAP - BENCHMARK_END_S),
                        "--out", str(bench), "--work-dir", str(work / "benchmark" / "runs")]
            if micro_batch else None,
            "skipped": None if micro_batch else f"{len(names)} contenders of GPT-2 124M do not fit {memory_gb:g} GB"}


def parts(work: Path, capability: tuple, memory_gb: float) -> list[dict]:
    """Every part of the plan after the prepare step (tests/device_matrix.py reads their configs)."""
    planned = plan(work, capability, memory_gb)
    return planned["queue"] + [planned["benchmark"]]


def lane_cap_sum(lane: dict) -> int:
    return sum(j["cap"] for j in lane["jobs"] if j["command"])


def caps_total(planned: dict) -> int:
    """The device command's planned seconds: install, prepare, the notebook phase, the benchmark, the last write."""
    bench = planned["benchmark"]["cap"] if planned["benchmark"]["command"] else 0
    return planned["install_s"] + planned["prepare"]["cap"] + planned["lanes_cap"] + bench + planned["end_s"]


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


def device_command(wheels: str = "runs/gpu_wheels") -> str:
    """The device call's whole command: the clock starts before the install, so the run's deadline counts it."""
    from benchmarks.gpu_wheels import install_command
    return (f"T0=$(date +%s.%N); {install_command(wheels)} && PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu "
            f"--out $OUT --started $T0")


def dry_run(planned: dict, gpu: str) -> None:
    """The plan as text: each part's cap, the lanes as the queue would fill them, threads, and the sum."""
    p, t4 = planned["prepare"], planned["t4_skipped"]
    print(f"device command (carry runs/gpu_wheels): {device_command()}")
    print(f"{'install and start-up':<34} est. {planned['install_s']:>4} s   pip install of the carried wheels "
          f"(--no-compile), python3, torch; measured from --started")
    print(f"{'prepare':<34} cap {p['cap']:>5} s   TORCH_CUDA_ARCH_LIST={p['arch']}, stale JIT locks removed, "
          f"CPU ops built as the CPU ranks load them: cpu_adam async_io(+pin_memory) deepspeed_shm_comm; facts")
    jobs = [j for j in planned["queue"] if j["command"]]
    print(f"{'notebook phase':<34} cap {planned['lanes_cap']:>5} s   {len(jobs)} jobs from one queue in "
          f"{len(planned['lanes'])} lanes; OMP_NUM_THREADS={planned['threads']} per rank; a job starts only where "
          f"its widest launch's ranks x threads fit the {planned['cores']} cores beside the running ones "
          f"(most at once here: {planned['most_threads']} threads)")
    print(f"  caps: GPU estimate x {MARGIN} (stored CPU s + {CUDA_START_S} s per process starting CUDA + the GPU's "
          f"larger models); sum {sum(j['cap'] for j in jobs)} s of {len(planned['lanes']) * planned['lanes_cap']} "
          f"lane-seconds")
    for lane in planned["lanes"]:
        runs = ", ".join(f"{t['job']['name']} {t['job']['cap']} s @{t['start']:.0f}" for t in lane["simulated"])
        end = max((t["start"] + min(t["job"]["cap"], t["granted"]) for t in lane["simulated"]), default=0)
        print(f"  {lane['name']:<7} ends by {end:>4.0f} s: {runs}")
    t4_jobs = [j["name"] for j in jobs if j["t4"]]
    if t4:
        print(f"  T4 emulation skipped: {t4}")
    else:
        print(f"  T4 emulation ({len(t4_jobs)} jobs: fp16, sm_75, no bf16, 15 GB, no flash or cuDNN attention, "
              f"memory-efficient and math SDPA kept): {', '.join(t4_jobs)}")
    for job in planned["queue"]:
        if not job["command"]:
            print(f"  {job['name']} skipped: {job['skipped']}")
    b = planned["benchmark"]
    what = "python -m " + " ".join(b["command"]) if b["command"] else f"skipped: {b['skipped']}"
    print(f"{b['name']:<34} cap {b['cap']:>5} s   {what} (--out and --deadline-s set at its start)")
    print(f"{'the last write':<34}     {planned['end_s']:>5} s")
    print(f"total on the {gpu}: {caps_total(planned)} s (budget {planned['budget_s']} s, the install included)")
