"""Preemption (issue 29): a signal to a 2-rank run of `python -m helpers.programs.train` ends it at a step
boundary with a complete checkpoint, every process gone, and `--resume-from` then gives, bitwise, the losses of
a run that was never stopped. The signal goes where a scheduler or a person sends it:
- SIGTERM to torchrun, which passes it on to its ranks (and SIGKILLs them 30 s later);
- SIGTERM to the deepspeed launcher's process group (its local runner passes no signal on, so a scheduler
  signals the group): each rank gets it twice, from the group and from the launcher's own handler;
- SIGINT to one rank only, from a timer at a random moment: both ranks must stop after the same step;
- the notebook's Stop on a cell running `run_program`: SIGINT to every rank, from helpers.launch.
Every run accumulates 2 micro-batches per step, so a signal may land between them; ZeRO 0 and 3 both.
"""
import _thread
import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers import REPO_ROOT, presets
from helpers.checkpoints import find_checkpoint
from helpers.launch import LAUNCHERS, child_env, flags, fresh_out_dir, kill_tree, ranks_of, run_program
from helpers.runtime import free_port

STEPS = 40   # long enough that a signal sent after the first checkpoint lands well before the end
DATA = dict(seq_len=16, n_samples=64, eval_samples=16, steps=STEPS)
EXIT_BOUND_S = 90   # torchrun and the deepspeed launcher SIGKILL their ranks 30 s after SIGTERM; this is a timeout


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[int, Path]:
    """ZeRO 0 and 3, each accumulating 2 micro-batches of 4 per optimizer step."""
    folder = tmp_path_factory.mktemp("configs")
    for stage in (0, 3):
        config = presets.preset(f"zero{stage}") | {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
        (folder / f"zero{stage}.json").write_text(json.dumps(config))
    return {stage: folder / f"zero{stage}.json" for stage in (0, 3)}


@pytest.fixture(scope="module")
def straight(configs, tmp_path_factory) -> dict[int, list[list[float]]]:
    """The runs never stopped: each rank's losses, by ZeRO stage."""
    return {stage: [[m["loss"] for m in r["history"]] for r in
                    run_program("train", 2, out_dir=tmp_path_factory.mktemp(f"straight{stage}"), config=path, **DATA)]
            for stage, path in configs.items()}


def interrupted_run(launcher: str, config: Path, out: Path, deliver) -> tuple[list[psutil.Process], float]:
    """Start the script on 2 ranks, wait for its first checkpoint, `deliver(launcher process, rank processes)`;
    return the rank processes and the seconds from the signal until every process of the job had exited
    (none may be left after EXIT_BOUND_S)."""
    out = fresh_out_dir(out)
    args = ["--config", str(config), *flags(DATA), "--save-every", "2", "--keep-last", "2"]
    cmd = LAUNCHERS[launcher]("helpers.programs.train", 2, str(free_port()), out / "logs") + ["--out", str(out), *args]
    with open(out / "logs" / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, env=child_env(2), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while not (out / "checkpoints" / "latest").exists():
            assert proc.poll() is None, (out / "logs" / "launcher.log").read_text()
            time.sleep(0.05)
        job = psutil.Process(proc.pid).children(recursive=True)   # launchers and ranks below the one started
        ranks = ranks_of(proc, "helpers.programs.train")
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


def sigint_to_rank_1_from_a_timer(seed: int):
    """A SIGINT to rank 1 alone, 0-0.3 s after the first checkpoint: a moment anywhere in a step."""
    def deliver(proc, ranks):
        timer = threading.Timer(random.Random(seed).uniform(0, 0.3), ranks[1].send_signal, (signal.SIGINT,))
        timer.start()
        timer.join()
    return deliver


CASES = {   # launcher, ZeRO stage, how the signal is sent, its name, whether the run is resumed here
    # Resumed at ZeRO 3 by the SIGINT case below (a stop anywhere in a step), which saves CI a 2-rank run: this
    # case's checkpoint is checked complete for its world size, and the signal does not change what is saved.
    "torchrun-SIGTERM-zero3": ("torchrun", 3, lambda proc, ranks: proc.send_signal(signal.SIGTERM), "SIGTERM", False),
    "deepspeed-group-SIGTERM-zero0": ("deepspeed", 0, lambda proc, ranks: os.killpg(proc.pid, signal.SIGTERM), "SIGTERM", True),
    "torchrun-SIGINT-to-rank-1-zero3": ("torchrun", 3, sigint_to_rank_1_from_a_timer(29), "SIGINT", True),
}


@pytest.mark.parametrize("case", CASES)
def test_a_signal_stops_every_rank_at_one_step_and_the_run_resumes_exactly(case, configs, straight, tmp_path):
    launcher, stage, deliver, name, resume = CASES[case]
    ranks, seconds = interrupted_run(launcher, configs[stage], tmp_path / "stopped", deliver)
    print(f"{case}: every process of the job gone {seconds:.1f} s after the signal")
    lines = stop_lines(tmp_path / "stopped")
    steps = {int(line.split("stopped after step ")[1].split(";")[0]) for line in lines}
    assert len(lines) == 2 and len(steps) == 1 and all(line.startswith(name) for line in lines), lines
    stopped_at = steps.pop()
    checkpoints = tmp_path / "stopped" / "checkpoints"
    assert 2 <= stopped_at < STEPS and find_checkpoint(checkpoints, zero_stage=stage, world_size=2).name == f"step{stopped_at}"
    assert len([p for p in checkpoints.iterdir() if p.is_dir()]) <= 2   # --keep-last 2
    if not resume:
        return
    resumed = run_program("train", 2, out_dir=tmp_path / "resumed", config=configs[stage], resume_from=checkpoints, **DATA)
    assert [[m["loss"] for m in r["history"]] for r in resumed] == straight[stage]   # bitwise, on both ranks


def test_the_notebooks_stop_during_run_program_stops_the_ranks_at_one_step_saved(configs, straight, tmp_path, capsys):
    """Stop on a cell that runs `run_program("train", 2, ...)` at ZeRO 0: the KeyboardInterrupt reaches the
    notebook's process, which SIGINTs the ranks; they finish the step, save, and are gone before the cell
    raises; the run then resumes exactly."""
    out = tmp_path / "stopped"

    def stop_after_the_first_checkpoint():
        while not (out / "checkpoints" / "latest").exists():
            time.sleep(0.05)
        _thread.interrupt_main()   # what the Stop button does to the kernel: a SIGINT

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # a background CI shell ignores SIGINT
    try:
        threading.Thread(target=stop_after_the_first_checkpoint, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_program("train", 2, out_dir=out, config=configs[0], save_every=2, keep_last=2, **DATA)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not [p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    lines = stop_lines(out)   # each rank's
    assert len(lines) == 2 and len(set(lines)) == 1 and lines[0].startswith("SIGINT"), lines
    assert lines[0] in capsys.readouterr().err   # and the notebook printed where the run is saved
    stopped_at = int(lines[0].split("stopped after step ")[1].split(";")[0])
    assert find_checkpoint(out / "checkpoints", zero_stage=0, world_size=2).name == f"step{stopped_at}"
    resumed = run_program("train", 2, out_dir=tmp_path / "resumed", config=configs[0], resume_from=out / "checkpoints", **DATA)
    assert [[m["loss"] for m in r["history"]] for r in resumed] == straight[0]   # bitwise, on both ranks
