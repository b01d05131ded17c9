"""Preemption (issue 29): a signal to a 2-rank run of `python -m helpers.programs.train` ends it at a step
boundary with a complete checkpoint, every process gone, and `--resume-from` then gives, bitwise, the losses of
a run that was never stopped. The signal goes where a scheduler or a person sends it:
- SIGTERM to torchrun, which passes it on to its ranks (and SIGKILLs them 30 s later);
- SIGTERM to the deepspeed launcher's process group (its local runner passes no signal on, so a scheduler
  signals the group): each rank gets it twice, from the group and from the launcher's own handler;
- SIGINT to one rank only, at a random moment: both ranks must stop after the same step.
"""
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from helpers import REPO_ROOT, presets
from helpers.checkpoints import find_checkpoint
from helpers.launch import LAUNCHERS, child_env, fresh_out_dir, kill_tree, run_program
from helpers.runtime import free_port

STEPS = 40   # long enough that a signal sent after the first checkpoint lands well before the end
OPTIONS = dict(config=presets.CONFIG_DIR / "zero3.json", seq_len=16, n_samples=64, eval_samples=16, steps=STEPS)
ARGS = ["--config", str(OPTIONS["config"]), "--seq-len", "16", "--n-samples", "64", "--eval-samples", "16",
        "--steps", str(STEPS), "--save-every", "2", "--keep-last", "2"]
EXIT_BOUND_S = 90   # torchrun and the deepspeed launcher SIGKILL their ranks 30 s after SIGTERM; this is a timeout


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run never stopped: each rank's losses."""
    ranks = run_program("train", 2, out_dir=tmp_path_factory.mktemp("straight"), **OPTIONS)
    return [[m["loss"] for m in r["history"]] for r in ranks]


def ranks_of(launcher: psutil.Process) -> list[psutil.Process]:
    return [p for p in launcher.children(recursive=True)
            if "helpers.programs.train" in p.cmdline() and not {"torch.distributed.run", "deepspeed.launcher.launch"}
            & set(p.cmdline())]


def interrupted_run(launcher: str, out: Path, deliver) -> tuple[list[psutil.Process], float]:
    """Start the script on 2 ranks, wait for its first checkpoint, `deliver(launcher process, rank processes)`;
    return the rank processes and the seconds from the signal until every process of the job had exited
    (none may be left after EXIT_BOUND_S)."""
    out = fresh_out_dir(out)
    cmd = LAUNCHERS[launcher]("helpers.programs.train", 2, str(free_port()), out / "logs") + ["--out", str(out), *ARGS]
    with open(out / "logs" / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, env=child_env(2), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while not (out / "checkpoints" / "latest").exists():
            assert proc.poll() is None, (out / "logs" / "launcher.log").read_text()
            time.sleep(0.05)
        job = psutil.Process(proc.pid).children(recursive=True)   # launchers and ranks below the one started
        ranks = ranks_of(psutil.Process(proc.pid))
        assert len(ranks) == 2
        deliver(proc, ranks)
        signalled = time.monotonic()
        proc.wait(timeout=EXIT_BOUND_S)   # the deepspeed runner dies at once; its launch.py waits for the ranks
        _, alive = psutil.wait_procs(job, timeout=EXIT_BOUND_S)
        assert not alive, f"still running {EXIT_BOUND_S} s after the signal: {[p.cmdline() for p in alive]}"
        return ranks, time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def stop_lines(out: Path) -> list[str]:
    """The ranks' own last words (their logs: the launcher's is left out)."""
    return [line for p in sorted((out / "logs").rglob("*.log")) if p.name != "launcher.log"
            for line in p.read_text(errors="replace").splitlines() if ": stopped after step" in line]


CASES = {
    "torchrun-SIGTERM": ("torchrun", lambda proc, ranks: proc.send_signal(signal.SIGTERM), "SIGTERM"),
    "deepspeed-group-SIGTERM": ("deepspeed", lambda proc, ranks: os.killpg(proc.pid, signal.SIGTERM), "SIGTERM"),
    "torchrun-SIGINT-to-rank-1": ("torchrun", lambda proc, ranks: (time.sleep(random.Random(29).uniform(0, 0.2)),
                                                                   ranks[1].send_signal(signal.SIGINT)), "SIGINT"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_signal_stops_every_rank_at_one_step_and_the_run_resumes_exactly(case, straight, tmp_path):
    launcher, deliver, name = CASES[case]
    ranks, seconds = interrupted_run(launcher, tmp_path / "stopped", deliver)
    print(f"{case}: every process of the job gone {seconds:.1f} s after the signal")
    lines = stop_lines(tmp_path / "stopped")
    steps = {int(line.split("stopped after step ")[1].split(";")[0]) for line in lines}
    assert len(lines) == 2 and len(steps) == 1 and all(line.startswith(name) for line in lines), lines
    stopped_at = steps.pop()
    checkpoints = tmp_path / "stopped" / "checkpoints"
    assert 2 <= stopped_at < STEPS and find_checkpoint(checkpoints, zero_stage=3, world_size=2).name == f"step{stopped_at}"
    assert len([p for p in checkpoints.iterdir() if p.is_dir()]) <= 2   # --keep-last 2
    if name == "SIGINT":   # what this case adds is the ranks' agreement; resuming is the two cases above
        return
    resumed = run_program("train", 2, out_dir=tmp_path / "resumed", resume_from=checkpoints, **OPTIONS)
    assert [[m["loss"] for m in r["history"]] for r in resumed] == straight   # bitwise, on both ranks
