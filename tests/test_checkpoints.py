"""Faults (issue 8): a crash in the middle of a save leaves the previous checkpoint as the one resume
picks; incomplete, unreadable or mis-pointed checkpoints raise clear errors; a NaN loss stops
training naming the step. Issue 16: a checkpoint written with another model, ZeRO stage, world size or
precision is refused before anything is loaded, naming each difference and the way on."""
import pytest
import torch

from helpers.checkpoints import (CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError,
                                 find_checkpoint, write_latest)
from helpers.data import SyntheticTextDataset
from tests.trainers import make_trainer


@pytest.fixture(scope="module")
def data():
    return SyntheticTextDataset("markov", n_samples=128, seq_len=32, seed=0)


def make(data, path, **kw):
    return make_trainer(data, **{"zero_stage": 1, "micro_batch": 4, "warmup_steps": 2, "total_steps": 20,
                                 "output_dir": path, **kw})


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """A run with a good checkpoint at step 2, whose save at step 4 crashed while writing optimizer state."""
    path = tmp_path_factory.mktemp("crash")
    trainer = make(data, path)
    trainer.train(2, progress=False)
    good = trainer.save_checkpoint(path / "ckpt")
    trainer.train(2, progress=False)
    real_save = torch.save

    def crash_on_optimizer_state(obj, f, *args, **kwargs):
        if "optim_states" in str(f):
            raise OSError("disk full (simulated crash mid-save)")
        return real_save(obj, f, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "save", crash_on_optimizer_state)
        with pytest.raises(OSError, match="simulated"):
            trainer.save_checkpoint(path / "ckpt")
    trainer.engine.destroy()
    return path / "ckpt", good


def test_crash_mid_save_leaves_the_previous_checkpoint_as_latest(saved, data, tmp_path):
    directory, good = saved
    assert (directory / "step4").is_dir()                      # the broken save left files behind
    assert find_checkpoint(directory, 1, 1) == good             # ... but `latest` still names step 2
    resumed = make(data, tmp_path, resume_from=directory)
    assert resumed.step == 2 and resumed.batches.position == 2
    resumed.engine.destroy()


def test_incomplete_checkpoint_is_refused_naming_the_missing_file(saved):
    directory, _ = saved
    write_latest(directory, "step4")
    try:
        with pytest.raises(CheckpointNotFoundError, match="incomplete, missing.*optim_states.*available"):
            find_checkpoint(directory, 1, 1)
    finally:
        write_latest(directory, "step2")


@pytest.mark.parametrize("content", ["", "../elsewhere"])
def test_latest_that_names_no_tag_is_refused(tmp_path, content):
    (tmp_path / "latest").write_text(content)
    with pytest.raises(CheckpointNotFoundError, match="not a checkpoint tag"):
        find_checkpoint(tmp_path)


def test_unreadable_checkpoint_raises_a_corrupt_error_before_training(saved, data, tmp_path):
    directory, good = saved
    broken = tmp_path / "ckpt"
    broken.mkdir()
    (broken / "step2").mkdir()
    for f in good.iterdir():
        (broken / "step2" / f.name).write_bytes(f.read_bytes()[: f.stat().st_size // 2])   # truncated copies
    write_latest(broken, "step2")
    with pytest.raises(CheckpointCorruptError, match="could not be read.*truncated or corrupt"):
        make(data, tmp_path / "run", resume_from=broken)


def test_nan_loss_stops_training_naming_the_step(data, tmp_path):
    trainer = make(data, tmp_path)
    trainer.train(1, progress=False)
    with torch.no_grad():
        trainer.engine.module.transformer.wte.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="loss became nan at step 2"):
        trainer.train(1, progress=False)
    trainer.engine.destroy()


PROGRAM = "tests.rank_programs.crash_mid_save"


@pytest.fixture(scope="module")
def two_rank_crash(tmp_path_factory):
    """Two ranks at ZeRO 1 (the model and data of `make`): a complete checkpoint at step 2, then a save
    at step 4 in which rank 1 dies writing its optimizer partition."""
    from helpers.launch import RankFailedError, launch
    path = tmp_path_factory.mktemp("two_ranks")
    with pytest.raises(RankFailedError):
        launch(PROGRAM, 2, ["--phase=crash"], out_dir=path / "crash", timeout=300)
    return path


def test_two_ranks_crash_mid_save_leaves_latest_on_the_complete_checkpoint(two_rank_crash):
    """Rank 1 dies writing its optimizer partition while rank 0 has finished its files. DeepSpeed's own
    save would let rank 0 switch `latest` to the broken checkpoint; ours waits for every rank."""
    from helpers.launch import launch
    checkpoints = two_rank_crash / "checkpoints"
    assert (checkpoints / "step4").is_dir()                                    # the broken save began
    assert find_checkpoint(checkpoints, 1, 2) == checkpoints / "step2"         # `latest` did not move
    with pytest.raises(CheckpointNotFoundError, match="incomplete.*zero_pp_rank_1"):
        write_latest(checkpoints, "step4")
        find_checkpoint(checkpoints, 1, 2)
    write_latest(checkpoints, "step2")
    resumed = launch(PROGRAM, 2, ["--phase=resume"], out_dir=two_rank_crash / "resume", timeout=300)
    assert [(r["step"], r["position"]) for r in resumed] == [(2, 2), (2, 2)]


# ---- issue 16: a checkpoint written with other settings than the run's ----

@pytest.fixture(scope="module")
def zero0_checkpoint(data, tmp_path_factory):
    path = tmp_path_factory.mktemp("zero0")
    trainer = make(data, path, zero_stage=0, precision="fp32")
    trainer.train(1, progress=False)
    trainer.save_checkpoint(path / "ckpt")
    trainer.engine.destroy()
    return path / "ckpt"


def test_other_model_shape_is_a_mismatch_not_a_corrupt_file(saved, data, tmp_path):
    directory, good = saved
    with pytest.raises(CheckpointMismatchError, match=r"model shape: \d+ parameters differ, e\.g\. transformer\.wte"
                       r"\.weight: checkpoint \(\d+, 128\), this run \(\d+, 256\).*model_size"):
        make(data, tmp_path, model_size="small", resume_from=directory)


def test_complete_zero0_checkpoint_at_zero2_is_a_mismatch_not_incomplete(zero0_checkpoint, data, tmp_path):
    with pytest.raises(CheckpointMismatchError, match="zero stage: checkpoint 0, this run 2.*resume with the "
                                                      "checkpoint's settings.*ZeRO-0.*can't find") as err:
        make(data, tmp_path, zero_stage=2, precision="fp32", resume_from=zero0_checkpoint)
    assert "incomplete" not in str(err.value) and "\n" not in str(err.value)   # one line, for a CLI's error


def test_fp32_checkpoint_as_bf16_is_a_mismatch(zero0_checkpoint, data, tmp_path):
    tag_dir = zero0_checkpoint / "step1"
    with pytest.raises(CheckpointMismatchError, match=f"{tag_dir} was written with other settings than this run's: "
                                                      "precision: checkpoint fp32, this run bf16. To proceed, resume "
                                                      "with the checkpoint's settings$"):
        make(data, tmp_path, zero_stage=0, precision="bf16", resume_from=zero0_checkpoint)


def test_two_rank_checkpoint_on_one_rank_is_a_mismatch_naming_the_conversion(two_rank_crash, data, tmp_path):
    checkpoints = two_rank_crash / "checkpoints"
    write_latest(checkpoints, "step2")
    tag_dir = checkpoints / "step2"
    with pytest.raises(CheckpointMismatchError, match="world size: checkpoint 2, this run 1.*python -m "
                       f"deepspeed.checkpoint.ds_to_universal --input_folder {tag_dir} --output_folder "
                       f"{tag_dir}_universal --inject_missing_state"):
        make(data, tmp_path, resume_from=checkpoints)
