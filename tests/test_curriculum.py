"""Sequence-length curriculum: DeepSpeed's CurriculumScheduler against the documented formulas, the
batch cut to the scheduled length, the data for equal token budgets, and the verdict. (Notebook 06 runs
the training loop itself and checks the lengths and token budgets of a real run.)"""
import math

import pytest
import torch

from helpers.topics.curriculum import (check_schedule, lengths_over_steps, make_scheduler, rows_per_step,
                                       train_and_heldout, tokens_to_reach, truncate, verdict)


def seqlen_schedule(min_len: int = 16, max_len: int = 64, total_curriculum_step: int = 30,
                    difficulty_step: int = 16, schedule_type: str = "fixed_linear", root_degree: int = 2) -> dict:
    """A CurriculumScheduler config for the sequence-length metric (the keys of DeepSpeed's
    `curriculum_metrics.<metric>` block), checked."""
    schedule = {"min_difficulty": min_len, "max_difficulty": max_len, "schedule_type": schedule_type,
                "schedule_config": {"total_curriculum_step": total_curriculum_step,
                                    "difficulty_step": difficulty_step}}
    if schedule_type == "fixed_root":
        schedule["schedule_config"]["root_degree"] = root_degree
    return check_schedule(schedule)


def documented_length(step, lo, hi, total, granularity, root_degree=1):
    """DeepSpeed's docs: min + (max - min) * (step / total)^(1/root_degree), floored to a multiple of
    difficulty_step, capped at max."""
    raw = math.floor(lo + (hi - lo) * (step / total) ** (1 / root_degree))
    return min(hi, max(lo, raw - raw % granularity))


@pytest.mark.parametrize("lo, hi, total, granularity", [(8, 64, 20, 8), (16, 64, 30, 16), (8, 128, 7, 8)])
def test_fixed_linear_follows_the_formula(lo, hi, total, granularity):
    lengths = lengths_over_steps(seqlen_schedule(lo, hi, total, granularity), total + 10)
    assert lengths == [documented_length(s, lo, hi, total, granularity) for s in range(1, total + 11)]
    assert lengths == sorted(lengths)                                # short to long, never back
    assert lengths[total - 1] == hi and lengths[total - 2] < hi      # reaches max at total_curriculum_step
    assert all(n % granularity == 0 for n in lengths)


def test_fixed_root_follows_the_formula():
    schedule = seqlen_schedule(8, 64, 25, 8, schedule_type="fixed_root", root_degree=2)
    assert lengths_over_steps(schedule, 30) == [documented_length(s, 8, 64, 25, 8, 2) for s in range(1, 31)]


def test_fixed_discrete_holds_each_length_until_its_max_step():
    schedule = {"min_difficulty": 8, "max_difficulty": 32, "schedule_type": "fixed_discrete",
                "schedule_config": {"difficulty": [8, 16, 32], "max_step": [3, 5]}}
    assert lengths_over_steps(schedule, 7) == [8, 8, 8, 16, 16, 32, 32]


def test_truncation_keeps_the_first_tokens():
    ids = torch.arange(40).reshape(4, 10)
    assert torch.equal(truncate(ids, 6), ids[:, :6])
    with pytest.raises(ValueError, match="seq_len=12"):
        truncate(ids, 12)


def test_deepspeed_itself_accepts_min_above_max():
    """Why check_schedule exists: DeepSpeed's scheduler silently stays at min_difficulty forever."""
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
    scheduler = CurriculumScheduler({"min_difficulty": 64, "max_difficulty": 16, "schedule_type": "fixed_linear",
                                     "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}})
    assert scheduler.update_difficulty(100) == 64


@pytest.mark.parametrize("kwargs, field", [
    (dict(min_len=64, max_len=16), "min_difficulty"),
    (dict(min_len=1, difficulty_step=1), "at least 2 tokens"),
    (dict(max_len=60, difficulty_step=8), "multiples of difficulty_step"),
    (dict(total_curriculum_step=0), "total_curriculum_step"),
    (dict(schedule_type="fixed_cubic"), "schedule_type='fixed_cubic'"),
])
def test_bad_schedules_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        seqlen_schedule(**kwargs)


def test_schedule_longer_than_the_data_is_refused():
    with pytest.raises(ValueError, match="max_difficulty=64 is longer"):
        make_scheduler(seqlen_schedule(16, 64), seq_len=32)


def test_token_budget_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="tokens_per_step=100"):
        rows_per_step(100, 16)
    with pytest.raises(ValueError, match="tokens_per_step=200"):   # 48 does not divide it: caught before training
        train_and_heldout(check_schedule(seqlen_schedule(16, 64, 2)), steps=4, tokens_per_step=200, seq_len=64)


def test_data_covers_the_hungrier_run_and_the_heldout_rows_are_new():
    schedule = seqlen_schedule(16, 64, total_curriculum_step=4, difficulty_step=16)   # 16, 32, 48, 64, 64, 64
    data, heldout = train_and_heldout(schedule, steps=6, tokens_per_step=192, seq_len=64, heldout_rows=8)
    assert len(data) == 12 + 6 + 4 + 3 + 3 + 3   # the curriculum run's rows (the baseline needs 6 x 3)
    assert heldout.shape == (8, 64)
    train_rows = {tuple(data[i]["input_ids"].tolist()) for i in range(len(data))}
    assert not train_rows & {tuple(row.tolist()) for row in heldout}


def test_verdict_pairs_the_heldout_sequences():
    def run(row_losses, final):
        return {"final_row_losses": row_losses, "evals": [{"tokens_seen": 0, "heldout_loss": 5.0},
                                                          {"tokens_seen": 100, "heldout_loss": final}]}
    # Per-sequence differences -0.1 +- 0.01: far beyond 2 standard errors, so the curriculum helped.
    v = verdict(run([2.0, 3.09, 4.0, 5.11], 3.5), run([2.1, 3.2, 4.1, 5.2], 3.65))
    assert v["outcome"] == "helped" and v["difference"] == pytest.approx(-0.1, abs=1e-6)
    assert verdict(run([2.0, 3.3], 2.65), run([2.1, 3.2], 2.65))["outcome"] == "tied"   # +-0.1: within the noise
    assert v["baseline_tokens_to_match"] is None   # the baseline never got down to 3.5


def test_tokens_to_reach_interpolates_between_evaluations():
    evals = [{"tokens_seen": t, "heldout_loss": loss} for t, loss in ((0, 4.0), (100, 3.0), (200, 2.0))]
    assert tokens_to_reach(evals, 2.5) == pytest.approx(150.0)
    assert tokens_to_reach(evals, 5.0) == 0.0
    assert tokens_to_reach(evals, 1.0) is None
