"""benchmarks/gpu.py, the one command for what only a GPU runs: its plan for each GPU fits the time a borrowed
GPU machine allows and holds every notebook, the T4 emulation's answers hold (on this CPU, where they can), the
summary keeps each failing cell's source and error, stale JIT locks go and live ones stay, and each part's
check judges real outputs. Nothing here starts a notebook kernel."""
import copy
import json
import os
import subprocess
import sys

import nbformat
import pytest

from benchmarks import gpu, gpu_prepare, gpu_run, gpu_summary, gpu_wheels
from helpers import REPO_ROOT
from helpers.hardware import GPUS, MATRIX_GPUS
from helpers.runtime import remove_stale_locks

NOTEBOOKS = sorted(p.stem for p in (REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))
BF16_GPUS = [g for g in (*MATRIX_GPUS, "H100 80GB") if GPUS[g]["capability"] >= (8, 0)]


def test_without_a_gpu_it_says_so_and_runs_nothing(capsys):
    assert gpu.main([]) is None
    assert "no CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("name", BF16_GPUS)
def test_the_plan_runs_every_notebook_the_t4_four_and_the_benchmark_within_the_budget(name, tmp_path):
    planned = gpu.plan(tmp_path, GPUS[name]["capability"], GPUS[name]["memory_gb"])
    native = [j["name"] for lane in planned["lanes"] if lane["name"].startswith("native") for j in lane["jobs"]]
    t4 = [j["name"] for lane in planned["lanes"] if lane["t4"] for j in lane["jobs"] if j["name"] != "T4 emulation probe"]
    assert sorted(native) == NOTEBOOKS and len(NOTEBOOKS) == 10
    assert sorted(s[:2] for s in t4) == sorted(gpu.T4_NOTEBOOKS)
    over = {lane["name"]: gpu.lane_cap_sum(lane) for lane in planned["lanes"] if gpu.lane_cap_sum(lane) > planned["lanes_cap"]}
    assert not over, (f"lanes over the {planned['lanes_cap']} s phase cap: {over}; each notebook's cap comes from its "
                      f"stored CPU seconds {gpu.stored_seconds()}: was one stored on a loaded machine? "
                      "Re-store it alone (python -m helpers.run_notebooks --only NN --in-place)")   # no notebook cut short
    assert planned["benchmark"]["command"] and gpu.caps_total(planned) <= gpu.BUDGET_S <= 560
    env = next(lane["env"] for lane in planned["lanes"] if lane["t4"])
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(gpu.T4_SITE) and env["TUTORIAL_PRECISION"] == "fp16"


def test_the_dry_run_prints_the_plan_for_an_h100(capsys, tmp_path):
    gpu.main(["--dry-run", "--gpu", "H100", "--work", str(tmp_path), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    t4_lines = [line for line in out.splitlines() if "T4 emulation" in line]
    assert all(stem in out for stem in NOTEBOOKS) and len(t4_lines) == gpu.T4_LANES
    assert sorted(n for line in t4_lines for n in gpu.T4_NOTEBOOKS if f" {n}_" in line) == sorted(gpu.T4_NOTEBOOKS)
    assert "python -m benchmarks.gpu_benchmark --precision bf16 --micro-batch" in out
    total = gpu.caps_total(gpu.plan(tmp_path, (9, 0), 80))
    assert out.splitlines()[-1] == f"sum of caps on the H100 80GB: {total} s (budget {gpu.BUDGET_S} s)"
    assert not any(tmp_path.iterdir())   # nothing ran


def test_on_a_t4_the_native_lanes_are_the_t4_and_no_benchmark_fits(capsys, tmp_path):
    gpu.main(["--dry-run", "--gpu", "T4", "--work", str(tmp_path)])
    out = capsys.readouterr().out
    assert "T4 emulation skipped" in out and f"benchmark, eager and compiled      cap  {gpu.BENCHMARK_CAP} s   skipped" in out


def test_each_command_is_one_its_program_accepts(tmp_path):
    from benchmarks import gpu_benchmark
    from helpers import run_notebooks
    from helpers.programs import train
    for part in gpu.parts(tmp_path, GPUS["H200"]["capability"], GPUS["H200"]["memory_gb"]):
        name, (module, *args) = part["name"], part["command"]
        if module == "helpers.programs.train":
            config = part.get("config") or json.loads((REPO_ROOT / train.parse(args).config).read_text())
            assert "fp16" in config or "bf16" in config, name
        elif module == "benchmarks.gpu_benchmark":
            a = gpu_benchmark.parse(args)
            assert a.micro_batch == part["micro_batch"] and a.deadline_s < part["cap"], name
        elif module == "benchmarks.gpu_prepare":
            assert args[0] == "--t4-probe" and part["check"] is gpu_prepare.check_t4_probe, name
        else:   # its flags parse; an --only that matches nothing stops it before any kernel starts
            assert module == "helpers.run_notebooks" and list(run_notebooks.NOTEBOOKS.glob(args[1] + "*.ipynb")), name
            with pytest.raises(SystemExit, match="no notebook"):
                run_notebooks.main([*args[:1], "zz", *args[2:]])


def test_the_t4_emulation_answers_as_a_t4_in_a_process_of_its_own():
    """Checked on this CPU: what the tutorial reads (capability, properties, bf16, attention kernels, the arch
    list) and the precision the rule picks from it. The memory cap needs CUDA to start: not checked here."""
    probe = ("import torch, os\nfrom helpers.precision import choose_precision, forced_precision\n"
             "p = torch.cuda.get_device_properties(0)\ncap = (p.major, p.minor)\n"
             "print(torch.cuda.get_device_capability(), torch.cuda.is_bf16_supported(), cap, p.total_memory < 16e9,"
             " torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),"
             " os.environ['TORCH_CUDA_ARCH_LIST'], choose_precision(cap)[0], forced_precision('cuda', cap))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(gpu.T4_SITE), str(REPO_ROOT)]), "TUTORIAL_PRECISION": "fp16"}
    env.pop("TORCH_CUDA_ARCH_LIST", None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["(7,", "5)", "False", "(7,", "5)", "True", "False", "False", "7.5+PTX", "fp16", "fp16"]


def test_the_probe_check_wants_every_answer_a_t4_gives(tmp_path):
    probe = tmp_path / "probe.json"
    t4 = {"capability": [7, 5], "bf16 supported": False, "precision": "fp16", "flash sdp": False, "16 GB allocated": False}
    probe.write_text(json.dumps(t4))
    assert gpu_prepare.check_t4_probe(probe) == []
    probe.write_text(json.dumps(t4 | {"capability": [9, 0], "16 GB allocated": True}))   # the emulation not applied
    assert gpu_prepare.check_t4_probe(probe) == ["capability: [9, 0], a T4 gives [7, 5]",
                                                 "16 GB allocated: True, a T4 gives False"]


def test_a_stale_lock_goes_and_a_held_one_stays(tmp_path):
    stale, held = tmp_path / "py312_cu130" / "fused_adam" / "lock", tmp_path / "py312_cu130" / "cpu_adam" / "lock"
    for p in (stale, held):
        p.parent.mkdir(parents=True)
        p.touch()
    builder = subprocess.Popen([sys.executable, "-c", f"f = open({str(held)!r}); print('open', flush=True); input()"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "open"
        assert remove_stale_locks(tmp_path) == [stale.resolve()]
        assert held.exists() and not stale.exists()
    finally:
        builder.communicate("")


def test_the_plain_arch_is_one_deepspeed_reads():
    from helpers.preflight import arch_list_problem
    assert gpu_prepare.plain_arch((9, 0)) == "9.0" and arch_list_problem(gpu_prepare.plain_arch((9, 0))) is None


def executed_notebook(path):
    """An executed notebook as nbclient writes it: a cell that raised, a check cell with its ✓, one not run."""
    nb = nbformat.v4.new_notebook()
    failing = nbformat.v4.new_code_cell("x = 1\nraise ValueError('no GPU memory left')", execution_count=1)
    failing.outputs = [nbformat.v4.new_output("error", ename="ValueError", evalue="no GPU memory left", traceback=[])]
    check = nbformat.v4.new_code_cell("# Check: the loss falls\nprint('✓ it fell')", execution_count=2)
    check.outputs = [nbformat.v4.new_output("stream", name="stdout", text="✓ it fell\n")]
    nb.cells = [nbformat.v4.new_markdown_cell("# A notebook"), failing, check, nbformat.v4.new_code_cell("y = 2")]
    nbformat.write(nb, path)
    return path


def test_the_summary_keeps_each_failing_cells_source_and_error(tmp_path):
    path = executed_notebook(tmp_path / "03_trainer.ipynb")
    report = gpu_summary.notebook_report(path)
    assert report == {"cells": 3, "cells_run": 2, "checks_passed": 1, "checks_without_tick": [],
                      "last_run": {"cell": 2, "source": "# Check: the loss falls"},
                      "failing": [{"cell": 1, "source": "x = 1\nraise ValueError('no GPU memory left')",
                                   "error": "ValueError: no GPU memory left"}]}
    log = tmp_path / "lane.log"
    log.write_text("running 03_trainer.ipynb ...\n  done in 80 s\n")
    job = {"name": "03_trainer", "result": path, "check": None}
    row = {"lane": "t4-2", "name": "03_trainer", "cap": 109, "seconds": 80.0, "log": str(log)} | gpu_run.judge(job, 0, log)
    assert row["status"] == "ran, 1 cells failed" and row["problems"] == ["cell 1: ValueError: no GPU memory left"]
    prepare = {"TORCH_CUDA_ARCH_LIST": "9.0", "stale locks removed": [], "seconds": 50.0, "facts": {"GPU": "H100"},
               "ops": {"FusedAdamBuilder": "built in 40 s"}, "ops for the T4 lane (7.5+PTX)": {"FusedAdamBuilder": "built in 45 s"}}
    files = gpu_summary.write(tmp_path / "out", {"seconds": 100.0, "deadline_s": 560, "parts": [row], "prepare": prepare})
    assert len(files) <= gpu_summary.MAX_FILES == 8
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "| t4-2 | 03_trainer | ran, 1 cells failed | 80 | 109 | 2/3 | 1 | 1 |" in text
    assert "`ValueError: no GPU memory left`" in text and "raise ValueError('no GPU memory left')" in text
    assert gpu_summary.T4_NOT_PROVEN in text and "done in 80 s" in (tmp_path / "out" / "logs.txt").read_text()
    assert "TORCH_CUDA_ARCH_LIST=9.0" in text and "for the T4 lanes: FusedAdamBuilder built in 45 s" in text


def test_the_forced_fp16_overflow_starts_the_scale_where_a_loss_overflows_fp16():
    config = gpu.fp16_overflow_config()
    assert config["fp16"]["loss_scale"] == 0   # dynamic
    assert 2.0 ** config["fp16"]["initial_scale_power"] * 4.0 > 65504   # a loss of 4 times the scale: past fp16's max


def test_the_checks_judge_a_real_training_run(tmp_path):
    from helpers.programs import train
    train.main(["--config", "configs/zero0.json", "--seq-len", "16", "--n-samples", "256", "--eval-samples", "16",
                "--steps", "12", "--out", str(tmp_path / "run")])
    result = tmp_path / "run" / "rank0.json"
    assert gpu.check_loss_falls(result) == []
    run = json.loads(result.read_text())
    flat = copy.deepcopy(run)
    for m in flat["history"]:
        m["loss"] = 5.0
    fp16 = copy.deepcopy(run)   # as an fp16 run that never overflowed would write it
    for m in fp16["history"]:
        m["loss_scale"] = 2.0 ** gpu.FP16_OVERFLOW_POWER
    for name, data in (("flat", flat), ("fp16", fp16)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    assert gpu.check_loss_falls(tmp_path / "flat.json") == ["the loss did not fall: first five steps 5.000, last five 5.000"]
    assert gpu.check_fp16(tmp_path / "fp16.json") == [
        f"no step was skipped, though the scale started at 2**{gpu.FP16_OVERFLOW_POWER}",
        f"the loss scale never moved from 2**{gpu.FP16_OVERFLOW_POWER}"]


def test_a_skipped_part_and_a_failing_one_are_reported(tmp_path):
    import time
    until = time.monotonic() + 60
    skipped = {"name": "bf16", "command": None, "cap": 35, "skipped": "no bf16 tensor cores below sm_80"}
    assert gpu_run.run_job(skipped, {}, until, tmp_path)["status"] == "skipped: no bf16 tensor cores below sm_80"
    stale = tmp_path / "earlier" / "rank0.json"   # an earlier run's result where this one writes
    stale.parent.mkdir()
    stale.write_text("{}")
    failing = {"name": "bad flag", "cap": 60, "check": gpu.check_loss_falls, "result": stale,
               "command": ["benchmarks.gpu_wheels", "--no-such-flag"]}   # argparse refuses it: exit 2, at once
    row = gpu_run.run_job(failing, gpu_run.environment({}), until, tmp_path, "programs")
    assert row["status"] == "failed (exit 2)" and row["problems"] == ["it wrote no rank0.json"] and not stale.exists()
    late = gpu_run.run_job(failing, {}, time.monotonic() + 5, tmp_path)
    assert late["status"].startswith("not started")
    sleeper = {**failing, "name": "sleeper", "cap": 2, "command": ["timeit", "-n", "1", "import time; time.sleep(60)"]}
    assert gpu_run.run_job(sleeper, gpu_run.environment({}), until, tmp_path)["status"] == "killed at its cap"


def test_the_wheels_are_the_pins_the_gpu_image_lacks():
    wanted = {pin.split("==")[0] for pin in gpu_wheels.wanted()}
    assert {"deepspeed", "datasets", "nbclient", "nbformat", "ipykernel", "ipywidgets"} <= wanted
    assert not wanted & {"torch", "transformers", "accelerate", "numpy", "nbval"}   # the image's, or not needed
    assert gpu_wheels.missing_on_image({"numpy": "2.5", "nbformat": "5.11.1"}) == ["nbformat==5.11.1"]
    assert gpu_wheels.install_command("runs/gpu_wheels").startswith("python3 -m pip install -q --no-index --no-deps")
