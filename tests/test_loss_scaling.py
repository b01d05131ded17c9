"""Dynamic loss scaling: DeepSpeed's DynamicLossScaler against hand-derived scales and an independent
replay of the rule, and a real fp16 run on the CPU whose skipped steps really left the weights alone."""
import random

import pytest
import torch

from helpers.loss_scaling import (expected_scales, follows_rule, make_scaler, summarize, train_fp16_engine,
                                  train_fp16_on_cpu)
from helpers.runtime import init_single_process

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSpeed's fp16 engine needs a CUDA GPU")


@pytest.fixture(scope="module", autouse=True)
def process_group():
    init_single_process()   # the scaler asks deepspeed.comm for the rank when it logs an overflow


def drive(scaler, overflows):
    """The scale the scaler had at each step, then the scale it ends with."""
    used = []
    for overflow in overflows:
        used.append(scaler.loss_scale)
        scaler.update_scale(overflow)
    return used, scaler.loss_scale


def test_halves_after_hysteresis_and_doubles_after_a_clean_window():
    # Worked by hand: hysteresis 2 absorbs the first overflow, the second halves; the first doubling
    # comes on the 4th clean step (window 3, the clean step right after an overflow is not counted),
    # and refills the hysteresis, so step 6's overflow is absorbed again and steps 7 and 8 halve.
    overflows = [True, True, False, False, False, False, True, True, True, False]
    used, final = drive(make_scaler(1024, scale_window=3, hysteresis=2), overflows)
    assert used == [1024, 1024, 512, 512, 512, 512, 1024, 1024, 512, 256]
    assert final == 256
    assert expected_scales(overflows + [False], 1024, 3, hysteresis=2) == used + [final]


@pytest.mark.parametrize("consecutive, final", [(False, 256), (True, 1024)])
def test_consecutive_hysteresis_refills_on_every_clean_step(consecutive, final):
    overflows = [True, False, True, False, True]
    used, end = drive(make_scaler(1024, scale_window=10, hysteresis=2, consecutive_hysteresis=consecutive),
                      overflows)
    assert end == final
    assert expected_scales(overflows + [False], 1024, 10, hysteresis=2,
                           consecutive_hysteresis=consecutive) == used + [end]


@pytest.mark.parametrize("window, hysteresis, consecutive", [(1, 1, False), (3, 2, False), (4, 3, True), (7, 1, True)])
def test_deepspeed_matches_the_independent_replay_on_random_overflows(window, hysteresis, consecutive):
    rng = random.Random(window * 10 + hysteresis)
    overflows = [rng.random() < 0.3 for _ in range(200)]
    # 2**100: high enough that ~60 overflows never reach min_scale, where DeepSpeed raises instead.
    used, final = drive(make_scaler(2.0**100, window, 1.0, hysteresis, consecutive), overflows)
    assert expected_scales(overflows + [False], 2.0**100, window, 1.0, hysteresis, consecutive) == used + [final]


def test_an_overflow_at_min_scale_stops_the_run():
    scaler = make_scaler(4.0, scale_window=10, min_scale=2.0, hysteresis=1)
    scaler.update_scale(True)                       # 4 -> 2, the floor
    with pytest.raises(Exception, match="already at minimum"):
        scaler.update_scale(True)


@pytest.mark.parametrize("kwargs, field", [(dict(scale_window=0), "scale_window=0"),
                                           (dict(hysteresis=0), "hysteresis=0"),
                                           (dict(min_scale=2.0**30), "min_scale")])
def test_bad_settings_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_scaler(**{"init_scale": 2.0**20, **kwargs})


def test_overflows_are_real_fp16_overflows():
    """DeepSpeed's overflow check agrees with torch on real fp16 gradients: inf at 2**24, none at 1."""
    from deepspeed.runtime.utils import CheckOverflow
    from helpers.data import SyntheticTextDataset
    from helpers.model import build_model
    data = SyntheticTextDataset("markov", n_samples=4, seq_len=16)
    model = build_model(data.vocab_size, 16, "tiny").half()
    params, ids = list(model.parameters()), data[slice(0, 4)]["input_ids"]
    for scale, overflows in ((2.0**24, True), (1.0, False)):
        model.zero_grad(set_to_none=True)
        (model(input_ids=ids, labels=ids).loss.float() * scale).backward()
        assert all(p.grad.dtype == torch.float16 for p in params)
        assert (not all(torch.isfinite(p.grad).all() for p in params)) == overflows
        assert CheckOverflow([params]).has_overflow(params) == overflows


@pytest.fixture(scope="module")
def cpu_run():
    return train_fp16_on_cpu(steps=20, init_scale=2.0**20, scale_window=3, hysteresis=2, micro_batch=4,
                             seq_len=16)


def test_cpu_run_skips_exactly_the_overflow_steps(cpu_run):
    h = cpu_run["history"]
    overflowed = [r["overflow"] for r in h]
    assert 2 <= sum(overflowed) < len(h)            # the too-large start overflowed, then training went on
    assert h[-1]["skipped_steps"] == sum(overflowed)
    for r in h:   # measured on the fp32 master weights: untouched on a skipped step, moved on a clean one
        assert (r["update_norm"] == 0.0) == r["overflow"], r


def test_cpu_run_scale_follows_the_rule(cpu_run):
    assert follows_rule(cpu_run)
    s = summarize(cpu_run)
    assert s["halvings"] >= 1 and s["doublings"] >= 1
    assert s["final_scale"] < s["first_scale"]


def test_cpu_run_learns(cpu_run):
    losses = [r["loss"] for r in cpu_run["history"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_engine_path_refuses_a_cpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        train_fp16_engine(steps=2)


@needs_cuda
def test_gpu_engine_scale_and_skipped_steps(tmp_path):
    result = train_fp16_engine(steps=30, init_scale_power=32, scale_window=5, zero_stage=1, output_dir=tmp_path)
    h = result["history"]
    assert sum(r["overflow"] for r in h) >= 2 and h[-1]["skipped_steps"] == sum(r["overflow"] for r in h)
    assert all(r["update_norm"] == 0.0 for r in h if r["overflow"])
    assert all(r["update_norm"] > 0.0 for r in h if not r["overflow"] and r["lr"] > 0)   # warmup starts at lr 0
    assert follows_rule(result)
