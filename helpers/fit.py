""""What fits": the bytes one GPU needs for each combination of ZeRO stage, CPU offload, activation
checkpointing and micro-batch, from the formulas in helpers.memory (model states) and
helpers.activations (activations). A planning aid, not a promise: see OVERHEAD_GB and `plan`.
"""
from __future__ import annotations

from .activations import activation_bytes
from .memory import GB, bytes_per_param, zero_model_states

# Fixed bytes a GPU loses before the first tensor, in GB: the CUDA context (~0.3-0.5 GB with lazy
# module loading), cuBLAS/NCCL workspaces, and allocator fragmentation. 1 GB is a round, cautious figure.
OVERHEAD_GB = 1.0
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# Where the states live, least to most host traffic. DeepSpeed allows offload_optimizer at stages 1-3
# and offload_param only at stage 3.
OFFLOADS = {"none": (0, 1, 2, 3), "optimizer": (1, 2, 3), "optimizer+params": (3,)}
FP32_GRAD_COPY = 4    # bytes/param: the ZeRO optimizers' transient fp32 copy of their gradient partition


def model_state_bytes(n_params: float, n_gpus: int, stage: int, offload: str = "none",
                      precision: str = "bf16", largest_layer_params: float = 0,
                      counting: str = "deepspeed") -> dict:
    """{"gpu", "cpu"} bytes of model states: GPU per rank, CPU for the whole node (all n_gpus ranks).

    counting="paper": ZeRO paper bytes (helpers.memory.bytes_per_param). counting="deepspeed": as
    DeepSpeed 0.19's estimators count, which also hold the transient fp32 copy of the gradient
    partition (4 bytes/param/N at stages 0-2; its stage-3 estimator adds 2, not 4: 18/N vs 16/N).
    Stage 3 also needs room to gather one layer's 16-bit params and grads: 4 bytes x largest layer.
    Offloading the optimizer moves fp32 master + Adam state and the fp32 gradients to host RAM (the
    GPU streams its gradients out through buckets, which DeepSpeed's estimator, like us, leaves out);
    offloading params leaves only the gathered layer on the GPU.
    """
    if offload not in OFFLOADS or stage not in OFFLOADS[offload]:
        raise ValueError(f"offload={offload!r} is not possible at ZeRO stage {stage}")
    p, g, k = bytes_per_param(precision, stage)
    states = zero_model_states(n_params, n_gpus, stage, p, g, k)
    extra = 0.0
    if counting == "deepspeed":
        extra = (2 if stage == 3 else FP32_GRAD_COPY) * n_params / (n_gpus if stage >= 1 else 1)
    elif counting != "paper":
        raise ValueError(f"counting={counting!r} is not 'paper' or 'deepspeed'")
    working_set = 4 * largest_layer_params if stage == 3 else 0.0
    if offload == "none":
        return {"gpu": states["total"] + extra + working_set, "cpu": 0.0}
    on_host = (k + FP32_GRAD_COPY) * n_params   # all ranks' partitions together
    if offload == "optimizer":
        # Stage 1 still holds its full 16-bit gradients until the accumulation boundary.
        gpu = states["params"] + (states["grads"] if stage == 1 else 0.0) + working_set
        return {"gpu": gpu, "cpu": on_host}
    return {"gpu": working_set, "cpu": on_host + p * n_params}


def _preference(row: dict) -> tuple:
    """Fastest first: offload is the slowest trick (every step crosses PCIe), then checkpointing
    (~1/3 more compute), then higher ZeRO stages (more communication); the largest micro-batch first
    (better GPU utilisation; reach the global batch with gradient accumulation)."""
    return (list(OFFLOADS).index(row["offload"]), row["checkpointing"], row["stage"], -row["micro_batch"])


def plan(n_params: float, gpu_memory_gb: float, n_gpus: int = 1, seq_len: int = 1024, hidden: int = 768,
         n_layer: int = 12, heads: int = 12, vocab: int = 50257, precision: str = "bf16",
         largest_layer_params: float | None = None, overhead_gb: float = OVERHEAD_GB,
         micro_batches=MICRO_BATCHES, dropout: bool = False, counting: str = "deepspeed") -> list[dict]:
    """Every (stage, offload, checkpointing, micro_batch) with its GPU and CPU bytes, in GB, sorted by
    `_preference`. gpu_gb = model states + activations (+ the recomputed layer) + overhead_gb;
    fits = gpu_gb <= gpu_memory_gb. Activations are per GPU: data parallelism does not split them.
    largest_layer_params defaults to the (tied) embedding, vocab x hidden, as in GPT-2."""
    largest = vocab * hidden if largest_layer_params is None else largest_layer_params
    bytes_per_element = 4 if precision == "fp32" else 2
    rows = []
    for offload, stages in OFFLOADS.items():
        for stage in stages:
            states = model_state_bytes(n_params, n_gpus, stage, offload, precision, largest, counting)
            for ckpt in (False, True):
                for mb in micro_batches:
                    act = activation_bytes(seq_len, mb, hidden, heads, n_layer, vocab, bytes_per_element,
                                           ckpt, dropout)["total"]
                    gpu = (states["gpu"] + act) / GB + overhead_gb
                    rows.append({"stage": stage, "offload": offload, "checkpointing": ckpt, "micro_batch": mb,
                                 "model_states_gb": states["gpu"] / GB, "activations_gb": act / GB,
                                 "overhead_gb": overhead_gb, "gpu_gb": gpu, "cpu_gb": states["cpu"] / GB,
                                 "fits": gpu <= gpu_memory_gb})
    return sorted(rows, key=_preference)


def best_plan(*args, **kwargs) -> dict | None:
    """The first row of `plan` that fits (the fastest by its preference), or None."""
    return next((row for row in plan(*args, **kwargs) if row["fits"]), None)


def gpt2_examples() -> dict:
    """GPT-2 1.5B (48 layers, h = 1600, 25 heads, seq 1024) on one 16 GB T4 (fp16: no bf16 on
    Turing; same bytes) and one 80 GB A100 (bf16): the best plan, and whether plain stage 0 fits."""
    from .model import gpt2_param_count
    dims = dict(seq_len=1024, hidden=1600, n_layer=48, heads=25, vocab=50257)
    n_params = gpt2_param_count(50257, 1024, 48, 1600)
    out = {}
    for gpu, memory_gb, precision in (("T4 16 GB", 16, "fp16"), ("A100 80 GB", 80, "bf16")):
        rows = plan(n_params, memory_gb, precision=precision, **dims)
        plain = next(r for r in rows if (r["stage"], r["offload"], r["checkpointing"], r["micro_batch"])
                     == (0, "none", False, 1))
        out[gpu] = {"n_params": n_params, "plain_stage0_mb1": plain,
                    "best": next((r for r in rows if r["fits"]), None)}
    return out


def estimator_rows(n_params: int, largest_layer_params: int, n_gpus: int = 1) -> list[dict]:
    """This module's GPU and host bytes (bf16, DeepSpeed counting) beside DeepSpeed's own estimators
    for every (stage, offload) they cover. DeepSpeed multiplies host bytes by a safety margin
    (additional_buffer_factor, 1.5 by default); it is set to 1 here to compare the counts themselves."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    rows = []
    for stage, offload in ((2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")):
        if stage == 2:
            cpu, gpu = estimate_zero2_model_states_mem_needs(
                n_params, n_gpus, 1, cpu_offload=offload != "none", additional_buffer_factor=1.0)
        else:
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                n_params, largest_layer_params, n_gpus, 1, cpu_offload=offload != "none",
                cpu_offload_params=offload == "optimizer+params", additional_buffer_factor=1.0)
        ours = model_state_bytes(n_params, n_gpus, stage, offload, "bf16", largest_layer_params)
        rows.append({"stage": stage, "offload": offload, "GPU GB (ours)": ours["gpu"] / GB,
                     "GPU GB (DeepSpeed)": gpu / GB, "host GB (ours)": ours["cpu"] / GB,
                     "host GB (DeepSpeed)": cpu / GB})
    return rows
