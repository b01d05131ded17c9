"""The run of benchmarks.gpu_plan's plan on a GPU (`python -m benchmarks.gpu` calls run()).

Each job is a process (its whole tree ended at its cap). The notebook phase's lanes are threads that take jobs
from one queue; after every job the summary under --out is rewritten whole, and the benchmark writes its own
JSON and table into --out after every phase of it, so a kill at any moment keeps what ran.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import gpu_plan, gpu_prepare, gpu_summary, gpu_wheels
from helpers import REPO_ROOT
from helpers.config import save_json
from helpers.launch import kill_tree


def environment(overrides: dict) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def own_command(job: dict, seconds: float) -> tuple[list[str], float]:
    """The job's command with its own stop set from `seconds` granted, and the kill's timeout: a notebook stops
    itself at --cap (its cells so far saved), the benchmark at --deadline-s (its table written); the kill is the
    backstop."""
    command = list(job["command"])
    if command[0] == "helpers.run_notebooks":
        own = int(seconds - gpu_plan.GRACE_S)
        command[command.index("--cap") + 1] = str(own)
        return command, own + gpu_plan.GRACE_S
    if command[0] == "benchmarks.gpu_benchmark":
        command[command.index("--deadline-s") + 1] = f"{seconds - gpu_plan.BENCHMARK_END_S:.0f}"
    return command, seconds


def run_job(job: dict, env: dict, seconds: float, logs: Path, lane: str = "-") -> dict:
    """Run one job for at most `seconds` and judge it: a row of the summary."""
    row = {"lane": lane, "name": job["name"], "cap": job["cap"], "granted": round(seconds), "seconds": 0.0,
           "problems": []}
    if job["command"] is None:
        return row | {"status": f"skipped: {job['skipped']}"}
    if seconds < gpu_plan.MIN_START_S:
        return row | {"status": f"not started: {seconds:.0f} s left of its phase or the run"}
    command, timeout = own_command(job, seconds)
    if "config" in job:
        save_json(job["config"], command[command.index("--config") + 1])
    job["result"].unlink(missing_ok=True)   # an earlier run's file must not be judged as this run's
    log = logs / f"{job.get('id', job['name'].split(',')[0].replace(' ', '_'))}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", *command], cwd=REPO_ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)   # a group of its own: kill_tree's
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)   # the part, its kernel (a session of its own) and every rank or build below them
            code = None
    row |= {"seconds": time.monotonic() - start, "log": str(log), "result": str(job["result"]),
            "command": "python -m " + " ".join(command)}
    try:
        return row | judge(job, code, log)
    except Exception as e:   # a half-written result, say: one row says so, and its lane goes on
        return row | {"status": f"exit {code}; its check raised", "problems": [f"{type(e).__name__}: {e}"[:300]]}


def judge(job: dict, code: int | None, log: Path) -> dict:
    result = job["result"]
    if not result.is_file():
        return {"status": "killed at its cap" if code is None else f"failed (exit {code})",
                "problems": [f"it wrote no {result.name}"]}
    if job["check"] is not None:
        problems = job["check"](result)
        status = ("killed at its cap" if code is None else f"failed (exit {code})" if code else
                  "passed" if not problems else "ran, but its check failed")
        return {"status": status, "problems": problems} | small_json(result)
    report = gpu_summary.notebook_report(result)
    problems = [f"cell {c['cell']}: {c['error']}" for c in report["failing"]]
    problems += [f"cell {c['cell']} printed no ✓" for c in report["checks_without_tick"]]
    stopped = code is None or "stopped at its cap" in log.read_text(errors="replace")
    if stopped and report["last_run"]:
        problems.append(f"stopped in cell {report['last_run']['cell']}: {report['last_run']['source']}")
    status = ("stopped at its cap (cells run so far kept)" if stopped else f"failed (exit {code})" if code else
              "passed" if not problems else f"ran, {len(report['failing'])} cells failed")
    return {"status": status, "problems": problems, "notebook": report}


def small_json(path: Path, limit: int = 4000) -> dict:
    """A short JSON result (the T4 probe's answers) copied into the row: the work folder does not come back."""
    text = path.read_text(errors="replace") if path.suffix == ".json" else ""
    if not text or len(text) > limit:
        return {}
    import json
    return {"answers": json.loads(text)}


class Summary:
    """The summary, rewritten under `out` after every part; lanes record from their threads."""

    def __init__(self, out: Path, budget: int, started: float):
        self.out, self.lock, self.start = out, threading.Lock(), time.monotonic()
        self.data = {"seconds": 0.0, "deadline_s": budget, "started_before_s": round(time.time() - started, 1),
                     "parts": []}

    def record(self, **fields) -> None:
        with self.lock:
            rows = fields.pop("row", None)
            self.data |= fields
            if rows:
                self.data["parts"].append(rows)
                print(f"[{time.monotonic() - self.start:4.0f} s] {rows['lane']} / {rows['name']}: {rows['status']} "
                      f"in {rows['seconds']:.0f} s" + "".join(f"\n    {p}" for p in rows["problems"][:5]), flush=True)
            self.data["seconds"] = self.data["started_before_s"] + time.monotonic() - self.start
            gpu_summary.write(self.out, self.data)


class Queue:
    """The notebook phase's one queue. A lane takes the first job that fits the cores beside the running ones
    (gpu_plan.pick; it waits while none does) and is granted its cap plus what the phase can spare beyond the caps
    still queued (gpu_plan.granted); done() gives the job's ranks back."""

    def __init__(self, jobs: list[dict], lanes: int, phase_end: float, threads: int, cores: int):
        self.jobs, self.lanes, self.phase_end, self.threads, self.cores = list(jobs), lanes, phase_end, threads, cores
        self.running, self.changed = 0, threading.Condition()

    def take(self) -> tuple[dict, float] | None:
        with self.changed:
            while self.jobs:
                job = gpu_plan.pick(self.jobs, self.running, self.threads, self.cores)
                if job is not None:
                    self.jobs.remove(job)
                    self.running += job["ranks"]
                    left = self.phase_end - time.monotonic()
                    return job, gpu_plan.granted(job["cap"], left, sum(j["cap"] for j in self.jobs), self.lanes)
                self.changed.wait()
            return None

    def done(self, job: dict) -> None:
        with self.changed:
            self.running -= job["ranks"]
            self.changed.notify_all()


def run_lanes(planned: dict, work: Path, phase_end: float, summary: Summary) -> None:
    jobs = [j for j in planned["queue"] if j["command"]]
    for job in planned["queue"]:
        if not job["command"]:
            summary.record(row=run_job(job, {}, 0, work / "logs"))
    shared = Queue(jobs, len(planned["lanes"]), phase_end, planned["threads"], planned["cores"])

    def lane_thread(name):
        ext_dir = work / name / "torch_extensions"
        try:   # a copy of its own: a job killed mid-build leaves its lock in this lane's copy only
            gpu_prepare.copy_ext_dir(work / "torch_extensions", ext_dir)
        except OSError as e:   # the lane then builds its ops itself
            print(f"{name}: the built ops were not copied ({e})", flush=True)
        while (taken := shared.take()) is not None:
            job, seconds = taken
            env = environment(job["env"] | {"TORCH_EXTENSIONS_DIR": str(ext_dir)})
            try:
                summary.record(row=run_job(job, env, seconds, work / "logs", name))
            finally:
                shared.done(job)

    threads = [threading.Thread(target=lane_thread, args=(lane["name"],)) for lane in planned["lanes"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_prepare(planned: dict, work: Path, deadline: float, summary: Summary) -> None:
    print(f"prepare (cap {planned['prepare']['cap']} s) ...", flush=True)
    cap, start = min(planned["prepare"]["cap"], deadline - time.monotonic()), time.monotonic()
    try:
        prepared = gpu_prepare.prepare(work / "torch_extensions", cap=cap)
    except Exception as e:   # a missing package, say: the lanes still run, and their logs say more
        prepared = {"error": f"{type(e).__name__}: {e}"[:400], "seconds": time.monotonic() - start}
    summary.record(prepare=prepared)
    print(f"  {prepared['seconds']:.0f} s: {prepared.get('ops') or prepared.get('error')}", flush=True)


def package_check() -> dict:
    try:
        return gpu_wheels.installed_check()
    except Exception as e:   # a broken metadata entry, say: the run goes on, and the summary says why
        return {"packages": {}, "problems": [f"the package check raised {type(e).__name__}: {e}"[:300]]}


def run(out: Path, work: Path, started: float) -> dict:
    """The plan, run so that the device command (started at `started`, epoch seconds) ends by its budget."""
    import torch
    deadline = time.monotonic() + started + gpu_plan.BUDGET_S - gpu_plan.END_S - time.time()
    props = torch.cuda.get_device_properties(0)
    planned = gpu_plan.plan(work, (props.major, props.minor), props.total_memory / 1e9, os.cpu_count() or 1)
    summary = Summary(out, gpu_plan.BUDGET_S, started)
    summary.record(t4_skipped=planned["t4_skipped"], threads=planned["threads"], lanes=len(planned["lanes"]),
                   packages=package_check())
    run_prepare(planned, work, deadline, summary)
    bench = planned["benchmark"]
    phase_end = deadline - (bench["cap"] if bench["command"] else 0)
    print(f"{len(planned['lanes'])} lanes, {len(planned['queue'])} jobs, until {phase_end - time.monotonic():.0f} s "
          f"from now ...", flush=True)
    run_lanes(planned, work, phase_end, summary)
    if bench["command"]:   # into --out itself: written after every phase, it comes back even after a kill
        bench["command"][bench["command"].index("--out") + 1] = str(out / "gpu_benchmark.json")
        bench["result"] = out / "gpu_benchmark.json"
    row = run_job(bench, environment({}), deadline - time.monotonic(), work / "logs", "benchmark")
    summary.record(row=row)
    print(gpu_summary.markdown(summary.data))
    return summary.data
