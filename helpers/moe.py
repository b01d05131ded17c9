"""Mixture of experts: a GPT-2 whose MLPs are DeepSpeed MoE layers, its dense twin, and parameter counts.

A mixture-of-experts (MoE) layer holds E copies ("experts") of a block's MLP and a small gate, one
linear map h -> E, that sends each token to its top-k experts. The model therefore *stores* E MLPs
per block but *runs* only k of them per token: parameters grow with E, compute per token with k.
With expert parallelism (`ep_size` ranks) each rank stores only E / ep_size of the experts and tokens
travel to the rank holding their expert by an all-to-all, there and back.

`MoEGPT` is `helpers.model.build_model`'s GPT-2 with each `block.mlp` replaced by
`deepspeed.moe.layer.MoE(expert=that MLP)`; `dense_twin` is the same GPT-2 with MLPs k times wider,
so both run the same number of parameters per token. `moe_param_counts` gives total / active /
per-rank parameter counts from the shapes alone; `count_params` counts the modules themselves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .model import MODEL_SIZES, build_model, gpt2_param_count

GPT2_MLP_RATIO = 4   # GPT-2's MLP is h -> 4h -> h


def check_moe_args(num_experts: int, ep_size: int = 1, k: int = 1, world_size: int | None = None) -> None:
    """Raise ValueError naming the problem and the fix, before DeepSpeed asserts (or hangs) on it."""
    for name, value in (("num_experts", num_experts), ("ep_size", ep_size), ("k", k)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
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
    """Parameter counts of `MoEGPT` from its shapes (every block's MLP an MoE layer).

    body    everything but the MLPs: embeddings, attention, LayerNorms (shared by all tokens)
    expert  one expert = one GPT-2 MLP, 8h^2 + 5h
    gate    one layer's router, an h x E matrix without bias
    total   body + layers x (gate + E x expert)          what the model stores
    active  body + layers x (gate + k x expert)          what one token runs through
    per_rank body + layers x (gate + E/ep_size x expert) what one expert-parallel rank stores
    dense_twin  the same GPT-2 with MLPs k x 4h wide: active minus the gates and (k - 1) output biases
    """
    check_moe_args(num_experts, ep_size, k)
    expert = mlp_param_count(n_embd, GPT2_MLP_RATIO * n_embd)
    body = gpt2_param_count(vocab_size, n_positions, n_layer, n_embd) - n_layer * expert
    gate = n_embd * num_experts

    def with_experts(n: int) -> int:
        return body + n_layer * (gate + n * expert)

    return {"body": body, "expert": expert, "gate": gate, "total": with_experts(num_experts),
            "active": with_experts(k), "per_rank": with_experts(num_experts // ep_size),
            "experts_total": n_layer * num_experts * expert,
            "experts_per_rank": n_layer * num_experts // ep_size * expert,
            "dense_twin": body + n_layer * mlp_param_count(n_embd, k * GPT2_MLP_RATIO * n_embd)}


def moe_param_counts_for_size(vocab_size: int, n_positions: int, size: str, num_experts: int, k: int = 1,
                              ep_size: int = 1) -> dict[str, int]:
    """`moe_param_counts` for one of helpers.model.MODEL_SIZES ("tiny", "small", ...)."""
    n_layer, n_embd, _ = MODEL_SIZES[size]
    return moe_param_counts(vocab_size, n_positions, n_layer, n_embd, num_experts, k, ep_size)


def moe_layers(model: nn.Module) -> list:
    """The DeepSpeed MoE layers of a model, in order."""
    from deepspeed.moe.layer import MoE
    return [m for m in model.modules() if isinstance(m, MoE)]


def count_params(model: nn.Module, k: int | None = None) -> dict[str, int]:
    """Count the parameters this process's module really holds (no formula): DeepSpeed marks expert
    parameters (`is_moe_param`), so they can be told from the shared ones. With k, also the
    parameters one token runs through: every shared one plus k experts' worth in each MoE layer.
    "local_experts" is the number of experts per MoE layer this process stores."""
    from deepspeed.moe.utils import is_moe_param
    params = list(model.parameters())   # tied embeddings are listed once
    expert = sum(p.numel() for p in params if is_moe_param(p))
    layers = moe_layers(model)
    counts = {"total": sum(p.numel() for p in params), "expert": expert,
              "shared": sum(p.numel() for p in params if not is_moe_param(p)),
              "local_experts": [layer.num_local_experts for layer in layers]}
    if k is not None:
        one_expert = [sum(p.numel() for p in layer.deepspeed_moe.experts.deepspeed_experts[0].parameters())
                      for layer in layers]
        counts["active"] = counts["shared"] + k * sum(one_expert)
    return counts


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


class ContiguousExpert(nn.Module):
    """A GPT-2 MLP as a DeepSpeed expert. With more than one expert per rank, DeepSpeed hands each expert
    a strided slice of its token buffer (deepspeed/moe/experts.py, `inputs.chunk(..., dim=1)`), and
    transformers' Conv1D reshapes its input with .view, which a strided slice refuses."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden_states.contiguous())


class MoEFeedForward(nn.Module):
    """Stands in for a GPT-2 block's MLP. The block expects a tensor back; DeepSpeed's MoE returns
    (output, aux loss, expert counts), so this keeps the last two for the model to collect."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe
        self.l_aux = self.exp_counts = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output, self.l_aux, self.exp_counts = self.moe(hidden_states)
        return output


@dataclass
class MoEOutput:
    loss: torch.Tensor | None   # lm_loss + aux_loss_coef x aux_loss: what to backpropagate
    lm_loss: torch.Tensor | None
    aux_loss: torch.Tensor      # load-balancing loss summed over the MoE layers (1 per layer when balanced)
    logits: torch.Tensor
    exp_counts: torch.Tensor    # (layers, E): tokens this process routed to each expert (before dropping)


class MoEGPT(nn.Module):
    """`build_model`'s GPT-2 with every block's MLP replaced by a DeepSpeed MoE layer of `num_experts`
    experts, each starting as a copy of that MLP (DeepSpeed deep-copies the expert it is given).

    forward(input_ids, labels) returns an `MoEOutput`. The auxiliary loss is Switch/GShard's
    load-balancing loss E x sum_e (mean gate probability of e) x (fraction of tokens sent to e):
    1 when tokens spread evenly, up to E when one expert takes them all. Adding aux_loss_coef times
    it to the loss keeps the router from collapsing onto a few experts. Each expert takes at most
    `capacity(tokens, E, k, capacity_factor, min_capacity)` tokens per forward; the rest are dropped.
    With ep_size > 1 the model must run under DeepSpeed (deepspeed.initialize sets up the expert groups).
    """

    def __init__(self, vocab_size: int, n_positions: int, size: str = "tiny", num_experts: int = 4, k: int = 1,
                 ep_size: int = 1, capacity_factor: float = 1.0, min_capacity: int = 4,
                 aux_loss_coef: float = 0.01, pad_token_id: int | None = None, seed: int = 0):
        from deepspeed.moe.layer import MoE
        check_moe_args(num_experts, ep_size, k)
        super().__init__()
        self.gpt = build_model(vocab_size, n_positions, size, pad_token_id, seed)
        self.num_experts, self.k, self.ep_size, self.aux_loss_coef = num_experts, k, ep_size, aux_loss_coef
        for block in self.gpt.transformer.h:
            layer = MoE(self.gpt.config.n_embd, expert=ContiguousExpert(block.mlp), num_experts=num_experts,
                        ep_size=ep_size, k=k, capacity_factor=capacity_factor, min_capacity=min_capacity)
            block.mlp = MoEFeedForward(layer)

    @property
    def feed_forwards(self) -> list[MoEFeedForward]:
        return [block.mlp for block in self.gpt.transformer.h]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> MoEOutput:
        out = self.gpt(input_ids=input_ids, labels=labels)
        aux = torch.stack([ff.l_aux for ff in self.feed_forwards]).sum()
        counts = torch.stack([ff.exp_counts for ff in self.feed_forwards])
        loss = None if labels is None else out.loss + self.aux_loss_coef * aux
        return MoEOutput(loss, out.loss, aux, out.logits, counts)


def dense_twin(vocab_size: int, n_positions: int, size: str = "tiny", k: int = 1, pad_token_id: int | None = None,
               seed: int = 0) -> nn.Module:
    """The dense GPT-2 that runs as many parameters per token as `MoEGPT` with top-k routing: the same
    model (same seed, same embeddings and attention) with MLPs k x 4h wide. For k=1 it is exactly
    `build_model`'s GPT-2; the MoE model has only its gates (h x E per layer) more per token."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be a positive integer")
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    model = build_model(vocab_size, n_positions, size, pad_token_id, seed)
    if k > 1:
        torch.manual_seed(seed)
        for block in model.transformer.h:
            block.mlp = GPT2MLP(k * GPT2_MLP_RATIO * model.config.n_embd, model.config)
            block.mlp.apply(model._init_weights)   # GPT-2's init, incl. the 1/sqrt(2 n_layer) output scaling
    return model
