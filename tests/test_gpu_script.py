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

from benchmarks import gpu, gpu_plan, gpu_prepare, gpu_run, gpu_summary, gpu_wheels
from helpers import REPO_ROOT
from helpers.hardware import GPUS, MATRIX_GPUS
from helpers.runtime import remove_stale_locks

NOTEBOOKS = sorted(p.stem for p in (REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))
BF16_GPUS = [g for g in (*MATRIX_GPUS, "H100 80GB") if GPUS[g]["capability"] >= (8, 0)]


def test_without_a_gpu_it_says_so_and_runs_nothing(capsys):
    assert gpu.main([]) is None
    assert "no CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("name", BF16_GPUS)
def test_the_plan_queues_every_notebook_once_and_fits_the_device_call(name, tmp_path):
    planned = gpu_plan.plan(tmp_path, GPUS[name]["capability"], GPUS[name]["memory_gb"])
    queued = [j for j in planned["queue"] if j["command"]]
    native = [j["name"] for j in queued if j["id"].startswith("native-")]
    t4 = [j["name"] for j in queued if j["t4"] and j["id"] != "t4-probe"]
    assert sorted(native) == NOTEBOOKS and len(NOTEBOOKS) == 10
    assert sorted(n[:2] for n in t4) == sorted(gpu_plan.T4_NOTEBOOKS) and all(n.endswith(" (T4)") for n in t4)
    simulated = [t for lane in planned["lanes"] for t in lane["simulated"]]
    assert sorted(t["job"]["id"] for t in simulated) == sorted(j["id"] for j in queued)   # each once, in one lane
    short = {t["job"]["name"]: t["granted"] for t in simulated if t["granted"] < t["job"]["cap"]}
    assert not short, (f"jobs the {planned['lanes_cap']} s phase cannot give their caps: {short}; each cap is "
                       f"{gpu_plan.MARGIN} x a GPU estimate from the stored CPU seconds {gpu_plan.stored_seconds()}: was "
                       "one stored on a loaded machine? Re-store it alone (python -m helpers.run_notebooks --only NN "
                       "--in-place)")
    assert all(t["start"] + t["job"]["cap"] <= planned["lanes_cap"] for t in simulated)
    assert gpu_plan.caps_total(planned) <= gpu_plan.BUDGET_S <= 540   # the install, prepare, lanes, benchmark, the last write
    assert planned["benchmark"]["command"]
    assert planned["most_threads"] <= planned["cores"] == 16 and planned["threads"] * 2 * len(planned["lanes"]) <= 16
    t4_env = next(j["env"] for j in queued if j["t4"])
    assert t4_env["PYTHONPATH"].split(os.pathsep)[0] == str(gpu_plan.T4_SITE) and t4_env["TUTORIAL_PRECISION"] == "fp16"
    assert all(j["env"]["OMP_NUM_THREADS"] == str(planned["threads"]) for j in queued)
    assert len({j["env"]["TUTORIAL_RUN_DIR"] for j in queued}) == len(queued)   # a T4 03 never resumes the native one's


@pytest.mark.parametrize("gpu_name, shown", [("H100", "H100 80GB"), ("H200", "H200")])
def test_the_dry_run_prints_the_plan(gpu_name, shown, capsys, tmp_path):
    gpu.main(["--dry-run", "--gpu", gpu_name, "--work", str(tmp_path), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    lanes = [line for line in out.splitlines() if line.startswith("  lane-")]
    assert all(stem in out for stem in NOTEBOOKS) and len(lanes) == gpu_plan.LANES
    assert sum(line.count(" (T4) ") for line in lanes) == len(gpu_plan.T4_NOTEBOOKS)
    assert "python -m benchmarks.gpu_benchmark --precision bf16 --micro-batch 16" in out
    assert "OMP_NUM_THREADS=1" in out and "--started $T0" in out and "--no-compile" in out
    total = gpu_plan.caps_total(gpu_plan.plan(tmp_path, (9, 0), GPUS[shown]["memory_gb"]))
    assert out.splitlines()[-1] == f"total on the {shown}: {total} s (budget {gpu_plan.BUDGET_S} s, the install included)"
    assert not any(tmp_path.iterdir())   # nothing ran


def test_a_job_starts_only_where_its_ranks_fit_the_cores():
    two, four, one = ({"name": n, "ranks": r, "cap": 60, "command": ["x"]} for n, r in (("a", 2), ("b", 4), ("c", 1)))
    assert gpu_plan.pick([four, one], running=14, threads=1, cores=16) is one   # 4 more ranks would not fit
    assert gpu_plan.pick([four, one], running=12, threads=1, cores=16) is four
    assert gpu_plan.pick([four], running=0, threads=8, cores=16) is four   # alone, a job always may
    assert gpu_plan.pick([four], running=2, threads=8, cores=16) is None
    lanes = gpu_plan.simulate([two, four, one], lanes=2, phase_s=200, threads=1, cores=4)
    starts = {t["job"]["name"]: t["start"] for lane in lanes for t in lane}
    assert starts == {"a": 0, "c": 0, "b": 60}   # b waits for room; c, later in the queue, goes first
    queue = gpu_run.Queue([two, four, one], lanes=2, phase_end=float("inf"), threads=1, cores=4)
    assert queue.take()[0] is two and queue.take()[0] is one
    queue.done(two)
    queue.done(one)
    assert queue.take()[0] is four and queue.take() is None


def test_a_job_is_granted_its_cap_and_what_the_queue_will_not_need():
    assert gpu_plan.granted(100, left=300, queued_caps=400, lanes=2) == 100   # the queue needs every second
    assert gpu_plan.granted(100, left=300, queued_caps=200, lanes=2) == 200   # 100 s to spare: this job may use them
    assert gpu_plan.granted(100, left=80, queued_caps=0, lanes=2) == 80       # never past the phase's end
    assert gpu_plan.granted(30, left=150, queued_caps=0, lanes=7) == 150      # the last one taken: the rest


def test_each_job_stops_itself_within_what_it_is_granted(tmp_path):
    planned = gpu_plan.plan(tmp_path, (9, 0), 80)
    notebook = planned["queue"][1]
    command, timeout = gpu_run.own_command(notebook, 100)
    assert command[command.index("--cap") + 1] == str(100 - gpu_plan.GRACE_S) and timeout == 100
    command, timeout = gpu_run.own_command(planned["benchmark"], 200)
    assert command[command.index("--deadline-s") + 1] == str(200 - gpu_plan.BENCHMARK_END_S) and timeout == 200


def test_on_a_t4_the_native_jobs_are_the_t4_and_no_benchmark_fits(capsys, tmp_path):
    gpu.main(["--dry-run", "--gpu", "T4", "--work", str(tmp_path)])
    out = capsys.readouterr().out
    assert "T4 emulation skipped" in out and "bf16 skipped" in out
    assert f"benchmark, eager and compiled      cap {gpu_plan.BENCHMARK_CAP:>5} s   skipped" in out


def test_each_command_is_one_its_program_accepts(tmp_path):
    from benchmarks import gpu_benchmark
    from helpers import run_notebooks
    from helpers.programs import train
    for part in gpu_plan.parts(tmp_path, GPUS["H200"]["capability"], GPUS["H200"]["memory_gb"]):
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
    list) and the precision the rule picks from it. The memory cap needs CUDA to start: not checked here. A T4
    lacks flash and cuDNN attention (sm_80+) but runs the memory-efficient kernel and the math one."""
    probe = ("import torch, os\nfrom helpers.precision import choose_precision, forced_precision\n"
             "p = torch.cuda.get_device_properties(0)\ncap = (p.major, p.minor)\nb = torch.backends.cuda\n"
             "print(torch.cuda.get_device_capability(), torch.cuda.is_bf16_supported(), cap, p.total_memory < 16e9,"
             " b.flash_sdp_enabled(), b.cudnn_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(),"
             " os.environ['TORCH_CUDA_ARCH_LIST'], choose_precision(cap)[0], forced_precision('cuda', cap))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(gpu_plan.T4_SITE), str(REPO_ROOT)]),
           "TUTORIAL_PRECISION": "fp16"}
    env.pop("TORCH_CUDA_ARCH_LIST", None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["(7,", "5)", "False", "(7,", "5)", "True", "False", "False", "True", "True", "7.5+PTX",
                           "fp16", "fp16"]


def test_the_probe_check_wants_every_answer_a_t4_gives(tmp_path):
    probe = tmp_path / "probe.json"
    t4 = {"capability": [7, 5], "bf16 supported": False, "precision": "fp16", "flash sdp": False, "cudnn sdp": False,
          "mem-efficient sdp": True, "16 GB allocated": False}
    probe.write_text(json.dumps(t4))
    assert gpu_prepare.check_t4_probe(probe) == []
    probe.write_text(json.dumps(t4 | {"capability": [9, 0], "mem-efficient sdp": False}))   # the old, wrong emulation
    assert gpu_prepare.check_t4_probe(probe) == ["capability: [9, 0], a T4 gives [7, 5]",
                                                 "mem-efficient sdp: False, a T4 gives True"]


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
    row = {"lane": "lane-2", "name": "03_trainer (T4)", "cap": 109, "granted": 120, "seconds": 80.0,
           "log": str(log)} | gpu_run.judge(job, 0, log)
    assert row["status"] == "ran, 1 cells failed" and row["problems"] == ["cell 1: ValueError: no GPU memory left"]
    prepare = {"TORCH_CUDA_ARCH_LIST": "9.0", "stale locks removed": [], "seconds": 50.0, "facts": {"GPU": "H100"},
               "ops": {"CPUAdamBuilder": "deepspeed.ops.op_builder.cpu.cpu_adam built in 40 s"}}
    packages = {"packages": {"peft": {"pin": "0.21.2", "installed": "0.17.0", "floor": "0.18", "from": "image"}},
                "problems": ["peft 0.17.0 is older than 0.18, which the helpers need: pip install -U 'peft>=0.18'"]}
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gpu_benchmark.md").write_text("| contender | tokens/s |\n| plain | 1,000 |")   # its own
    files = gpu_summary.write(tmp_path / "out", {"seconds": 100.0, "deadline_s": 540, "parts": [row],
                                                 "prepare": prepare, "packages": packages})
    assert len(files) + 2 <= gpu_summary.MAX_FILES == 8
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "| lane-2 | 03_trainer (T4) | ran, 1 cells failed | 80 | 109 (120) | 2/3 | 1 | 1 |" in text
    assert "| peft | 0.17.0 | image | 0.21.2 | 0.18 |" in text and "- package problem: peft 0.17.0 is older" in text
    assert "## Benchmark" in text and "| plain | 1,000 |" in text
    assert "`ValueError: no GPU memory left`" in text and "raise ValueError('no GPU memory left')" in text
    assert gpu_summary.T4_NOT_PROVEN in text and "done in 80 s" in (tmp_path / "out" / "logs.txt").read_text()
    assert "TORCH_CUDA_ARCH_LIST=9.0" in text and "CPUAdamBuilder deepspeed.ops.op_builder.cpu.cpu_adam built" in text


def test_the_forced_fp16_overflow_starts_the_scale_where_a_loss_overflows_fp16():
    config = gpu_plan.fp16_overflow_config()
    assert config["fp16"]["loss_scale"] == 0   # dynamic
    assert 2.0 ** config["fp16"]["initial_scale_power"] * 4.0 > 65504   # a loss of 4 times the scale: past fp16's max


def test_the_checks_judge_a_real_training_run(tmp_path):
    from helpers.programs import train
    train.main(["--config", "configs/zero0.json", "--seq-len", "16", "--n-samples", "256", "--eval-samples", "16",
                "--steps", "12", "--out", str(tmp_path / "run")])
    result = tmp_path / "run" / "rank0.json"
    assert gpu_plan.check_loss_falls(result) == []
    run = json.loads(result.read_text())
    flat = copy.deepcopy(run)
    for m in flat["history"]:
        m["loss"] = 5.0
    fp16 = copy.deepcopy(run)   # as an fp16 run that never overflowed would write it
    for m in fp16["history"]:
        m["loss_scale"] = 2.0 ** gpu_plan.FP16_OVERFLOW_POWER
    for name, data in (("flat", flat), ("fp16", fp16)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    assert gpu_plan.check_loss_falls(tmp_path / "flat.json") == ["the loss did not fall: first five steps 5.000, last five 5.000"]
    assert gpu_plan.check_fp16(tmp_path / "fp16.json") == [
        f"no step was skipped, though the scale started at 2**{gpu_plan.FP16_OVERFLOW_POWER}",
        f"the loss scale never moved from 2**{gpu_plan.FP16_OVERFLOW_POWER}"]


def test_a_skipped_part_and_a_failing_one_are_reported(tmp_path, monkeypatch):
    skipped = {"name": "bf16", "command": None, "cap": 35, "skipped": "no bf16 tensor cores below sm_80"}
    assert gpu_run.run_job(skipped, {}, 60, tmp_path)["status"] == "skipped: no bf16 tensor cores below sm_80"
    stale = tmp_path / "earlier" / "rank0.json"   # an earlier run's result where this one writes
    stale.parent.mkdir()
    stale.write_text("{}")
    failing = {"id": "bad", "name": "bad flag", "cap": 60, "check": gpu_plan.check_loss_falls, "result": stale,
               "command": ["benchmarks.gpu_wheels", "--no-such-flag"]}   # argparse refuses it: exit 2, at once
    row = gpu_run.run_job(failing, gpu_run.environment({}), 60, tmp_path, "lane-1")
    assert row["status"] == "failed (exit 2)" and row["problems"] == ["it wrote no rank0.json"] and not stale.exists()
    late = gpu_run.run_job(failing, {}, 5, tmp_path)
    assert late["status"].startswith("not started")
    sleeper = {**failing, "id": "sleeper", "command": ["timeit", "-n", "1", "import time; time.sleep(60)"]}
    monkeypatch.setattr(gpu_plan, "MIN_START_S", 1)   # granted 2 s: started, and killed when they are up
    assert gpu_run.run_job(sleeper, gpu_run.environment({}), 2, tmp_path)["status"] == "killed at its cap"


def test_the_wheels_are_chosen_by_version():
    wanted = {pin.split("==")[0]: pin.split("==")[1] for pin in gpu_wheels.wanted()}
    assert {"deepspeed", "datasets", "nbclient", "nbformat", "ipykernel", "ipywidgets"} <= set(wanted)
    assert wanted["transformers"] == gpu_wheels.pins()["transformers"] != gpu_wheels.IMAGE_VERSIONS["transformers"]
    assert "peft" in wanted   # its version on the image was never read: carried as pinned
    assert not set(wanted) & {"torch", "numpy", "pyarrow", "nbval", "accelerate"}   # kept, or the image's is the pin
    resolved = {"numpy": "2.4.6", "nbformat": "5.11.1", "huggingface-hub": "2.5.0", "regex": "2026.1.1",
                "safetensors": "0.8.0"}
    assert gpu_wheels.to_carry(resolved, {"nbformat"}) == ["huggingface-hub==2.5.0", "nbformat==5.11.1"]
    assert gpu_wheels.install_command("runs/gpu_wheels").startswith(
        "python3 -m pip install -q --no-index --no-deps --no-compile")


def test_the_installed_packages_are_checked_against_pins_floors_and_requirements():
    check = gpu_wheels.installed_check()   # this venv: every pin installed, as requirements.txt says
    rows = check["packages"]
    assert rows["datasets"]["installed"] == rows["datasets"]["pin"] and rows["peft"]["floor"] == "0.18"
    assert not any("older than" in p for p in check["problems"]), check["problems"]
    assert gpu_wheels.unmet_requirements("datasets") == []
