"""Dynamic loss scaling: DeepSpeed's DynamicLossScaler against hand-derived scales and an independent
replay of the rule, and DeepSpeed's overflow check against torch's on real fp16 gradients. (Notebook 06
runs the whole mixed-precision loop, and on a GPU the fp16 engine, and checks them the same way.)"""
import random

import pytest
import torch

from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

from helpers.runtime import init_single_process
from helpers.topics.loss_scaling import expected_scales, summarize


def make_scaler(init_scale, scale_window, min_scale=1.0, hysteresis=2, consecutive_hysteresis=False):
    """DeepSpeed's scaler with the fp16 config's names: its `hysteresis` is the scaler's `delayed_shift`."""
    return DynamicLossScaler(init_scale=init_scale, scale_window=scale_window, min_scale=min_scale,
                             delayed_shift=hysteresis, consecutive_hysteresis=consecutive_hysteresis)


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


def test_summary_counts_halvings_and_doublings():
    history = [{"scale": s, "overflow": o, "loss": l} for s, o, l in ((8.0, True, 5.0), (4.0, False, 4.0), (4.0, False, 3.0))]
    assert summarize(history, 8.0) == {"steps": 3, "overflows": 1, "halvings": 1, "doublings": 1, "first_scale": 8.0,
                                       "final_scale": 8.0, "first_loss": 5.0, "final_loss": 3.0}
