"""The memory explorer's logic: for a GPT-shaped model trained on a chosen GPU cluster with a ZeRO stage,
offload, precision, micro-batch, gradient accumulation and activation checkpointing, the GB each GPU
needs, whether that fits, and the DeepSpeed config that runs it.

Plain functions over helpers.fit (model states + activations + overhead, the formulas notebook 05
checks) and helpers.config (the config and its validation), so the widget in helpers.widgets stays a
thin layer and everything here is testable without a browser.
"""
from __future__ import annotations

from functools import lru_cache

from . import config as ds_config
from . import fit
from .memory import gpt2_sizes

# Capacities as sold. Every figure here is in 10^9 bytes (helpers.memory.GB) while a card's "GB" are
# GiB (7% more), which, with the memory the driver reserves, leaves a cautious margin.
# bf16 tensor cores arrived with Ampere (sm_80); Turing and Volta cards train in fp16.
GPUS = {
    "T4": {"memory_gb": 16, "bf16": False, "arch": "Turing"},
    "V100 32GB": {"memory_gb": 32, "bf16": False, "arch": "Volta"},
    "A10G": {"memory_gb": 24, "bf16": True, "arch": "Ampere"},
    "L4": {"memory_gb": 24, "bf16": True, "arch": "Ada"},
    "A100 40GB": {"memory_gb": 40, "bf16": True, "arch": "Ampere"},
    "A100 80GB": {"memory_gb": 80, "bf16": True, "arch": "Ampere"},
    "H100 80GB": {"memory_gb": 80, "bf16": True, "arch": "Hopper"},
    "H200": {"memory_gb": 141, "bf16": True, "arch": "Hopper"},
}
VOCAB = 50257   # GPT-2's BPE vocabulary, which GPT-3 kept
# GPT-3's shapes (Brown et al. 2020, Table 2.1: layers, d_model, heads; context 2048) show where ZeRO-3,
# offload and several nodes become necessary. The paper's 5140 for 13B is a typo for 5120 (40 heads x 128).
GPT3_SHAPES = {"2.7B": (32, 2560, 32), "6.7B": (32, 4096, 32), "13B": (40, 5120, 40), "175B": (96, 12288, 96)}
PRECISIONS = ds_config.PRECISIONS
OFFLOAD_CHOICES = tuple(fit.OFFLOADS)


@lru_cache(maxsize=1)
def models() -> dict[str, dict]:
    """name -> {params, largest_layer_params, n_layer, hidden, heads, vocab, context}: the four GPT-2
    sizes (helpers.memory.gpt2_sizes; every one has 64-dim heads) and GPT-3's larger shapes. The largest
    layer, which ZeRO-3 gathers whole, is the (tied) token embedding, vocab x hidden, in all of them."""
    from .model import gpt2_param_count   # imports torch and transformers: only when first needed
    table = {f"GPT-2 {s['name']}": {"params": s["params"], "largest_layer_params": s["largest_layer_params"],
                                    "n_layer": s["n_layer"], "hidden": s["n_embd"], "heads": s["n_embd"] // 64,
                                    "vocab": VOCAB, "context": 1024}
             for s in gpt2_sizes(VOCAB, 1024)}
    for name, (n_layer, hidden, heads) in GPT3_SHAPES.items():
        table[f"GPT-3 {name}"] = {"params": gpt2_param_count(VOCAB, 2048, n_layer, hidden),
                                  "largest_layer_params": VOCAB * hidden, "n_layer": n_layer, "hidden": hidden,
                                  "heads": heads, "vocab": VOCAB, "context": 2048}
    return table


def _whole_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a whole number >= 1")


def check(model: str, gpu: str, n_gpus_per_node: int, n_nodes: int, stage: int, offload: str, precision: str,
          micro_batch: int, grad_accum: int, checkpointing: bool, seq_len: int | None) -> int:
    """Raise ValueError naming the field (and the fix) for any choice DeepSpeed or the hardware would
    refuse; return the sequence length to use (the model's context when seq_len is None)."""
    if model not in models():
        raise ValueError(f"model={model!r} is not one of {list(models())}")
    if gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r} is not one of {list(GPUS)}: pick one, or add it to "
                         "helpers.explorer.GPUS with its memory and bf16 support")
    for name, value in (("n_gpus_per_node", n_gpus_per_node), ("n_nodes", n_nodes),
                        ("micro_batch", micro_batch), ("grad_accum", grad_accum)):
        _whole_number(name, value)
    if isinstance(stage, bool) or stage not in ds_config.ZERO_STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage: use 0, 1, 2 or 3")
    if offload not in fit.OFFLOADS:
        raise ValueError(f"offload={offload!r} is not one of {OFFLOAD_CHOICES} "
                         "(NVMe offload, ZeRO-Infinity, is not modelled here)")
    if stage not in fit.OFFLOADS[offload]:
        if offload == "optimizer":
            raise ValueError(f"offload='optimizer' needs ZeRO stage 1, 2 or 3 (stage is {stage}): DeepSpeed's "
                             "offload_optimizer moves the optimizer partition, and stage 0 partitions nothing")
        raise ValueError(f"offload='optimizer+params' needs ZeRO stage 3 (stage is {stage}): only stage 3 "
                         "partitions the parameters that offload_param moves; use stage=3 or offload='optimizer'")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}")
    if precision == "bf16" and not GPUS[gpu]["bf16"]:
        raise ValueError(f"precision='bf16' on the {gpu}: {GPUS[gpu]['arch']} GPUs have no bf16 tensor cores "
                         "(they arrived with Ampere); use precision='fp16' (the same memory) or a newer GPU")
    if not isinstance(checkpointing, bool):
        raise ValueError(f"checkpointing={checkpointing!r} must be True or False")
    context = models()[model]["context"]
    if seq_len is None:
        return context
    _whole_number("seq_len", seq_len)
    if seq_len > context:
        raise ValueError(f"seq_len={seq_len} is longer than the {model}'s context of {context} tokens: "
                         f"use seq_len <= {context}")
    return seq_len


def _plan_kwargs(shape: dict, seq_len: int, precision: str, world_size: int, memory_gb: float) -> dict:
    """helpers.fit.plan's arguments for this model, sequence, precision and cluster."""
    return dict(n_params=shape["params"], gpu_memory_gb=memory_gb, n_gpus=world_size, seq_len=seq_len,
                hidden=shape["hidden"], n_layer=shape["n_layer"], heads=shape["heads"], vocab=shape["vocab"],
                precision=precision, largest_layer_params=shape["largest_layer_params"])


def estimate(model: str = "GPT-2 1.5B", gpu: str = "T4", n_gpus_per_node: int = 1, n_nodes: int = 1,
             stage: int = 0, offload: str = "none", precision: str = "fp16", micro_batch: int = 1,
             grad_accum: int = 1, checkpointing: bool = False, seq_len: int | None = None) -> dict:
    """GB per GPU by part, host GB per node, and whether it fits, for one training setup.

    The row of helpers.fit.plan for these choices (model_states_gb, activations_gb, overhead_gb, gpu_gb,
    plus stage/offload/checkpointing/micro_batch, so helpers.plots.plan_bars can draw it), and:
    gpu_memory_gb, free_gb; host_gb_per_node (offloaded states: each node's ranks hold their share);
    fits and reason ("needs 37.5 GB per GPU, the T4 has 16 GB"); world_size, global_batch (micro x
    accum x world) and tokens_per_step; notes for the reader; suggestion: when it does not fit, the
    fastest setup that does on the same GPUs (helpers.fit.best_plan), or None.
    Gradient accumulation changes the batch, not the memory: gradients accumulate in place.
    """
    seq_len = check(model, gpu, n_gpus_per_node, n_nodes, stage, offload, precision, micro_batch, grad_accum,
                    checkpointing, seq_len)
    shape, memory_gb, world = models()[model], GPUS[gpu]["memory_gb"], n_gpus_per_node * n_nodes
    kwargs = _plan_kwargs(shape, seq_len, precision, world, memory_gb)
    rows = fit.plan(**kwargs, micro_batches=(micro_batch,))
    row = next(r for r in rows if (r["stage"], r["offload"], r["checkpointing"]) == (stage, offload, checkpointing))
    host_per_node = row.pop("cpu_gb") / n_nodes   # plan's host figure is all ranks' shares together
    verdict = "fits" if row["fits"] else "does not fit"
    reason = f"{verdict}: needs {row['gpu_gb']:.1f} GB per GPU, the {gpu} has {memory_gb:g} GB"
    global_batch = micro_batch * grad_accum * world
    return {**row, "model": model, "gpu": gpu, "n_params": shape["params"], "seq_len": seq_len,
            "precision": precision, "gpu_memory_gb": memory_gb, "free_gb": memory_gb - row["gpu_gb"],
            "host_gb_per_node": host_per_node, "reason": reason, "world_size": world,
            "grad_accum": grad_accum, "global_batch": global_batch, "tokens_per_step": global_batch * seq_len,
            "notes": notes(gpu, world, stage, offload, precision, checkpointing, host_per_node),
            "suggestion": None if row["fits"] else fit.best_plan(**kwargs)}


def notes(gpu: str, world_size: int, stage: int, offload: str, precision: str, checkpointing: bool,
          host_gb_per_node: float) -> list[str]:
    """What the numbers don't say: the cost of each trick chosen, and choices that buy nothing."""
    out = []
    if world_size == 1 and stage > 0:
        out.append("ZeRO partitions across GPUs: on 1 GPU there is nothing to split, so stages 1-3 hold "
                   "about what stage 0 holds; only offload moves states off the GPU.")
    if offload != "none":
        out.append(f"Offload needs {host_gb_per_node:.1f} GB of host RAM per node and moves gradients "
                   f"{'and weights ' if offload == 'optimizer+params' else ''}over PCIe every step: slower steps.")
    if checkpointing:
        out.append("Checkpointing recomputes each layer's forward pass during backward: about 1/3 more compute.")
    if precision == "fp32" and GPUS[gpu]["bf16"]:
        out.append(f"The {gpu} has bf16: it halves parameter and activation bytes and runs on tensor cores.")
    return out


def config_for(model: str = "GPT-2 1.5B", gpu: str = "T4", n_gpus_per_node: int = 1, n_nodes: int = 1,
               stage: int = 0, offload: str = "none", precision: str = "fp16", micro_batch: int = 1,
               grad_accum: int = 1, checkpointing: bool = False, seq_len: int | None = None) -> dict:
    """The DeepSpeed config for these choices (helpers.config.build_config), validated for CUDA and
    world size n_gpus_per_node x n_nodes; train_batch_size = micro_batch x grad_accum x world size.

    model, seq_len and checkpointing are checked but leave no trace in the config: DeepSpeed's
    "activation_checkpointing" block only configures deepspeed.checkpointing for models that call it
    (Megatron-style); an HF model turns checkpointing on itself (helpers.model.enable_checkpointing).
    """
    check(model, gpu, n_gpus_per_node, n_nodes, stage, offload, precision, micro_batch, grad_accum,
          checkpointing, seq_len)
    world = n_gpus_per_node * n_nodes
    config = ds_config.build_config(micro_batch=micro_batch, grad_accum=grad_accum, world_size=world,
                                    zero_stage=stage, precision=precision, offload_optimizer=offload != "none",
                                    offload_param=offload == "optimizer+params")
    return ds_config.validate(config, device="cuda", world_size=world)
