"""helpers/programs/train.py: the trainer as a script on 2 CPU ranks under torchrun and the deepspeed launcher,
with metrics, TensorBoard logs and checkpoints; the 2-rank ZeRO-3 checkpoint exported to HF."""
import json
import os
import subprocess
import sys
from pathlib import Path

import deepspeed
import pytest
import torch
from transformers import pipeline

from helpers import presets
from helpers.launch import run_program
from helpers.programs import train
from helpers.config import micro_batch_of
from helpers.errors import ConfigError
from helpers.export import read_tensorboard
from helpers.runtime import detect

SMALL = dict(seq_len=16, n_samples=64, eval_samples=16, steps=4)   # eval: one batch of 16 = all held-out samples


@pytest.fixture(scope="module")
def torchrun_zero3(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun_zero3")
    return out, run_program("train", 2, out_dir=out, config=presets.CONFIG_DIR / "zero3.json", save_every=2, **SMALL)


@pytest.fixture(scope="module")
def deepspeed_zero2(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed_zero2")
    return out, run_program("train", 2, out_dir=out, launcher="deepspeed", config=presets.CONFIG_DIR / "zero2.json", **SMALL)


def test_two_ranks_train_one_model(torchrun_zero3):
    _, ranks = torchrun_zero3
    assert [(r["rank"], r["world_size"], r["steps"]) for r in ranks] == [(0, 2, 4), (1, 2, 4)]
    assert [m["step"] for m in ranks[0]["history"]] == [1, 2, 3, 4]
    assert ranks[0]["eval_loss"] == ranks[1]["eval_loss"]          # one model, whichever rank asks
    assert ranks[0]["history"][0]["loss"] != ranks[1]["history"][0]["loss"]   # each rank its own shard


def test_rank0_writes_metrics_json(torchrun_zero3):
    out, ranks = torchrun_zero3
    assert json.loads((out / "metrics.json").read_text()) == json.loads(json.dumps(ranks[0]))


def test_checkpoints_every_k_steps_with_a_partition_per_rank(torchrun_zero3):
    out, ranks = torchrun_zero3
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step4" and ranks[0]["checkpoint"].endswith("step4")
    for tag in ("step2", "step4"):
        assert sorted(p.name for p in (checkpoints / tag).glob("*optim_states.pt")) == [
            "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert (checkpoints / "config.json").is_file() and (checkpoints / "tokenizer.json").is_file()


def test_tensorboard_logs_hold_rank0_metrics(torchrun_zero3):
    _, ranks = torchrun_zero3
    steps, losses = read_tensorboard(ranks[0]["tensorboard"])["train/loss"]
    assert steps == [1, 2, 3, 4]
    assert losses == pytest.approx([m["loss"] for m in ranks[0]["history"]], rel=1e-6)   # stored as float32


def test_two_rank_zero3_checkpoint_exports_to_hf(torchrun_zero3, tmp_path):
    """Export from the files alone; the HF model's held-out loss is the engine's, and it generates."""
    from transformers import AutoModelForCausalLM

    from helpers import export
    from helpers.data import SyntheticTextDataset
    out, ranks = torchrun_zero3
    hf_dir = export.export_hf(out / "checkpoints", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    model.loss_type = "ForCausalLM"   # as helpers.model.build_model does: GPT-2's class name maps to no loss
    tokenizer = SyntheticTextDataset("markov", n_samples=64, seq_len=16, seed=0).tokenizer
    held_out = SyntheticTextDataset("markov", n_samples=16, seq_len=16, seed=1, tokenizer=tokenizer)   # train.py's
    with torch.no_grad():
        ids = torch.stack([held_out[i]["input_ids"] for i in range(len(held_out))])
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss == pytest.approx(ranks[0]["eval_loss"], abs=1e-5)   # measured: 9.5e-07 (summation order)
    prompt = " ".join(held_out.texts[0].split()[:3])
    generator = pipeline("text-generation", model=str(hf_dir), tokenizer=str(hf_dir))
    text = generator(prompt + " ", max_new_tokens=5, do_sample=True, top_k=0,
                     suppress_tokens=[generator.tokenizer.pad_token_id])[0]["generated_text"]
    assert len(text.split()) == 3 + 5


def test_deepspeed_launcher_trains_the_same_model(deepspeed_zero2, torchrun_zero3):
    """Same seed and data: ZeRO-2 under `deepspeed` and ZeRO-3 under torchrun compute the same run."""
    _, ds_ranks = deepspeed_zero2
    _, tr_ranks = torchrun_zero3
    assert [(r["rank"], r["world_size"], r["steps"]) for r in ds_ranks] == [(0, 2, 4), (1, 2, 4)]
    for ds, tr in zip(ds_ranks, tr_ranks):
        assert [m["loss"] for m in ds["history"]] == pytest.approx([m["loss"] for m in tr["history"]], abs=1e-5)
    assert ds_ranks[0]["eval_loss"] == pytest.approx(tr_ranks[0]["eval_loss"], abs=1e-5)   # measured: identical


def test_resume_continues_the_run(tmp_path, capsys):
    common = ["--config", str(presets.CONFIG_DIR / "zero0.json"), "--seq-len", "16", "--n-samples", "64",
              "--eval-samples", "16"]
    first = train.main(common + ["--steps", "2", "--output-dir", str(tmp_path / "a")])
    assert f"metrics:     {tmp_path / 'a' / 'metrics.json'}" in capsys.readouterr().out
    resumed = train.main(common + ["--steps", "3", "--output-dir", str(tmp_path / "b"),
                                   "--resume-from", str(tmp_path / "a" / "checkpoints")])
    assert [m["step"] for m in resumed["history"]] == [1, 2, 3]
    assert resumed["history"][:2] == first["history"]
    assert resumed["checkpoint"] == str(tmp_path / "b" / "checkpoints" / "step3")


# ---- the file is the config: handed to the trainer as written ----

@pytest.mark.parametrize("name", ["zero2", "zero3_offload", "bf16"])
def test_the_file_reaches_the_engine_as_written(name, tmp_path):
    """Every key of the file is in the config the engine ran, unchanged; only the tensorboard block is the script's."""
    if name == "bf16" and detect().precision != "bf16":
        pytest.skip("this CPU trains in fp32 (the precision rule)")
    config = presets.preset(name) | {"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 1, "total_num_steps": 2}}}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    result = train.main(["--config", str(path), "--seq-len", "16", "--n-samples", "64", "--eval-samples", "16",
                         "--output-dir", str(tmp_path / "run")])
    saved = torch.load(next(Path(result["checkpoint"]).glob("*model_states.pt")), weights_only=False)["ds_config"]
    assert {k: v for k, v in saved.items() if k != "tensorboard"} == config
    assert saved["tensorboard"]["output_path"] == str(tmp_path / "run" / "tensorboard")


def test_micro_batch_from_train_batch_size_and_world_size():
    config = {k: v for k, v in presets.preset("zero2").items() if k != "train_micro_batch_size_per_gpu"}
    assert micro_batch_of({**config, "train_batch_size": 64}, world_size=2) == 32
    with pytest.raises(ConfigError, match="not a multiple"):
        micro_batch_of({**config, "train_batch_size": 63}, world_size=2)


@pytest.mark.parametrize("change, problem", [
    ({"pipeline": {}}, "PipelineModule"),
    ({"scheduler": None}, "no scheduler.params.total_num_steps in the file to train to: pass --steps"),
])
def test_files_the_script_cannot_run_are_refused(change, problem, tmp_path, monkeypatch):
    monkeypatch.setattr(deepspeed, "initialize", lambda *a, **k: pytest.fail("an engine was built"))
    config = {k: v for k, v in {**presets.preset("zero2"), **change}.items() if v is not None}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=problem):
        train.main(["--config", str(path), "--seq-len", "16", "--n-samples", "64", "--output-dir", str(tmp_path)])


def test_fp16_file_on_cpu_stops_before_the_engine(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU runs fp16")
    monkeypatch.setattr(deepspeed, "initialize", lambda *a, **k: pytest.fail("engine built for fp16 on a CPU"))
    with pytest.raises(ConfigError, match="fp16.enabled is true but this device is a CPU"):
        train.main(["--config", str(presets.CONFIG_DIR / "fp16.json"), "--seq-len", "16", "--n-samples", "64",
                    "--output-dir", str(tmp_path)])


def test_deepspeed_launchers_local_rank_flag_is_accepted():
    assert train.parse(["--config", "c.json", "--local_rank=1"]).config == "c.json"
    with pytest.raises(SystemExit):
        train.parse(["--config", "c.json", "--steps", "0"])


def test_missing_config_is_named_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="nope.json not found"):
        run_program("train", 2, out_dir=tmp_path / "never", config="configs/nope.json")
    assert not (tmp_path / "never").exists()


def test_a_config_deepspeed_would_refuse_stops_before_any_rank_starts(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({**presets.preset("zero2"), "zero_optimization": {"stage": 2, "overlap_com": True}}))
    with pytest.raises(ConfigError, match=r"'zero_optimization.overlap_com' \(did you mean 'overlap_comm'\?\)"):
        run_program("train", 2, out_dir=tmp_path / "never", config=path)
    assert not (tmp_path / "never").exists()


# ---- a mistake in the input is one line on stderr and a non-zero exit, never a traceback (issue 16) ----

def run_script(*args: str, cwd) -> subprocess.CompletedProcess:
    from helpers import with_repo_on_path
    return subprocess.run([sys.executable, "-m", "helpers.programs.train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=with_repo_on_path(dict(os.environ)), check=False)


@pytest.mark.parametrize("write, extra, message", [
    (lambda p: p.write_text('{"train_batch_size": 8,\n "zero_optimization": {"stage": 2,}}'), [],
     "bad.json, line 2 column 35: not valid JSON"),
    (lambda p: p.write_text(""), [], "bad.json is empty"),
    (lambda p: p.write_text(json.dumps({**presets.preset("zero2"), "zero_optimization": {"stag": 2}})), [],
     "unknown key 'zero_optimization.stag' (did you mean 'stage'?)"),
    (lambda p: p.write_text(json.dumps(presets.preset("zero2"))), ["--resume-from", "no/such/dir"],
     "no DeepSpeed checkpoint in no/such/dir"),
])
def test_bad_input_is_one_line_and_exit_status_1(tmp_path, write, extra, message):
    write(tmp_path / "bad.json")
    done = run_script("--config", str(tmp_path / "bad.json"), "--output-dir", str(tmp_path / "out"), *extra, cwd=tmp_path)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert len(errors) == 1 and message in errors[0], done.stderr


def test_resume_with_other_settings_is_one_line_naming_the_difference(tmp_path):
    common = ["--seq-len", "16", "--n-samples", "64", "--eval-samples", "16", "--steps", "1"]
    train.main(["--config", str(presets.CONFIG_DIR / "zero1.json"), "--output-dir", str(tmp_path / "a"), *common])
    done = run_script("--config", str(presets.CONFIG_DIR / "zero0.json"), "--output-dir", str(tmp_path / "b"),
                      "--resume-from", str(tmp_path / "a" / "checkpoints"), *common, cwd=tmp_path)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert len(errors) == 1 and "zero stage: checkpoint 1, this run 0" in errors[0], done.stderr
