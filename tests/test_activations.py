"""Activation memory: Korthikanti et al. 2022's formula, and one real measurement in a child process."""
import pytest

from helpers import activations as act
from helpers.activations import activation_bytes, activation_bytes_per_layer

S, B, H, A = 512, 4, 1024, 16


def test_the_papers_coefficient_for_16_bit_with_dropout():
    """Sec. 4.1: sbh(34 + 5as/h) bytes per layer, 16-bit activations and 1-byte dropout masks."""
    got = activation_bytes_per_layer(S, B, H, A, bytes_per_element=2, dropout=True)
    assert got == S * B * H * (34 + 5 * A * S / H)


def test_without_dropout_and_in_fp32():
    sbh, as2b = S * B * H, A * S * S * B
    assert activation_bytes_per_layer(S, B, H, A, 2) == 2 * (16 * sbh + as2b)   # sbh(32 + 2as/h)
    assert activation_bytes_per_layer(S, B, H, A, 4) == 2 * activation_bytes_per_layer(S, B, H, A, 2)
    # With dropout, fp32 doubles the elements but not the 1-byte masks (2sbh + as^2b)
    with_masks = activation_bytes_per_layer(S, B, H, A, 4, dropout=True)
    assert with_masks == 2 * activation_bytes_per_layer(S, B, H, A, 2, dropout=True) - (2 * sbh + as2b)


@pytest.mark.parametrize("bytes_per_element", [2, 4])
def test_checkpointing_keeps_only_the_layer_input(bytes_per_element):
    assert activation_bytes_per_layer(S, B, H, A, bytes_per_element, checkpointing=True) == \
        bytes_per_element * S * B * H


def test_scaling_linear_in_batch_quadratic_attention_in_seq():
    f = lambda s, b: activation_bytes_per_layer(s, b, H, A, 2)   # noqa: E731
    assert f(S, 2 * B) == 2 * f(S, B)
    # Doubling s doubles the sbh terms and quadruples the as^2b term: the excess is 2 x 2as^2b bytes.
    assert f(2 * S, B) - 2 * f(S, B) == 2 * 2 * A * S * S * B


def test_whole_model_terms():
    full = activation_bytes(S, B, H, A, n_layer=24, vocab=50257)
    ckpt = activation_bytes(S, B, H, A, n_layer=24, vocab=50257, checkpointing=True)
    assert full["layers"] == 24 * activation_bytes_per_layer(S, B, H, A)
    assert full["recompute"] == 0 and ckpt["recompute"] == activation_bytes_per_layer(S, B, H, A)
    assert full["logits"] == ckpt["logits"] == S * B * 50257 * (4 + 2)
    assert ckpt["total"] < full["total"]
    assert full["total"] == pytest.approx(sum(v for k, v in full.items() if k != "total"))


def test_peak_source_per_device():
    assert act.peak_source("cuda") == "cuda"
    assert act.peak_source("cpu") == "rss"


def test_a_real_step_matches_the_formula_and_checkpointing_lowers_the_peak():
    """'small' (4 layers, h=256) at seq 512: the layers' activations (~100 MB) dwarf RSS noise."""
    off = act.measure_step_memory("small", 512, 2, checkpointing=False, steps=1)
    on = act.measure_step_memory("small", 512, 2, checkpointing=True, steps=1)
    assert off["source"] == on["source"] == act.peak_source(off["device"])
    assert 0 < on["peak_bytes"] < 0.6 * off["peak_bytes"]
    assert off["seconds"] > 0
    if off["source"] == "rss":   # held between forward and backward: what the formula counts
        predicted = act.predict("small", 512, 2, checkpointing=False)["total"]
        assert off["forward_bytes"] == pytest.approx(predicted, rel=0.1)
