"""benchmarks/gpu.py, the one command for what only a GPU runs: its plan for each GPU fits the time a borrowed
GPU machine allows, its commands parse in the programs they run, and each part's check judges real outputs."""
import copy
import json

import nbformat
import pytest

from benchmarks import gpu
from helpers import REPO_ROOT
from helpers.hardware import GPUS, MATRIX_GPUS


def test_without_a_gpu_it_says_so_and_runs_nothing(capsys):
    assert gpu.main([]) is None
    assert "no CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("name", MATRIX_GPUS)
def test_the_dry_run_prints_every_part_and_caps_below_the_budget(name, capsys, tmp_path):
    gpu.main(["--dry-run", "--gpu", name, "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    planned = gpu.parts(tmp_path, GPUS[name]["capability"], GPUS[name]["memory_gb"])
    assert len(lines) == len(planned) + 1 and all(p["name"] in line for p, line in zip(planned, lines))
    total = sum(p["cap"] for p in planned if p["command"])
    assert lines[-1] == f"sum of caps on the {name}: {total} s (budget {gpu.BUDGET_S} s)" and total < gpu.BUDGET_S
    assert not tmp_path.joinpath("summary.json").exists()   # nothing ran


def test_each_command_is_one_its_program_accepts(tmp_path):
    from benchmarks import trainer_vs_plain
    from helpers.programs import train
    from helpers.run_notebooks import NOTEBOOKS
    for part in gpu.parts(tmp_path, GPUS["H200"]["capability"], GPUS["H200"]["memory_gb"]):
        name, (module, *args) = part["name"], part["command"]
        if module == "helpers.programs.train":
            config = part.get("config") or json.loads((REPO_ROOT / train.parse(args).config).read_text())
            assert "fp16" in config or "bf16" in config, name
        elif module == "benchmarks.trainer_vs_plain":
            a = trainer_vs_plain.parse([x if x != "cuda" else "cpu" for x in args])
            assert len(trainer_vs_plain.contender_names(a)) == gpu.BENCHMARK_CONTENDERS, name
            assert a.compiled_stages and "plain-compiled" in trainer_vs_plain.contender_names(a), name
        else:
            assert module == "helpers.run_notebooks" and list(NOTEBOOKS.glob(args[1] + "*.ipynb")), name


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


def test_the_benchmark_check_reads_a_stored_run():
    stored = REPO_ROOT / "benchmarks" / "measured" / "trainer_vs_plain_compiled_cpu_2core.json"
    assert gpu.check_benchmark(stored) == []


def test_the_notebook_check_finds_a_check_cell_without_its_tick(tmp_path):
    stored = REPO_ROOT / "notebooks" / "02_dataset.ipynb"
    assert gpu.check_notebook(stored) == []
    nb = nbformat.read(stored, as_version=4)
    check = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("# Check"))
    check.outputs = []
    nbformat.write(nb, tmp_path / "broken.ipynb")
    assert gpu.check_notebook(tmp_path / "broken.ipynb") == [f"cell {nb.cells.index(check)} printed no ✓: "
                                                              f"{check.source.splitlines()[0]}"]


def test_a_skipped_part_and_a_failing_one_are_reported_and_the_rest_goes_on(tmp_path):
    skipped = {"name": "bf16", "command": None, "cap": 35, "skipped": "sm_75 has no bf16 tensor cores"}
    assert gpu.run_part(skipped, tmp_path)["status"] == "skipped: sm_75 has no bf16 tensor cores"
    stale = tmp_path / "earlier" / "rank0.json"   # an earlier run's result where this one writes
    stale.parent.mkdir()
    stale.write_text("{}")
    failing = {"name": "bad config", "cap": 60, "check": gpu.check_loss_falls, "result": stale,
               "command": ["helpers.programs.train", "--config", str(tmp_path / "missing.json")]}
    row = gpu.run_part(failing, tmp_path)
    assert row["status"] == "failed (exit 1)" and row["problems"] == ["it wrote no rank0.json"]
    text = gpu.markdown({"gpu": "a GPU", "torch": "2.x", "seconds": 1.0, "parts": [row]})
    assert "| bad config | failed (exit 1) |" in text
