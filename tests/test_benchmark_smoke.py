"""benchmarks.trainer_vs_plain end to end at toy sizes (--smoke): it runs, writes its JSON and table, and
the plain loop, the DeepSpeed trainer and HF Trainer do the same math. No timing is asserted: this box
is shared and noisy, and the smoke sizes say nothing about speed. The compiled contenders are left out
(--compiled-stages with no stage): they are the trainer's compile=True, which tests/test_compile.py and
notebook 03's section 7 check against eager, and compiling two more processes cost CI about 40 s."""
import json

import pytest

from benchmarks.trainer_vs_plain import contender_names, main, parse
from helpers.model import build_model


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "result.json"
    returned = main(["--smoke", "--compiled-stages", "--device", "cpu", "--out", str(out), "--work-dir", str(out.parent / "work")])
    return returned, json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_it_writes_every_contender_with_its_numbers(result):
    returned, saved, table = result
    assert list(saved["contenders"]) == ["plain", "ds0", "hf0"]
    assert returned["contenders"]["ds0"]["final_loss"] == saved["contenders"]["ds0"]["final_loss"]
    steps = saved["config"]["steps"] * (saved["config"]["rounds"] + 1)   # warm-up block + rounds
    for name, row in saved["contenders"].items():
        assert len(row["losses"]) == steps, name
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"], name
        assert row["peak_memory_mb"] >= row["baseline_memory_mb"] > 0 and row["state_mb"] > 0, name
        assert f"| {name} |" in table
    assert saved["contenders"]["ds0"]["vs_hf_same_stage"] is not None
    assert not saved["compiled"]


def test_contenders_do_the_same_math(result):
    _, saved, _ = result
    rows = saved["contenders"]
    for name in ("ds0", "hf0"):
        assert abs(rows[name]["losses"][0] - rows["plain"]["losses"][0]) < 1e-5, name   # same init, same batch
        assert rows[name]["max_loss_diff_all_steps"] < 1e-3, name
        assert rows[name]["max_lr_diff"] < 1e-12, name   # the same warm-up/decay schedule, step for step
    assert saved["first_losses_agree"]
    assert rows["plain"]["losses"][-1] < rows["plain"]["losses"][0]   # it trains


def test_flops_per_token_counts_the_models_own_parameters(result):
    """6N + 12 n_layer d seq_len, with N counted from the model itself (position embeddings do no matmul)."""
    _, saved, _ = result
    c = saved["config"]
    model = build_model(saved["vocab_size"], c["seq_len"], c["model_size"])
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    assert saved["n_params_matmul"] == n
    assert saved["flops_per_token"] == 6 * n + 12 * model.config.n_layer * model.config.n_embd * c["seq_len"]


def test_trainer_and_hf_of_a_stage_run_back_to_back():
    a = parse(["--device", "cpu", "--stages", "0", "1", "2", "3", "--hf-stages", "0", "1", "2"])
    assert contender_names(a) == ["plain", "plain-compiled", "plain-kept", "ds0", "hf0", "ds0-compiled", "hf0-compiled", "ds1",
                                  "hf1", "ds1-compiled", "ds2", "hf2", "ds2-compiled", "ds3", "plain2"]


def test_step_phases_split_each_step_into_parts_that_add_up(tmp_path):
    from benchmarks.step_phases import PHASES
    from benchmarks.step_phases import main as phases
    result = phases(["--stages", "0", "--steps", "2", "--model-size", "tiny", "--seq-len", "32",
                     "--micro-batch", "4", "--n-words", "128", "--out-dir", str(tmp_path)])
    assert set(result[0]) == {"plain", "ds0"}
    for name, row in result[0].items():
        assert set(row) == {*PHASES, "speed_vs_plain"}, name
        assert row["forward"] > 0 and row["backward"] > 0 and row["step"] > 0 and row["rest"] >= 0, name
        assert row["total"] >= row["forward"] + row["backward"] - 1e-6, name   # the parts sit inside the step
    assert result[0]["ds0"]["speed_vs_plain"] > 0


def test_a_compiled_contender_without_its_eager_twin_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["--device", "cpu", "--stages", "0", "--compiled-stages", "0", "2"])
    assert "--compiled-stages 0 2: add [2] to --stages too" in capsys.readouterr().err
