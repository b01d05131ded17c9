"""The formulas: the ZeRO paper's model-state bytes (its worked example, which stage partitions what),
the bytes per parameter DeepSpeed keeps, model shapes, and Korthikanti et al.'s activation bytes."""
import subprocess
import sys

import pytest

from helpers.memory.formulas import (GB, activation_bytes, activation_bytes_per_layer, bytes_per_param,
                                     gpt2_sizes, models, paper_table, zero_model_states)

STAGES = (0, 1, 2, 3)
S, B, H, A = 512, 4, 1024, 16


def test_the_papers_worked_example():
    """ZeRO paper Fig. 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12)."""
    totals = [round(zero_model_states(7.5e9, 64, s)["total"] / GB, 1) for s in STAGES]
    assert totals == [120.0, 31.4, 16.6, 1.9]
    rows = paper_table(7.5e9, [1, 64])
    assert [round(r["total"], 1) for r in rows if r["n_ranks"] == 64] == totals
    assert {r["total"] for r in rows if r["n_ranks"] == 1} == {120.0}


@pytest.mark.parametrize("n_ranks", [2, 8, 64])
def test_each_stage_partitions_one_more_component(n_ranks):
    psi = 1e6
    one = {s: zero_model_states(psi, 1, s) for s in STAGES}
    many = {s: zero_model_states(psi, n_ranks, s) for s in STAGES}
    totals = [many[s]["total"] for s in STAGES]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    for stage in STAGES:   # which components are divided by N at this stage
        divided = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
        for part, is_divided in divided.items():
            assert many[stage][part] == pytest.approx(one[stage][part] / (n_ranks if is_divided else 1))
    assert {one[s]["total"] for s in STAGES} == {16 * psi}   # one rank: nothing to partition across


def test_bad_stage_or_ranks_are_refused():
    with pytest.raises(ValueError, match="stage=4"):
        zero_model_states(1e6, 2, 4)
    with pytest.raises(ValueError, match="n_ranks=0"):
        zero_model_states(1e6, 0, 1)
    with pytest.raises(ValueError, match="precision='fp8'"):
        bytes_per_param("fp8", 0)


def test_bytes_per_param_table():
    assert [bytes_per_param("bf16", s) for s in STAGES] == [(2, 2, 12)] * 4
    assert [bytes_per_param("fp16", s) for s in STAGES] == [(2, 2, 12)] * 4
    assert bytes_per_param("fp32", 0) == (4, 4, 8)
    assert [bytes_per_param("fp32", s) for s in (1, 2, 3)] == [(4, 4, 12)] * 3


def test_model_shapes():
    sizes = {row["name"]: row["params"] for row in gpt2_sizes()}
    assert sizes == {"GPT-2 124M": 124_439_808, "GPT-2 355M": 354_823_168, "GPT-2 774M": 774_030_080,
                     "GPT-2 1.5B": 1_557_611_200}
    assert all(shape["hidden"] == 64 * shape["heads"] for shape in gpt2_sizes())   # GPT-2's 64-dim heads
    for shape in models().values():   # ZeRO-3 gathers the (tied) embedding, the largest layer
        assert shape["largest_layer_params"] == shape["vocab"] * shape["hidden"]
    assert 170e9 < models()["GPT-3 175B"]["params"] < 180e9


def test_formulas_import_no_torch():
    """Pure math: the planner and widget use it without importing torch (or a model)."""
    code = "import sys, helpers.memory.formulas; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_papers_activation_coefficient_for_16_bit_with_dropout():
    """Sec. 4.1: sbh(34 + 5as/h) bytes per layer, 16-bit activations and 1-byte dropout masks."""
    got = activation_bytes_per_layer(S, B, H, A, bytes_per_element=2, dropout=True)
    assert got == S * B * H * (34 + 5 * A * S / H)


def test_activations_without_dropout_and_in_fp32():
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


def test_activations_linear_in_batch_quadratic_attention_in_seq():
    f = lambda s, b: activation_bytes_per_layer(s, b, H, A, 2)   # noqa: E731
    assert f(S, 2 * B) == 2 * f(S, B)
    # Doubling s doubles the sbh terms and quadruples the as^2b term: the excess is 2 x 2as^2b bytes.
    assert f(2 * S, B) - 2 * f(S, B) == 2 * 2 * A * S * S * B


def test_whole_model_activation_terms():
    full = activation_bytes(S, B, H, A, n_layer=24, vocab=50257)
    ckpt = activation_bytes(S, B, H, A, n_layer=24, vocab=50257, checkpointing=True)
    assert full["layers"] == 24 * activation_bytes_per_layer(S, B, H, A)
    assert full["recompute"] == 0 and ckpt["recompute"] == activation_bytes_per_layer(S, B, H, A)
    assert full["logits"] == ckpt["logits"] == S * B * 50257 * (4 + 2)
    assert ckpt["total"] < full["total"]
    assert full["total"] == pytest.approx(sum(v for k, v in full.items() if k != "total"))


def test_fused_attention_keeps_no_seq_squared_term():
    """SDPA / flash attention keep Q, K, V and the output plus an fp32 log-sum-exp per row, not the a s^2 b
    scores eager attention stores: the difference is the paper's as^2b term less that log-sum-exp."""
    from helpers.memory.formulas import activation_bytes, activation_bytes_per_layer
    s, b, h, a = 1024, 2, 768, 12
    eager = activation_bytes_per_layer(s, b, h, a, 2)
    for fused in ("sdpa", "flash"):
        assert eager - activation_bytes_per_layer(s, b, h, a, 2, attention=fused) == a * s * s * b * 2 - 4 * a * s * b
        assert activation_bytes_per_layer(s, b, h, a, 2, True, attention=fused) == activation_bytes_per_layer(s, b, h, a, 2, True)
    assert activation_bytes(s, b, h, a, 12, 50257, 2)["total"] > activation_bytes(s, b, h, a, 12, 50257, 2, attention="sdpa")["total"]
    with pytest.raises(ValueError, match="attention"):
        activation_bytes_per_layer(s, b, h, a, 2, attention="xformers")
