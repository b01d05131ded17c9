"""Sequence-length curriculum with DeepSpeed's `CurriculumScheduler` against a fair baseline (notebook 06,
which holds the training loop: before step s, counted from 1, ask `scheduler.update_difficulty(s)` for the
length and truncate the batch to it). This module checks schedules, makes the data and judges the outcome.

Fair by design: both runs see the same tokens per step (a step at length L uses tokens_per_step / L
sequences), hence the same steps, token budget, LR schedule, initial weights, data order and seed, and
both are judged on the same held-out sequences at full length. Not equalised: a sequence of L tokens
gives L - 1 next-token predictions, so short steps train on slightly fewer.
"""
from __future__ import annotations

import math
from itertools import pairwise

import torch

from ..data import SyntheticTextDataset
from ..runtime import quiet_deepspeed

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete")


def check_schedule(schedule: dict, seq_len: int | None = None) -> dict:
    """Raise ValueError naming the field for a schedule DeepSpeed would accept and then misbehave on.

    CurriculumScheduler itself checks only that keys exist: with min_difficulty > max_difficulty it
    silently stays at min_difficulty forever, and a max_difficulty that is not a multiple of
    difficulty_step is reached only after total_curriculum_step (the difficulty is floored to a multiple).
    """
    for key in ("min_difficulty", "max_difficulty", "schedule_type", "schedule_config"):
        if key not in schedule:
            raise ValueError(f"curriculum schedule is missing '{key}'")
    lo, hi, kind, cfg = (schedule[k] for k in ("min_difficulty", "max_difficulty", "schedule_type", "schedule_config"))
    if kind not in SCHEDULE_TYPES:
        raise ValueError(f"schedule_type={kind!r} is not one of {SCHEDULE_TYPES}")
    if not 2 <= lo <= hi:
        raise ValueError(f"need 2 <= min_difficulty ({lo}) <= max_difficulty ({hi}): a sequence needs at least "
                         "2 tokens (one to predict), and the curriculum goes from short to long")
    if seq_len is not None and hi > seq_len:
        raise ValueError(f"max_difficulty={hi} is longer than the data's sequences ({seq_len}): lower it or "
                         f"build the dataset with seq_len >= {hi}")
    if kind == "fixed_discrete":
        _check_discrete(cfg, lo, hi)
        return schedule
    step, total = cfg.get("difficulty_step"), cfg.get("total_curriculum_step")
    if not (isinstance(step, int) and step >= 1 and isinstance(total, int) and total >= 1):
        raise ValueError(f"schedule_config needs positive integers difficulty_step ({step}) and "
                         f"total_curriculum_step ({total})")
    if lo % step or hi % step:
        raise ValueError(f"min_difficulty ({lo}) and max_difficulty ({hi}) must be multiples of difficulty_step "
                         f"({step}): DeepSpeed floors every length to a multiple of it")
    if kind == "fixed_root" and not cfg.get("root_degree", 0) >= 1:
        raise ValueError("fixed_root needs schedule_config.root_degree >= 1 (2 = square root)")
    return schedule


def _check_discrete(cfg: dict, lo: int, hi: int) -> None:
    lengths, max_steps = cfg.get("difficulty", []), cfg.get("max_step", [])
    if not lengths or len(lengths) != len(max_steps) + 1:
        raise ValueError("fixed_discrete needs schedule_config.difficulty (lengths) with one more entry than "
                         "schedule_config.max_step (the last step of each length but the last)")
    if lengths != sorted(lengths) or not (lo <= lengths[0] and lengths[-1] <= hi):
        raise ValueError(f"difficulty={lengths} must grow from min_difficulty ({lo}) to max_difficulty ({hi})")
    if max_steps != sorted(max_steps):
        raise ValueError(f"max_step={max_steps} must increase")


def make_scheduler(schedule: dict, seq_len: int | None = None):
    """DeepSpeed's CurriculumScheduler for a checked schedule."""
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
    quiet_deepspeed()   # it warns when difficulty_step is not a multiple of 8 (tensor cores)
    return CurriculumScheduler(check_schedule(schedule, seq_len))


def lengths_over_steps(schedule: dict, steps: int) -> list[int]:
    """The sequence length DeepSpeed's scheduler gives each step 1..steps (a fresh scheduler)."""
    scheduler = make_scheduler(schedule)
    return [scheduler.update_difficulty(step) for step in range(1, steps + 1)]


def truncate(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of each sequence, as DeepSpeed's seqlen curriculum does."""
    if not 2 <= seq_len <= ids.shape[1]:
        raise ValueError(f"seq_len={seq_len} must be in 2..{ids.shape[1]} (the batch's sequence length)")
    return ids[:, :seq_len]


def rows_per_step(tokens_per_step: int, seq_len: int) -> int:
    """How many sequences of `seq_len` make exactly `tokens_per_step` tokens."""
    if tokens_per_step % seq_len:
        raise ValueError(f"tokens_per_step={tokens_per_step} is not a multiple of sequence length {seq_len}: "
                         "pick tokens_per_step divisible by every length the schedule produces "
                         f"(e.g. their least common multiple, {seq_len} here or larger)")
    return tokens_per_step // seq_len


@torch.no_grad()
def heldout_row_losses(engine, heldout: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of each held-out sequence (full length), without updating anything."""
    engine.eval()
    ids = heldout.to(engine.device)
    logits = engine(input_ids=ids).logits[:, :-1].float()
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    engine.train()
    return losses.mean(1).cpu()


def train_and_heldout(schedule: dict, steps: int, tokens_per_step: int, seq_len: int, heldout_rows: int = 64, seed: int = 0):
    """(training rows, enough for the hungrier run without repeats; held-out sequences from the same chain).

    Fails before any training when a length of the schedule does not divide tokens_per_step."""
    check_schedule(schedule, seq_len)
    lengths = lengths_over_steps(schedule, steps)
    for length in set(lengths) | {seq_len}:
        rows_per_step(tokens_per_step, length)
    needed = max(sum(tokens_per_step // n for n in lengths), steps * tokens_per_step // seq_len)
    data = SyntheticTextDataset("markov", n_samples=needed, seq_len=seq_len, seed=seed)
    heldout = SyntheticTextDataset("markov", n_samples=heldout_rows, seq_len=seq_len, seed=seed + 10_000,
                                   tokenizer=data.tokenizer)
    return data, torch.stack([heldout[i]["input_ids"] for i in range(len(heldout))])


def verdict(curriculum: dict, baseline: dict, z: float = 2.0) -> dict:
    """Did the curriculum help, hurt or tie on the final held-out loss?

    Paired over the same held-out sequences: difference = curriculum - baseline per sequence, with its
    standard error. |mean| < z * stderr is a tie. This covers which held-out sequences were drawn,
    not run-to-run training noise (one seed), so a small difference is a tie at best.
    """
    diffs = torch.tensor(curriculum["final_row_losses"]) - torch.tensor(baseline["final_row_losses"])
    mean, stderr = diffs.mean().item(), (diffs.std() / math.sqrt(len(diffs))).item()
    outcome = "tied" if abs(mean) < z * stderr else ("helped" if mean < 0 else "hurt")
    final = curriculum["evals"][-1]
    return {"curriculum_loss": final["heldout_loss"], "baseline_loss": baseline["evals"][-1]["heldout_loss"],
            "difference": mean, "stderr": stderr, "outcome": outcome,
            "budget_tokens": final["tokens_seen"],
            "baseline_tokens_to_match": tokens_to_reach(baseline["evals"], final["heldout_loss"])}


def tokens_to_reach(evals: list[dict], loss: float) -> float | None:
    """Tokens after which a run's held-out loss first fell to `loss` (linear between evaluations);
    None if it never did."""
    for a, b in pairwise(evals):
        if b["heldout_loss"] <= loss:
            if a["heldout_loss"] <= loss:
                return float(a["tokens_seen"])
            frac = (a["heldout_loss"] - loss) / (a["heldout_loss"] - b["heldout_loss"])
            return a["tokens_seen"] + frac * (b["tokens_seen"] - a["tokens_seen"])
    return None
