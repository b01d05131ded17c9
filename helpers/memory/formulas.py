"""The memory formulas, pure arithmetic: model states by ZeRO stage, activations per layer, model shapes.

Model states = parameters + gradients + optimizer state (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", Fig. 1). Activations are what the forward pass
keeps for the backward pass (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4.1): model states are fixed by the parameter count, activations grow with the
batch and the sequence (quadratically, through attention scores), so at long sequences they run out first.

No torch at import time: the planner and the widget use these without building a model.
"""
from __future__ import annotations

from functools import lru_cache

from ..errors import require_positive_int
from ..precision import ELEMENT_BYTES, check_name

GB = 1e9   # the paper's GB (its 7.5B-parameter example: 120, 31.4, 16.6, 1.9 GB on 64 GPUs)
VOCAB = 50257   # GPT-2's BPE vocabulary, which GPT-3 kept
# name -> (layers, hidden, heads, context). GPT-2's four sizes (64-dim heads) and GPT-3's larger shapes
# (Brown et al. 2020, Table 2.1), which show where ZeRO-3, offload and several nodes become necessary.
# The GPT-3 paper's 5140 for 13B is a typo for 5120 (40 heads x 128).
SHAPES = {"GPT-2 124M": (12, 768, 12, 1024), "GPT-2 355M": (24, 1024, 16, 1024),
          "GPT-2 774M": (36, 1280, 20, 1024), "GPT-2 1.5B": (48, 1600, 25, 1024),
          "GPT-3 2.7B": (32, 2560, 32, 2048), "GPT-3 6.7B": (32, 4096, 32, 2048),
          "GPT-3 13B": (40, 5120, 40, 2048), "GPT-3 175B": (96, 12288, 96, 2048)}


def zero_model_states(n_params: float, n_ranks: int, stage: int, param_bytes: float = 2,
                      grad_bytes: float = 2, optimizer_bytes: float = 12) -> dict:
    """Bytes of model states per rank (paper Fig. 1). Stage 1 partitions the optimizer state across
    the N ranks, stage 2 also the gradients, stage 3 also the parameters."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} is not a ZeRO stage (0-3)")
    require_positive_int("n_ranks", n_ranks)

    def per_rank(bytes_each, partitioned_from_stage):
        return bytes_each * n_params / (n_ranks if stage >= partitioned_from_stage else 1)

    out = {"params": per_rank(param_bytes, 3), "grads": per_rank(grad_bytes, 2),
           "optimizer": per_rank(optimizer_bytes, 1)}
    return {**out, "total": sum(out.values())}


def bytes_per_param(precision: str, stage: int) -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes per parameter DeepSpeed 0.19 keeps with AdamW (measured with
    `measured.held_bytes`, stages 0-3, fp32 and bf16; notebook 04 tells why):
    16-bit: (2, 2, 12) at every stage, the fp32 masters in FP16_UnfusedOptimizer.fp32_groups (stage 0),
      DeepSpeedZeroOptimizer.single_partition_of_fp32_groups (1-2), ..._Stage3.fp32_partitioned_groups_flat (3).
    fp32: (4, 4, 8) at stage 0 (no master copy), (4, 4, 12) at stages 1-3 (the ZeRO optimizers clone one).
    """
    check_name(precision)
    size = ELEMENT_BYTES[precision]
    return size, size, 8 if (precision, stage) == ("fp32", 0) else 12


def paper_table(n_params: float, n_ranks_list) -> list[dict]:
    """Rows {n_ranks, stage, params, grads, optimizer, total} in GB per rank (the paper's 2/2/12 bytes)."""
    return [{"n_ranks": n, "stage": s, **{k: v / GB for k, v in zero_model_states(n_params, n, s).items()}}
            for n in n_ranks_list for s in (0, 1, 2, 3)]


@lru_cache(maxsize=1)
def models() -> dict[str, dict]:
    """name -> {name, params, largest_layer_params, n_layer, hidden, heads, vocab, context} for SHAPES.
    Parameters are counted from the shapes with tied embeddings; the largest layer, which ZeRO-3 gathers
    whole, is the token embedding (vocab x hidden) in all of them."""
    from ..model import gpt2_param_count   # helpers.model imports torch: only when first asked
    return {name: {"name": name, "params": gpt2_param_count(VOCAB, context, n_layer, hidden),
                   "largest_layer_params": VOCAB * hidden, "n_layer": n_layer, "hidden": hidden,
                   "heads": heads, "vocab": VOCAB, "context": context}
            for name, (n_layer, hidden, heads, context) in SHAPES.items()}


def gpt2_sizes() -> list[dict]:
    """The four GPT-2 sizes of `models()`, smallest first."""
    return [shape for name, shape in models().items() if name.startswith("GPT-2")]


# Attention implementations the activation count knows (HF's attn_implementation names)
ATTENTIONS = ("eager", "sdpa", "flash")


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                               bytes_per_element: float = 2, checkpointing: bool = False,
                               dropout: bool = False, attention: str = "eager") -> float:
    """Bytes one transformer layer keeps for its backward pass.

    Counted tensor by tensor as in the paper (s = seq_len, b = micro_batch, h = hidden, a = heads):
      attention: QKV-projection input sbh, Q and K 2sbh, softmax output as^2b, [softmax-dropout output
        as^2b], V sbh, output-projection input sbh              -> 5sbh + as^2b  [+ as^2b]
      MLP: first-linear input sbh, GeLU input 4sbh, second-linear input 4sbh -> 9sbh
      two LayerNorms: their inputs, sbh each                  -> 2sbh
    Dropout adds 1-byte masks: as^2b (attention probabilities), sbh (after attention), sbh (after MLP).

    So the paper's sbh(34 + 5as/h) is the 16-bit case with dropout: elements (16sbh + 2as^2b) x 2 bytes
    + masks (2sbh + as^2b) x 1 byte. Without dropout there are no masks and the dropout output is the
    softmax itself: (16sbh + as^2b) x bytes_per_element, i.e. sbh(32 + 2as/h) in 16-bit, twice that in fp32.
    With full checkpointing a layer keeps only its input: bytes_per_element x sbh (2sbh in 16-bit);
    the one layer being recomputed is added once per model by `activation_bytes`.

    attention: "eager" (HF's `attn_implementation="eager"`, the paper's count) stores the a s^2 b softmax.
    "sdpa" or "flash" (HF's default `scaled_dot_product_attention`, flash attention) are fused kernels that
    keep no s^2 tensor: they save Q, K, V and the output (counted above) plus one fp32 log-sum-exp per row
    (4 a s b bytes) and recompute the scores in backward; without dropout that replaces the as^2b term.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}")
    sbh, as2b = seq_len * micro_batch * hidden, heads * seq_len ** 2 * micro_batch
    if checkpointing:
        return bytes_per_element * sbh
    if attention != "eager":
        if dropout:
            raise ValueError("dropout with a fused attention kernel is not modelled: use attention='eager'")
        return 16 * sbh * bytes_per_element + 4 * heads * seq_len * micro_batch
    if not dropout:
        return (16 * sbh + as2b) * bytes_per_element
    return (16 * sbh + 2 * as2b) * bytes_per_element + (2 * sbh + as2b)   # + the 1-byte masks


def activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, n_layer: int, vocab: int,
                     bytes_per_element: float = 2, checkpointing: bool = False, attention: str = "eager") -> dict:
    """Activation bytes of the whole model (no dropout), by term: layers (n_layer x per layer); recompute
    (with checkpointing, one layer's full activations while its backward runs); logits, which follow the
    vocabulary: the loss's fp32 log-softmax (the paper's 4sbv) plus the logits HF's output holds.
    attention: as in `activation_bytes_per_layer` ("eager" keeps the s^2 scores, "sdpa"/"flash" do not)."""
    def per_layer(ckpt):
        return activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, bytes_per_element, ckpt,
                                          attention=attention)

    out = {"layers": n_layer * per_layer(checkpointing), "recompute": per_layer(False) if checkpointing else 0.0,
           "logits": seq_len * micro_batch * vocab * (4 + bytes_per_element)}
    return {**out, "total": sum(out.values())}


def activation_bytes_for(model_size: str, seq_len: int, micro_batch: int, checkpointing: bool,
                         precision: str = "fp32", vocab: int = 512) -> dict:
    """`activation_bytes` for one of the tutorial's model sizes (helpers.model.MODEL_SIZES; no dropout:
    build_model turns it off)."""
    from ..model import MODEL_SIZES
    n_layer, hidden, heads = MODEL_SIZES[model_size]
    return activation_bytes(seq_len, micro_batch, hidden, heads, n_layer, vocab, ELEMENT_BYTES[precision],
                            checkpointing)
