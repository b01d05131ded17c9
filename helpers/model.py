"""The model every notebook trains: GPT-2 built from a config (random weights, nothing downloaded), its sizes,
its parameter count from the shapes alone, activation checkpointing and sampling; and the Llama of the same
sizes that notebook 07 splits with tensor and sequence parallelism."""
from __future__ import annotations

import torch

# (layers, hidden size, attention heads). "gpt2" is the body of GPT-2 small (124M with its vocab).
MODEL_SIZES = {"tiny": (2, 128, 4), "small": (4, 256, 4), "base": (6, 384, 6), "gpt2": (12, 768, 12)}


def auto_model_size(runtime) -> str:
    """Small enough to train in a minute here: tiny on a CPU, larger on bigger GPUs."""
    if not runtime.is_gpu:
        return "tiny"
    # torch reports 24.2 GB on an A10G or L4 (small), 25.8 GB on an RTX 4090 (sold as 24 GB) and more on larger cards (base)
    return "small" if runtime.memory_gb < 25.7 else "base"


def build_model(vocab_size: int, n_positions: int, size: str = "tiny", pad_token_id: int | None = None,
                seed: int = 0):
    """A randomly initialised GPT-2 from a config (nothing downloaded). Dropout is off: it keeps runs
    bitwise repeatable, and the held-out loss (fresh samples) shows whether seeing a sample twice hurts."""
    if size not in MODEL_SIZES:
        raise ValueError(f"model_size={size!r} is not one of {sorted(MODEL_SIZES)} (or 'auto')")
    from transformers import GPT2Config, GPT2LMHeadModel   # heavy: only when a model is built
    n_layer, n_embd, n_head = MODEL_SIZES[size]
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=None, eos_token_id=None, pad_token_id=pad_token_id)
    # use_cache stays on in training, though no one reads the cache: without a cache (and without an attention
    # mask) transformers 5's causal-mask builder looks for packed sequences with a host read of the position ids
    # (masking_utils.create_causal_mask -> find_packed_sequence_indices), a GPU sync in every forward; the cache
    # object only holds references to keys and values autograd keeps anyway (counted in tests/test_host_reads.py).
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"   # transformers warns when a model leaves it unset
    return model


LLAMA_MLP_MULTIPLE = 64   # SwiGLU's inner width: 8h/3 (the parameters of GPT-2's 4h MLP) rounded up to this


def llama_inner_size(n_embd: int) -> int:
    return -(-8 * n_embd // 3 // LLAMA_MLP_MULTIPLE) * LLAMA_MLP_MULTIPLE


def build_llama(vocab_size: int, n_positions: int, size: str = "tiny", seed: int = 0, attention: str = "sdpa"):
    """A randomly initialised Llama (RMSNorm, rotary positions, SwiGLU MLP, untied LM head) with the depth,
    width and heads of GPT-2 `size`, for notebook 07's tensor and sequence parallelism: DeepSpeed's AutoTP
    refuses GPT-2 for training, and its Ulysses attention for HF models reads `num_key_value_heads`, which
    GPT-2's config lacks. SDPA attention: Ulysses refuses 'eager' (it would build an s x s mask)."""
    if size not in MODEL_SIZES:
        raise ValueError(f"model_size={size!r} is not one of {sorted(MODEL_SIZES)}")
    from transformers import LlamaConfig, LlamaForCausalLM   # heavy: only when a model is built
    n_layer, n_embd, n_head = MODEL_SIZES[size]
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=llama_inner_size(n_embd),
                      num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head,
                      max_position_embeddings=n_positions, tie_word_embeddings=False, attn_implementation=attention,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.loss_type = "ForCausalLM"
    return model


def llama_param_count(vocab_size: int, n_layer: int, n_embd: int) -> dict[str, int]:
    """`build_llama`'s parameters from its shapes, split as tensor parallelism splits them: the linears of
    each block (q, k, v, o: 4h^2; gate, up, down: 3hI) and the LM head (Vh) are cut in t pieces; the
    embedding (Vh) and the RMSNorm weights (2h per block, h at the end) stay whole on every rank."""
    block_linears = 4 * n_embd * n_embd + 3 * n_embd * llama_inner_size(n_embd)
    split = n_layer * block_linears + vocab_size * n_embd
    whole = vocab_size * n_embd + (2 * n_layer + 1) * n_embd
    return {"split": split, "whole": whole, "total": split + whole}


def enable_checkpointing(model) -> None:
    """Activation checkpointing: keep each block's input, recompute the block in backward."""
    model.config.use_cache = False   # a KV cache is useless in training and refused with checkpointing
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()   # transformers 5.x renamed it; non-reentrant torch.utils.checkpoint by default


def gpt2_block_param_count(d: int) -> int:
    """One GPT-2 block of width d: attention qkv 3d^2+3d, attention out d^2+d, MLP 4d^2+4d and 4d^2+d,
    two LayerNorms 4d, i.e. 12d^2 + 13d."""
    return 12 * d * d + 13 * d


def gpt2_param_count(vocab_size: int, n_positions: int, n_layer: int, n_embd: int) -> int:
    """Parameters of a GPT-2 with tied input/output embeddings, counted from its shapes: the blocks, token
    (V d) and position (n_pos d) embeddings and the final LayerNorm (2d)."""
    return n_layer * gpt2_block_param_count(n_embd) + (vocab_size + n_positions) * n_embd + 2 * n_embd


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int = 40, seed: int = 0,
             temperature: float = 1.0) -> str:
    """Sample a continuation of `prompt` (temperature sampling, seeded)."""
    device = next(model.parameters()).device
    enc = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    # suppress_tokens: padding is not text. (An untrained model samples it, and the next forward then
    # looks padded to transformers, which warns.)
    out = model.generate(enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
                         max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                         top_k=0, pad_token_id=tokenizer.pad_token_id, suppress_tokens=[tokenizer.pad_token_id])
    return tokenizer.decode(out[0], skip_special_tokens=True)
