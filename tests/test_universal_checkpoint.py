"""Issue 16: a run continued on another world size or ZeRO stage, through DeepSpeed's universal checkpoint.

A 2-rank ZeRO-2 run of helpers/programs/train.py saves halfway; `ds_to_universal` converts that checkpoint;
1 rank continues it with the same global batch (twice the gradient accumulation), at ZeRO 2 and at ZeRO 1,
and computes the straight run's remaining steps: the same samples, learning rates and losses.
What DeepSpeed 0.19 cannot do (ZeRO 1/2 <-> 3, a plain checkpoint on another world size) is refused up
front, naming the reason or the conversion command."""
import json
import subprocess
import sys

import pytest
import torch

from helpers import presets
from helpers.batches import ResumableBatches
from helpers.checkpoints import CheckpointMismatchError
from helpers.data import SyntheticTextDataset
from helpers.launch import flags, run_program
from helpers.programs import train

DATA = dict(seq_len=16, n_samples=64, eval_samples=16)
STEPS, HALF = 6, 3
# Measured here at ZeRO 2 and 1: 0.0, bitwise. The straight run averages two ranks' gradients, (g0 + g1) / 2;
# the continuation accumulates g0 / 2 + g1 / 2 (DeepSpeed scales each micro-batch's loss by 1/2), and halving
# is exact in floating point. Still a tolerance: the continuation runs with another thread count than the two ranks
# (OMP_NUM_THREADS), which on another CPU may change a matmul's summation order. A continuation that lost
# the optimizer state or the data position misses by far more.
TOLERANCE = 1e-5


def two_ranks(config: str, out):
    """A straight run on 2 ranks, with a checkpoint after HALF steps (returned) and at the end."""
    ranks = run_program("train", 2, out_dir=out, config=presets.CONFIG_DIR / config, save_every=HALF, steps=STEPS,
                        **DATA)
    return out / "checkpoints" / f"step{HALF}", ranks


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return two_ranks("zero2.json", tmp_path_factory.mktemp("zero2_two_ranks"))


@pytest.fixture(scope="module")
def universal(straight):
    """The halfway checkpoint converted by DeepSpeed's own command, as a reader would run it."""
    tag_dir, _ = straight
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
                    "--output_folder", f"{tag_dir}_universal", "--inject_missing_state"],
                   check=True, capture_output=True)
    return tag_dir.parent / f"{tag_dir.name}_universal"


def continue_on_one_rank(resume_from, stage: int, tmp_path, universal: bool = True) -> dict:
    """train.py on 1 rank at `stage` up to STEPS, with twice the accumulation: the straight run's global batch;
    `universal`: the config tells DeepSpeed to read ds_to_universal's output ("checkpoint.load_universal")."""
    config = json.loads((presets.CONFIG_DIR / "zero2.json").read_text())
    if universal:
        config["checkpoint"] = {"load_universal": True}
    config["zero_optimization"]["stage"] = stage
    config["gradient_accumulation_steps"] = 2 * config["gradient_accumulation_steps"]
    path = tmp_path / f"zero{stage}_one_rank.json"
    path.write_text(json.dumps(config))
    return train.main(["--config", str(path), "--steps", str(STEPS), "--output-dir", str(tmp_path / "run"),
                       "--resume-from", str(resume_from), *flags(DATA)])


@pytest.mark.parametrize("stage", [2, 1])
def test_two_rank_zero2_checkpoint_continues_on_one_rank(straight, universal, stage, tmp_path):
    _, ranks = straight
    assert_continues(ranks, continue_on_one_rank(universal, stage, tmp_path))


def test_two_rank_zero0_checkpoint_continues_on_one_rank_unconverted(tmp_path):
    """ZeRO 0 partitions nothing: its checkpoint holds the whole optimizer state and loads on any world size."""
    tag_dir, ranks = two_ranks("zero0.json", tmp_path / "two_ranks")
    assert_continues(ranks, continue_on_one_rank(tag_dir, 0, tmp_path, universal=False))


def test_a_universal_checkpoint_without_load_universal_is_refused_naming_the_key(universal, tmp_path):
    with pytest.raises(CheckpointMismatchError, match='add "checkpoint": {"load_universal": true}'):
        continue_on_one_rank(universal, 2, tmp_path, universal=False)


def assert_continues(ranks: list[dict], resumed: dict) -> None:
    rest = resumed["history"][HALF:]
    assert [m["step"] for m in rest] == list(range(HALF + 1, STEPS + 1))
    assert [m["lr"] for m in rest] == [m["lr"] for m in ranks[0]["history"][HALF:]]
    # each straight step's loss is per rank; the continuation's is the float32 mean of its two micro-batches'
    expected = [torch.tensor([a["loss"], b["loss"]]).mean().item()
                for a, b in zip(ranks[0]["history"][HALF:], ranks[1]["history"][HALF:])]
    assert [m["loss"] for m in rest] == pytest.approx(expected, abs=TOLERANCE, rel=0)
    assert [m["grad_norm"] for m in rest] == pytest.approx([m["grad_norm"] for m in ranks[0]["history"][HALF:]],
                                                          abs=TOLERANCE, rel=0)
    assert abs(rest[-1]["loss"] - rest[0]["loss"]) > 1000 * TOLERANCE   # the steps compared do train
    assert resumed["eval_loss"] == pytest.approx(ranks[0]["eval_loss"], abs=TOLERANCE, rel=0)


def test_universal_checkpoint_at_zero3_is_refused_with_deepspeeds_reason(universal, tmp_path):
    with pytest.raises(CheckpointMismatchError, match=r"zero stage: checkpoint 2, this run 3\. .*between ZeRO 1/2 "
                                                      r"and 3 on `assert len\(self\.ckpt_list\) > 0`"):
        continue_on_one_rank(universal, 3, tmp_path)


def test_plain_checkpoint_on_another_stage_and_world_size_names_the_conversion(straight, tmp_path):
    tag_dir, _ = straight
    with pytest.raises(CheckpointMismatchError, match=(
            "zero stage: checkpoint 2, this run 1; world size: checkpoint 2, this run 1. To proceed, resume with the "
            "checkpoint's settings, or, to change the ZeRO stage .* or the world size, convert it to a universal "
            "checkpoint and resume from that: python -m deepspeed.checkpoint.ds_to_universal --input_folder "
            f"{tag_dir} --output_folder {tag_dir}_universal --inject_missing_state$")):
        continue_on_one_rank(tag_dir, 1, tmp_path, universal=False)


def test_data_position_carries_over_to_another_world_size_and_micro_batch():
    data = SyntheticTextDataset("markov", n_samples=64, seq_len=16, seed=0)
    two_ranks = [ResumableBatches(data, 8, seed=0, rank=r, world_size=2) for r in (0, 1)]
    for batches in two_ranks:
        batches.next()   # step 1: samples 0-15 of the order
    one_rank = ResumableBatches(data, 4, seed=0)
    one_rank.load_state_dict(two_ranks[0].state_dict())
    assert one_rank.position == 4
    ahead = [b.next() for b in two_ranks]
    assert (one_rank.next() == ahead[0][:4]).all() and (one_rank.next() == ahead[0][4:]).all()
    assert (one_rank.next() == ahead[1][:4]).all()
    with pytest.raises(ValueError, match="2 ranks x micro_batch 8 drew 16 samples.*1 ranks x micro_batch 12 cannot"):
        ResumableBatches(data, 12, seed=0).load_state_dict(two_ranks[0].state_dict() | {"position": 1})
