"""helpers.topics.moe and the expert-parallel program (helpers/programs/moe.py): parameter counts from shapes vs the modules DeepSpeed
builds, capacity and dropped tokens vs DeepSpeed's own gate, bad input, and one real 2-rank run."""
import math

import numpy as np
import pytest
import torch

from helpers.launch import run_program
from helpers.programs.moe import MoEGPT, dense_twin
from helpers.model import MODEL_SIZES, build_model
from helpers.topics import moe

VOCAB, N_POS, SIZE = 130, 48, "tiny"
N_LAYER, N_EMBD, _ = MODEL_SIZES[SIZE]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("num_experts, ep_size", [(4, 1), (4, 2), (6, 3)])
def test_param_counts_match_the_modules(num_experts, ep_size, k):
    formula = moe.moe_param_counts(VOCAB, N_POS, N_LAYER, N_EMBD, num_experts, k, ep_size)
    # One process builds what one expert-parallel rank holds: num_experts / ep_size experts per layer.
    model = MoEGPT(VOCAB, N_POS, SIZE, num_experts=num_experts, k=k, ep_size=ep_size)
    held = moe.count_params(model, k)
    assert held["local_experts"] == [num_experts // ep_size] * N_LAYER
    assert held["total"] == formula["per_rank"]
    assert held["expert"] == formula["experts_per_rank"]
    assert held["active"] == formula["active"]
    if ep_size == 1:   # a single process holding every expert is the whole model
        assert held["total"] == formula["total"]


def test_total_and_active_by_hand():
    """tiny GPT-2 (2 layers, h=128, V=130, 48 positions), 4 experts: the numbers written out."""
    h = N_EMBD
    expert = 2 * h * 4 * h + 4 * h + h                 # c_fc, c_proj and their biases
    dense = sum(p.numel() for p in build_model(VOCAB, N_POS, SIZE).parameters())
    counts = moe.moe_param_counts(VOCAB, N_POS, N_LAYER, N_EMBD, num_experts=4, k=1)
    assert counts["expert"] == expert == 131_712
    assert counts["total"] == dense + N_LAYER * (3 * expert + 4 * h)
    assert counts["active"] == dense + N_LAYER * 4 * h   # one expert = the dense MLP, plus the gate
    assert moe.moe_param_counts(VOCAB, N_POS, N_LAYER, N_EMBD, 4, k=2)["active"] == counts["active"] + N_LAYER * expert


@pytest.mark.parametrize("k", [1, 2])
def test_dense_twin_runs_the_active_parameters(k):
    twin = dense_twin(VOCAB, N_POS, SIZE, k)
    counts = moe.moe_param_counts(VOCAB, N_POS, N_LAYER, N_EMBD, num_experts=4, k=k)
    assert sum(p.numel() for p in twin.parameters()) == counts["dense_twin"]
    # What the MoE runs per token beyond the twin: the gates, and the extra experts' output biases.
    assert counts["active"] - counts["dense_twin"] == N_LAYER * (4 * N_EMBD + (k - 1) * N_EMBD)
    assert twin.transformer.h[0].mlp.c_fc.weight.shape == (N_EMBD, k * 4 * N_EMBD)


@pytest.mark.parametrize("k", [1, 2])
def test_forward_in_one_process(k):
    torch.manual_seed(0)
    model = MoEGPT(VOCAB, N_POS, SIZE, num_experts=4, k=k, aux_loss_coef=0.1)
    ids = torch.randint(2, VOCAB, (4, N_POS))
    out = model(ids, labels=ids)
    assert out.logits.shape == (4, N_POS, VOCAB)
    assert out.exp_counts.shape == (N_LAYER, 4)
    assert out.exp_counts.sum(dim=1).tolist() == [ids.numel() * k] * N_LAYER   # each token routed k times
    assert torch.isclose(out.loss, out.lm_loss + 0.1 * out.aux_loss)
    out.loss.backward()
    gate = model.feed_forwards[0].moe.deepspeed_moe.gate.wg.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0   # the router learns


@pytest.mark.parametrize("k, gating", [(1, "top1gating"), (2, "top2gating")])
def test_capacity_and_dropped_tokens_match_deepspeeds_gate(k, gating):
    """Skewed router logits overflow expert 0: count the routes DeepSpeed's gate keeps."""
    from deepspeed.moe import sharded_moe
    tokens, num_experts = 200, 4
    torch.manual_seed(0)
    logits = torch.randn(tokens, num_experts) + torch.tensor([2.0, 0.0, 0.0, 0.0])
    _, combine, dispatch, exp_counts = getattr(sharded_moe, gating)(logits.clone(), 1.0, 4)
    assert combine.shape[-1] == moe.capacity(tokens, num_experts, k) == math.ceil(tokens * k / num_experts)
    dropped = moe.dropped_tokens(exp_counts, tokens, k)
    assert dropped > 0                                     # the test must exercise dropping
    assert dropped == int(exp_counts.sum()) - int(dispatch.sum())


@pytest.mark.parametrize("kwargs, message", [
    ({"num_experts": 3, "ep_size": 2}, "num_experts=3 is not divisible by ep_size=2"),
    ({"num_experts": 4, "ep_size": 2, "k": 5}, "k=5 experts per token"),
    ({"num_experts": 0}, "num_experts=0 must be a positive integer"),
    ({"num_experts": 4, "ep_size": 2, "world_size": 3}, "world size 3 is not a multiple of ep_size=2"),
])
def test_bad_moe_shapes_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        moe.check_moe_args(**kwargs)


def test_bad_model_and_launch_fail_before_anything_starts(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="not divisible by ep_size=2"):
        MoEGPT(VOCAB, N_POS, SIZE, num_experts=3, ep_size=2)
    monkeypatch.setattr("helpers.launch.launch", lambda *a, **k: pytest.fail("launched despite bad input"))
    with pytest.raises(ValueError, match="not divisible by ep_size=2"):
        run_program("moe", 2, out_dir=tmp_path, num_experts=5)
    with pytest.raises(ValueError, match="world size 3 is not a multiple"):
        run_program("moe", 3, out_dir=tmp_path)
    with pytest.raises(ValueError, match="zero_stage=3: DeepSpeed's MoE layers run with ZeRO stage 0, 1 or 2"):
        run_program("moe", 2, out_dir=tmp_path, zero_stage=3)
    with pytest.raises(ValueError, match="bad options {'no_such_option': 1} for moe"):
        run_program("moe", 2, out_dir=tmp_path, no_such_option=1)


# ---- one real launch: 2 ranks, 4 experts, ep_size=2, top-2, then the dense twin ----

E, EP, K, STEPS = 4, 2, 2, 6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_program("moe", 2, out_dir=tmp_path_factory.mktemp("moe"), timeout=300, num_experts=E, ep_size=EP,
                       k=K, steps=STEPS, micro_batch=4, seq_len=32)


def test_each_rank_holds_its_share_of_the_experts(results):
    formula = results[0]["moe"]["formula"]
    for r in results:
        held = r["moe"]["held"]
        assert held["local_experts"] == [E // EP] * N_LAYER
        assert held["expert"] == N_LAYER * E // EP * formula["expert"] == formula["experts_per_rank"]
        assert held["total"] == formula["per_rank"] < formula["total"]
    assert sorted(results[0]["moe"]["expert_ids"] + results[1]["moe"]["expert_ids"]) == list(range(E))
    # Shared weights are replicas (identical after training); the experts are different weights.
    assert results[0]["moe"]["shared_checksum"] == results[1]["moe"]["shared_checksum"]
    assert not np.allclose(results[0]["moe"]["expert_checksums"], results[1]["moe"]["expert_checksums"])


def test_optimizer_groups_follow_expert_parallelism(results):
    """ZeRO-1 splits the shared group's optimizer state over both ranks; each expert group stays whole
    on its rank (its expert-data-parallel group is world_size / ep_size = 1 rank)."""
    formula = results[0]["moe"]["formula"]
    shared, experts = results[0]["moe"]["optimizer_groups"]
    assert (shared["moe"], experts["moe"]) == (False, True)
    assert experts["params"] == experts["optimizer_partition"] == formula["experts_per_rank"]
    assert shared["params"] == formula["per_rank"] - formula["experts_per_rank"]
    assert shared["optimizer_partition"] == shared["params"] / 2


def test_routes_per_step_are_tokens_times_k(results):
    tokens = results[0]["settings"]["tokens_per_rank_step"]
    for r in results:
        counts = np.array([step["exp_counts"] for step in r["moe"]["history"]])
        assert counts.shape == (STEPS, N_LAYER, E)
        assert (counts.sum(axis=2) == tokens * K).all()
    assert np.allclose(moe.load_fractions(results).sum(axis=1), 1.0)
    assert ((0 <= moe.dropped_fraction(results)) & (moe.dropped_fraction(results) <= 1)).all()


def test_losses(results):
    coef = results[0]["settings"]["aux_loss_coef"]
    for r in results:
        steps = r["moe"]["history"]
        aux = np.array([s["aux_loss"] for s in steps])
        assert np.isfinite(aux).all() and (aux > 0).all()
        assert np.allclose(aux, [sum(s["aux_per_layer"]) for s in steps], rtol=1e-5)
        assert np.allclose([s["loss"] for s in steps], [s["lm_loss"] + coef * s["aux_loss"] for s in steps], rtol=1e-5)
    c = moe.curves(results)
    assert c["lm_loss"][-2:].mean() < c["lm_loss"][:2].mean() - 0.3
    assert c["dense_loss"][-2:].mean() < c["dense_loss"][:2].mean() - 0.3


def test_all_to_all_volume_matches_the_capacity_formula(results):
    sent = moe.all_to_all_bytes(results)
    assert sent["logged"] == sent["predicted"] > 0


def test_throughput_and_tables_are_reported(results):
    rates = moe.throughput(results)   # reported, never asserted: timings are noisy
    assert rates["moe_tokens_per_s"] > 0 and rates["dense_tokens_per_s"] > 0
    rows = moe.param_rows(results)
    assert [row["stored"] for row in rows] == [row["stored (formula)"] for row in rows]
    assert rows[0]["dense twin"] == results[0]["moe"]["formula"]["dense_twin"]
