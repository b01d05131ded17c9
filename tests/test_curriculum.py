"""Sequence-length curriculum: DeepSpeed's CurriculumScheduler against the documented formulas, the
batch cut to the scheduled length, and equal token budgets for the curriculum and baseline runs."""
import math

import pytest
import torch

from helpers.curriculum import (check_schedule, compare, lengths_over_steps, make_scheduler, rows_per_step,
                                seqlen_schedule, tokens_to_reach, truncate)


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
        compare(steps=4, tokens_per_step=200, schedule=check_schedule(seqlen_schedule(16, 64, 2)))


@pytest.fixture(scope="module")
def runs():
    # 16, 32, 48, 64 all divide 192 tokens: 12, 6, 4 or 3 sequences a step.
    schedule = seqlen_schedule(16, 64, total_curriculum_step=4, difficulty_step=16)
    return compare(steps=6, tokens_per_step=192, schedule=schedule, eval_every=3, heldout_rows=8), schedule


def test_curriculum_batches_have_the_scheduled_length(runs):
    result, schedule = runs
    measured = [h["seq_len"] for h in result["curriculum"]["history"]]   # shape of the batch that was trained on
    assert measured == lengths_over_steps(schedule, 6) == [16, 32, 48, 64, 64, 64]
    assert all(h["seq_len"] == 64 for h in result["baseline"]["history"])


def test_both_runs_spend_the_same_token_budget(runs):
    result, _ = runs
    cur, base = result["curriculum"], result["baseline"]
    assert [h["tokens_seen"] for h in cur["history"]] == [h["tokens_seen"] for h in base["history"]] \
        == [192 * s for s in range(1, 7)]
    assert [h["rows"] for h in cur["history"]] == [12, 6, 4, 3, 3, 3]
    assert [h["lr"] for h in cur["history"]] == [h["lr"] for h in base["history"]]
    # Same initial weights: the held-out loss before training is identical.
    assert cur["evals"][0]["heldout_loss"] == base["evals"][0]["heldout_loss"]
    # Fewer next-token predictions when sequences are short (L - 1 per sequence of L).
    assert cur["history"][-1]["predictions_seen"] == sum(r * (n - 1) for r, n in ((12, 16), (6, 32), (4, 48), (9, 64)))


def test_verdict_is_consistent_with_the_losses(runs):
    result, _ = runs
    v = result["verdict"]
    cur, base = (torch.tensor(result[k]["final_row_losses"]) for k in ("curriculum", "baseline"))
    assert v["difference"] == pytest.approx((cur - base).mean().item())
    assert v["curriculum_loss"] == pytest.approx(cur.mean().item(), rel=1e-5)
    expected = "tied" if abs(v["difference"]) < 2 * v["stderr"] else ("helped" if v["difference"] < 0 else "hurt")
    assert v["outcome"] == expected


def test_tokens_to_reach_interpolates_between_evaluations():
    evals = [{"tokens_seen": t, "heldout_loss": loss} for t, loss in ((0, 4.0), (100, 3.0), (200, 2.0))]
    assert tokens_to_reach(evals, 2.5) == pytest.approx(150.0)
    assert tokens_to_reach(evals, 5.0) == 0.0
    assert tokens_to_reach(evals, 1.0) is None
