"""Pipeline parallelism, the model side: GPT-2 as a flat list of DeepSpeed layer specs that a
`PipelineModule` cuts into stages (one per rank), the parameters each stage holds, and the unsplit
reference model. The schedule side (the bubble, DeepSpeed's 1F1B schedule, timing what an engine
runs) is helpers.pipeline_schedule.
"""
from __future__ import annotations

import contextlib
import io
from itertools import pairwise

import torch
from torch import nn
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

PARTITION_METHODS = ("parameters", "uniform", "type:GPT2Block")
TIED_KEY = "token_embedding"   # the input embedding and the LM head share one weight, as in GPT-2


# ---- the model as layer specs ----

def gpt2_config(vocab_size: int, n_positions: int, n_layer: int, n_embd: int, n_head: int) -> GPT2Config:
    """A GPT-2 config with dropout off (runs repeat bitwise) and torch's SDPA attention, which is causal
    without a mask. A standalone GPT2Block has no model around it to choose the attention for it."""
    return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_layer=n_layer, n_embd=n_embd,
                      n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")


class TokenEmbedding(nn.Embedding):
    """Token ids -> vectors; also the LM head's weight (see `lm_head`). Initialised like GPT-2
    (normal, std 0.02): nn.Embedding's N(0, 1) would make the tied head's first logits huge."""

    def __init__(self, vocab_size: int, n_embd: int, std: float = 0.02):
        super().__init__(vocab_size, n_embd)
        nn.init.normal_(self.weight, std=std)


class PositionEmbedding(nn.Module):
    """Adds GPT-2's learned position embedding to the token vectors."""

    def __init__(self, n_positions: int, n_embd: int, std: float = 0.02):
        super().__init__()
        self.wpe = nn.Embedding(n_positions, n_embd)
        nn.init.normal_(self.wpe.weight, std=std)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        return hidden + self.wpe(positions)


def lm_head(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """Logits from the token embedding's own weight (GPT-2's tied output layer)."""
    return nn.functional.linear(hidden, embedding.weight)


def gpt2_layer_specs(config: GPT2Config) -> list:
    """GPT-2 as the flat list of layers a PipelineModule partitions: token embedding, position
    embedding, n_layer transformer blocks, final LayerNorm, LM head.

    Nothing is built here: a LayerSpec is built only on the stage that owns it. The LM head is a
    TiedLayerSpec of the token embedding: the stage holding the head keeps its own copy of the
    embedding weight, DeepSpeed makes the copies equal at start and all-reduces their gradients
    each step (the ReduceTiedGrads instruction), so the model is exactly GPT-2 with tied weights.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    d = config.n_embd
    return [TiedLayerSpec(TIED_KEY, TokenEmbedding, config.vocab_size, d, tied_weight_attr="weight"),
            LayerSpec(PositionEmbedding, config.n_positions, d),
            *[LayerSpec(GPT2Block, config, layer_idx=i) for i in range(config.n_layer)],
            LayerSpec(nn.LayerNorm, d, eps=config.layer_norm_epsilon),
            TiedLayerSpec(TIED_KEY, TokenEmbedding, config.vocab_size, d, forward_fn=lm_head,
                          tied_weight_attr="weight")]


def layer_names(specs: list) -> list[str]:
    """A readable name per layer spec, e.g. 'GPT2Block' or 'lm_head (tied to TokenEmbedding)'."""
    names = []
    for spec in specs:
        forward_fn = getattr(spec, "forward_fn", None)
        names.append(f"{forward_fn.__name__} (tied to {spec.typename.__name__})" if forward_fn
                     else spec.typename.__name__)
    return names


def layer_param_formula(config: GPT2Config) -> list[int]:
    """Parameters of each layer of `gpt2_layer_specs`, from the shapes alone (nothing built).

    Token embedding V d, position embedding n_pos d, block 12 d^2 + 13 d (qkv 3d^2+3d, attention out
    d^2+d, MLP 4d^2+4d and 4d^2+d, two LayerNorms 4d), final LayerNorm 2d, LM head V d (the copy of
    the token embedding a stage holds when it owns the head but not the embedding).
    """
    d, vocab = config.n_embd, config.vocab_size
    return [vocab * d, config.n_positions * d, *[12 * d * d + 13 * d] * config.n_layer, 2 * d, vocab * d]


def stage_param_formula(specs: list, parts: list[int], per_layer: list[int]) -> list[int]:
    """Parameters each stage holds, given DeepSpeed's partition boundaries `parts` (stage s owns layers
    parts[s]..parts[s+1]-1): a tied module is held once per stage that uses it."""
    counts = []
    for start, stop in pairwise(parts):
        seen, total = set(), 0
        for i in range(start, stop):
            key = getattr(specs[i], "key", i)   # TiedLayerSpec: the shared module's key
            if key not in seen:
                seen.add(key)
                total += per_layer[i]
        counts.append(total)
    return counts


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: the logits at position t predict the token at t+1."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build_pipeline(specs: list, num_stages: int, partition_method: str = "parameters", seed: int = 0):
    """A PipelineModule over `specs`: this rank builds only its stage's layers.

    seed_layers=True seeds layer i with seed + i before building it, so every layer starts with the
    same weights whatever the number of stages: the unsplit model (num_stages=1) is the same model.
    partition_method: "parameters" balances parameter counts, "uniform" layer counts,
    "type:GPT2Block" the number of blocks.
    Needs a process group (a launcher, or helpers.runtime.init_single_process for one stage).
    """
    from deepspeed.pipe import PipelineModule
    if partition_method not in PARTITION_METHODS:
        raise ValueError(f"partition_method={partition_method!r} is not one of {PARTITION_METHODS}")
    with contextlib.redirect_stdout(io.StringIO()):   # DeepSpeed prints the seeds and the partition
        return PipelineModule(layers=specs, num_stages=num_stages, loss_fn=lm_loss, seed_layers=True,
                              seed_fn=seed_layer, base_seed=seed, partition_method=partition_method)


def seed_layer(seed) -> None:
    """DeepSpeed's own layer seeding, given a Python int. partition_balanced returns numpy integers as
    stage boundaries, so DeepSpeed's default seeds with numpy.int64, which random.seed refuses from
    Python 3.11 on (TypeError in PipelineModule._build)."""
    from deepspeed.runtime.utils import set_random_seed
    set_random_seed(int(seed))


class UnsplitModel(nn.Module):
    """The same layers, same seed, in one process: a one-stage PipelineModule plus the loss.

    Being a plain nn.Module (not a PipelineModule), a regular DeepSpeedEngine trains it with the
    usual forward/backward/step loop: no schedule, no point-to-point sends, no tied-weight all-reduce.
    """

    def __init__(self, specs: list, seed: int = 0):
        super().__init__()
        self.layers = build_pipeline(specs, num_stages=1, seed=seed)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.layers(input_ids), labels)


def stage_summary(module) -> dict:
    """What this rank's stage of a PipelineModule holds: its layer range, parameters, and the tied ones."""
    parts = [int(i) for i in module.partitions()]   # DeepSpeed returns numpy integers
    tied = sum(p.numel() for m in module.tied_modules.values() for p in m.parameters())
    return {"stage": module.stage_id, "parts": parts, "layers": parts[module.stage_id:module.stage_id + 2],
            "n_params": sum(p.numel() for p in module.parameters()), "tied_params": tied}
