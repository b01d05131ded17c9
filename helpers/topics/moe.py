"""Mixture of experts, the notebook's side: parameter counts from the shapes, DeepSpeed's capacity rule,
and the tables and curves built from helpers/programs/moe.py's per-rank results. (Notebook 06 explains
the layer: E experts stored per block, k run per token, E / ep_size stored per expert-parallel rank.)

The program's `MoEGPT` is GPT-2 with each `block.mlp` replaced by `deepspeed.moe.layer.MoE(expert=that
MLP)`; its `dense_twin` has MLPs k times wider, so both run the same number of parameters per token.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from helpers.errors import require_positive_int
from helpers.precision import ELEMENT_BYTES
from helpers.model import MODEL_SIZES, gpt2_param_count

GPT2_MLP_RATIO = 4   # GPT-2's MLP is h -> 4h -> h


def check_moe_args(num_experts: int, ep_size: int = 1, k: int = 1, world_size: int | None = None) -> None:
    """Raise ValueError naming the problem and the fix, before DeepSpeed asserts (or hangs) on it."""
    for name, value in (("num_experts", num_experts), ("ep_size", ep_size), ("k", k)):
        require_positive_int(name, value)
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}: each of the {ep_size} "
                         f"expert-parallel ranks holds num_experts / ep_size whole experts; use a num_experts that "
                         f"is a multiple of {ep_size}, or ep_size=1")
    if k > num_experts:
        raise ValueError(f"k={k} experts per token, but there are only num_experts={num_experts}: use k <= num_experts "
                         "(DeepSpeed documents k=1 and k=2)")
    if world_size is not None and world_size % ep_size:
        raise ValueError(f"world size {world_size} is not a multiple of ep_size={ep_size}: DeepSpeed splits the ranks "
                         f"into groups of ep_size that share the experts; launch a multiple of {ep_size} ranks")


def mlp_param_count(n_embd: int, inner: int) -> int:
    """GPT-2 MLP h -> inner -> h: two weight matrices and their biases."""
    return n_embd * inner + inner + inner * n_embd + n_embd


def moe_param_counts(vocab_size: int, n_positions: int, n_layer: int, n_embd: int, num_experts: int,
                     k: int = 1, ep_size: int = 1) -> dict[str, int]:
    """Parameter counts of `MoEGPT` from its shapes: body (all but the MLPs, shared by all tokens), expert
    (one GPT-2 MLP, 8h^2 + 5h), gate (h x E), and body + layers x (gate + n x expert) for n = E (total,
    stored), k (active per token), E / ep_size (per_rank); dense_twin: the GPT-2 with MLPs k x 4h wide."""
    check_moe_args(num_experts, ep_size, k)
    expert = mlp_param_count(n_embd, GPT2_MLP_RATIO * n_embd)
    body = gpt2_param_count(vocab_size, n_positions, n_layer, n_embd) - n_layer * expert
    gate = n_embd * num_experts

    def with_experts(n: int) -> int:
        return body + n_layer * (gate + n * expert)

    return {"body": body, "expert": expert, "gate": gate, "total": with_experts(num_experts),
            "active": with_experts(k), "per_rank": with_experts(num_experts // ep_size),
            "experts_per_rank": n_layer * num_experts // ep_size * expert,
            "dense_twin": body + n_layer * mlp_param_count(n_embd, k * GPT2_MLP_RATIO * n_embd)}


def moe_layers(model: nn.Module) -> list:
    """The DeepSpeed MoE layers of a model, in order."""
    from deepspeed.moe.layer import MoE
    return [m for m in model.modules() if isinstance(m, MoE)]


def count_params(model: nn.Module, k: int) -> dict[str, int]:
    """The parameters this process's module really holds (no formula), expert ones told apart by DeepSpeed's
    `is_moe_param`; active: what one token runs through (the shared ones plus k experts per MoE layer)."""
    from deepspeed.moe.utils import is_moe_param
    params = list(model.parameters())   # tied embeddings are listed once
    expert = sum(p.numel() for p in params if is_moe_param(p))
    layers = moe_layers(model)
    counts = {"total": sum(p.numel() for p in params), "expert": expert,
              "shared": sum(p.numel() for p in params if not is_moe_param(p)),
              "local_experts": [layer.num_local_experts for layer in layers]}
    one_expert = [sum(p.numel() for p in layer.deepspeed_moe.experts.deepspeed_experts[0].parameters())
                  for layer in layers]
    return {**counts, "active": counts["shared"] + k * sum(one_expert)}


def capacity(tokens: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0, min_capacity: int = 4) -> int:
    """Tokens one expert accepts per forward (DeepSpeed's training-time rule, sharded_moe._capacity):
    ceil(tokens / E x capacity_factor x k), at least min_capacity. Tokens routed beyond it are dropped:
    that expert adds nothing for them and only the residual connection carries them on."""
    return max(math.ceil(tokens / num_experts * capacity_factor * k), min_capacity)


def dropped_tokens(exp_counts, tokens: int, k: int = 1, capacity_factor: float = 1.0, min_capacity: int = 4) -> int:
    """Routes dropped for lack of capacity, from one layer's per-expert counts `exp_counts` (length E)."""
    counts = torch.as_tensor(exp_counts)
    cap = capacity(tokens, len(counts), k, capacity_factor, min_capacity)
    return int((counts - cap).clamp(min=0).sum())


# ---- tables and curves from the program's per-rank results ----

def load_fractions(results: list[dict], layer: int = 0) -> np.ndarray:
    """(steps, E): each expert's share of the tokens routed in one MoE layer (counted at the router, before
    any are dropped, summed over the ranks); 1/E each when perfectly balanced."""
    load = np.sum([[step["exp_counts"][layer] for step in r["moe"]["history"]] for r in results], axis=0)
    return load / load.sum(axis=1, keepdims=True)


def dropped_fraction(results: list[dict]) -> np.ndarray:
    """(steps, layers): fraction of all routes that went over an expert's capacity and were dropped.
    Each rank's router fills each expert up to `capacity` of that rank's own tokens."""
    s = results[0]["settings"]
    tokens, k = s["tokens_per_rank_step"], s["k"]
    dropped = [[[dropped_tokens(counts, tokens, k, s["capacity_factor"]) for counts in step["exp_counts"]]
                for step in r["moe"]["history"]] for r in results]
    return np.sum(dropped, axis=0) / (tokens * k * len(results))


def curves(results: list[dict]) -> dict[str, np.ndarray]:
    """Per step, averaged over ranks: the MoE model's LM loss, summed aux loss and total loss, and the
    dense twin's loss."""
    def mean(model: str, key: str) -> np.ndarray:
        return np.mean([[step[key] for step in r[model]["history"]] for r in results], axis=0)
    return {"step": np.arange(1, len(results[0]["moe"]["history"]) + 1), "lm_loss": mean("moe", "lm_loss"),
            "aux_loss": mean("moe", "aux_loss"), "loss": mean("moe", "loss"), "dense_loss": mean("dense", "loss")}


def throughput(results: list[dict]) -> dict[str, float]:
    """MoE vs dense twin tokens/s over all ranks, and MoE / dense, from the median step (a step lasts as long
    as its slowest rank; the first two, logging and warm-up, left out). A measurement, not a claim."""
    s = results[0]["settings"]
    rates = {}
    for model in ("moe", "dense"):
        step_s = np.max([[step["step_s"] for step in r[model]["history"]] for r in results], axis=0)[2:]
        rates[f"{model}_tokens_per_s"] = s["tokens_per_rank_step"] * s["world_size"] / float(np.median(step_s))
    return {**rates, "moe_over_dense": rates["moe_tokens_per_s"] / rates["dense_tokens_per_s"]}


def param_rows(results: list[dict]) -> list[dict]:
    """Per rank: parameters stored (counted from the module) beside the formula's per-rank, total and
    active counts, and the dense twin's size."""
    rows = []
    for r in results:
        m, f = r["moe"], r["moe"]["formula"]
        rows.append({"rank": r["rank"], "experts held": m["expert_ids"], "stored": m["held"]["total"],
                     "stored (formula)": f["per_rank"], "expert params stored": m["held"]["expert"],
                     "model total (formula)": f["total"], "active per token": m["held"]["active"],
                     "active (formula)": f["active"], "dense twin": r["dense"]["params"] if "dense" in r else None})
    return rows


def all_to_all_bytes(results: list[dict]) -> dict[str, int]:
    """Bytes one rank handed to all_to_all_single in the logged step, beside the prediction: 4 per MoE
    layer (dispatch and combine, forward and backward), each an (E, capacity, h) tensor."""
    s, r = results[0]["settings"], results[0]
    n_layer, n_embd, _ = MODEL_SIZES[s["model_size"]]
    cap = capacity(s["tokens_per_rank_step"], s["num_experts"], s["k"], s["capacity_factor"])
    logged = r["moe"]["comm_logged"].get("all_to_all_single", {})
    return {"logged": sum(int(size) * count for size, count in logged.items()),   # JSON made the sizes strings
            "predicted": 4 * n_layer * s["num_experts"] * cap * n_embd * ELEMENT_BYTES[s["precision"]]}
