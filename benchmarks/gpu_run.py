"""The run of `python -m benchmarks.gpu`'s plan on a GPU (benchmarks.gpu builds the plan and calls run()).

Each part is a process (its whole tree ended at its cap); the lanes of the notebook phase are threads that
start their parts one after another; after every part the summary under --out is rewritten whole.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import gpu, gpu_prepare, gpu_summary
from helpers import REPO_ROOT
from helpers.config import save_json
from helpers.launch import kill_tree

MIN_START_S = 15   # a part with less time left than this is not started


def environment(overrides: dict) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_job(job: dict, env: dict, until: float, logs: Path, lane: str = "-") -> dict:
    """Run one part before `until` (time.monotonic()) and judge it: a row of the summary."""
    row = {"lane": lane, "name": job["name"], "cap": job["cap"], "seconds": 0.0, "problems": []}
    if job["command"] is None:
        return row | {"status": f"skipped: {job['skipped']}"}
    left = until - time.monotonic()
    if left < MIN_START_S:
        return row | {"status": f"not started: {left:.0f} s left of its phase or the run"}
    command, notebook = list(job["command"]), job["command"][0] == "helpers.run_notebooks"
    if notebook:   # it stops itself at --cap, the executed cells saved; the kill below is the backstop
        own = int(min(job["cap"], left - gpu.GRACE_S))
        command[command.index("--cap") + 1], timeout = str(own), own + gpu.GRACE_S
    else:
        timeout = min(job["cap"], left)
    if "config" in job:
        save_json(job["config"], command[command.index("--config") + 1])
    job["result"].unlink(missing_ok=True)   # an earlier run's file must not be judged as this run's
    log = logs / f"{lane}-{job['name'].split(',')[0].replace(' ', '_')}.log"
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
        return {"status": status, "problems": problems}
    report = gpu_summary.notebook_report(result)
    problems = [f"cell {c['cell']}: {c['error']}" for c in report["failing"]]
    problems += [f"cell {c['cell']} printed no ✓" for c in report["checks_without_tick"]]
    stopped = code is None or "stopped at its cap" in log.read_text(errors="replace")
    if stopped and report["last_run"]:
        problems.append(f"stopped in cell {report['last_run']['cell']}: {report['last_run']['source']}")
    status = ("stopped at its cap (cells run so far kept)" if stopped else f"failed (exit {code})" if code else
              "passed" if not problems else f"ran, {len(report['failing'])} cells failed")
    return {"status": status, "problems": problems, "notebook": report}


class Summary:
    """The summary, rewritten under `out` after every part; lanes record from their threads."""

    def __init__(self, out: Path, budget: int):
        self.out, self.lock, self.start = out, threading.Lock(), time.monotonic()
        self.data = {"seconds": 0.0, "deadline_s": budget, "parts": []}

    def record(self, **fields) -> None:
        with self.lock:
            rows = fields.pop("row", None)
            self.data |= fields
            if rows:
                self.data["parts"].append(rows)
                print(f"[{time.monotonic() - self.start:4.0f} s] {rows['lane']} / {rows['name']}: {rows['status']} "
                      f"in {rows['seconds']:.0f} s" + "".join(f"\n    {p}" for p in rows["problems"][:5]), flush=True)
            self.data["seconds"] = time.monotonic() - self.start
            gpu_summary.write(self.out, self.data)


def run_lanes(planned: dict, work: Path, until: float, summary: Summary) -> None:
    def lane_thread(lane):
        env = environment(lane["env"])
        source = work / ("torch_extensions_t4" if lane["t4"] else "torch_extensions")
        try:
            gpu_prepare.copy_ext_dir(source, Path(lane["env"]["TORCH_EXTENSIONS_DIR"]))
        except OSError as e:   # the lane then builds its ops itself
            print(f"{lane['name']}: the built ops were not copied ({e})", flush=True)
        for job in lane["jobs"]:
            summary.record(row=run_job(job, env, until, work / "logs", lane["name"]))

    threads = [threading.Thread(target=lane_thread, args=(lane,)) for lane in planned["lanes"]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(out: Path, work: Path, budget: int) -> dict:
    import torch
    deadline = time.monotonic() + budget
    props = torch.cuda.get_device_properties(0)
    planned = gpu.plan(work, (props.major, props.minor), props.total_memory / 1e9)
    summary = Summary(out, budget)
    summary.record(t4_skipped=planned["t4_skipped"])
    print(f"prepare (cap {planned['prepare']['cap']} s) ...", flush=True)
    cap, start = min(planned["prepare"]["cap"], deadline - time.monotonic()), time.monotonic()
    t4_env = next((lane["env"] for lane in planned["lanes"] if lane["t4"]), None)
    try:
        prepared = gpu_prepare.prepare(work / "torch_extensions", work / "torch_extensions_t4" if t4_env else None,
                                       cap=cap, t4_env=t4_env and {"PYTHONPATH": t4_env["PYTHONPATH"]})
    except Exception as e:   # a missing package, say: the lanes still run, and their logs say more
        prepared = {"error": f"{type(e).__name__}: {e}"[:400], "seconds": time.monotonic() - start}
    summary.record(prepare=prepared)
    print(f"  {prepared['seconds']:.0f} s: {prepared.get('ops') or prepared.get('error')}", flush=True)
    phase_end = min(time.monotonic() + planned["lanes_cap"], deadline)
    print(f"{len(planned['lanes'])} lanes (cap {planned['lanes_cap']} s) ...", flush=True)
    run_lanes(planned, work, phase_end, summary)
    bench = planned["benchmark"]
    row = run_job(bench, environment({}), min(time.monotonic() + bench["cap"], deadline), work / "logs", "benchmark")
    table = Path(bench["result"]).with_suffix(".md")
    summary.record(row=row, benchmark_table=table.read_text() if table.is_file() else None)
    print(gpu_summary.markdown(summary.data))
    return summary.data
