"""What fits on a GPU: the bytes each GPU needs for a ZeRO stage, CPU offload, activation checkpointing
and micro-batch (model states by the ZeRO formula as DeepSpeed counts them + activations + a fixed
overhead), DeepSpeed's own estimators beside it, and the explorer's checks and DeepSpeed config.

A planning aid, not a promise: it leaves out DeepSpeed's communication buckets and allocator
fragmentation beyond OVERHEAD_GB. Everything is plain functions, so the widget stays a thin layer.
"""
from __future__ import annotations

from .. import config as ds_config
from .formulas import ELEMENT_BYTES, GB, activation_bytes, bytes_per_param, gpt2_sizes, models, zero_model_states

# Fixed bytes a GPU loses before the first tensor, in GB: the CUDA context (~0.3-0.5 GB with lazy
# module loading), cuBLAS/NCCL workspaces, and allocator fragmentation. 1 GB is a round, cautious figure.
OVERHEAD_GB = 1.0
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# Where the states live, least to most host traffic. DeepSpeed allows offload_optimizer at stages 1-3
# and offload_param only at stage 3.
OFFLOADS = {"none": (0, 1, 2, 3), "optimizer": (1, 2, 3), "optimizer+params": (3,)}
FP32_GRAD_COPY = 4    # bytes/param: the ZeRO optimizers' transient fp32 copy of their gradient partition
# Capacities as sold. Every figure here is in 10^9 bytes (formulas.GB) while a card's "GB" are GiB (7%
# more), which, with the memory the driver reserves, leaves a cautious margin.
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


def model_state_bytes(n_params: float, n_gpus: int, stage: int, offload: str = "none",
                      precision: str = "bf16", largest_layer_params: float = 0,
                      counting: str = "deepspeed") -> dict:
    """{"gpu", "cpu"} bytes of model states: GPU per rank, CPU for the whole node (all n_gpus ranks).

    counting="paper": ZeRO paper bytes (formulas.bytes_per_param). counting="deepspeed": as
    DeepSpeed 0.19's estimators count, which also hold the transient fp32 copy of the gradient
    partition (4 bytes/param/N at stages 0-2; its stage-3 estimator adds 2, not 4: 18/N vs 16/N).
    Stage 3 also needs room to gather one layer's 16-bit params and grads: 4 bytes x largest layer.
    Offloading the optimizer moves fp32 master + Adam state and the fp32 gradients to host RAM (the
    GPU streams its gradients out through buckets, which DeepSpeed's estimator, like us, leaves out);
    at stages 1-2 the host also keeps the partition in the training dtype, where the CPU step's result
    waits to be copied back (measured in notebook 05; DeepSpeed's estimator leaves it out and instead
    counts max(4 x all GPUs, 16) bytes per parameter per node, which no tensor backs: notebook 05
    measures a node's host bytes flat in the number of GPUs). Offloading params leaves only the
    gathered layer on the GPU.
    """
    if offload not in OFFLOADS or stage not in OFFLOADS[offload]:
        raise ValueError(f"offload={offload!r} is not possible at ZeRO stage {stage}")
    if counting not in ("paper", "deepspeed"):
        raise ValueError(f"counting={counting!r} is not 'paper' or 'deepspeed'")
    p, g, k = bytes_per_param(precision, stage)
    states = zero_model_states(n_params, n_gpus, stage, p, g, k)
    extra = 0.0
    if counting == "deepspeed":
        extra = (2 if stage == 3 else FP32_GRAD_COPY) * n_params / (n_gpus if stage >= 1 else 1)
    working_set = 4 * largest_layer_params if stage == 3 else 0.0
    if offload == "none":
        return {"gpu": states["total"] + extra + working_set, "cpu": 0.0}
    on_host = (k + FP32_GRAD_COPY) * n_params   # all ranks' partitions together
    if stage in (1, 2):   # + the training-dtype copy of the partition the CPU step writes into (measured, notebook 05)
        on_host += p * n_params
    if offload == "optimizer":
        # Stage 1 still holds its full 16-bit gradients until the accumulation boundary.
        gpu = states["params"] + (states["grads"] if stage == 1 else 0.0) + working_set
        return {"gpu": gpu, "cpu": on_host}
    return {"gpu": working_set, "cpu": on_host + p * n_params}


def _preference(row: dict) -> tuple:
    """Fastest first: offload is the slowest trick (every step crosses PCIe), then checkpointing
    (one more forward of every block), then higher ZeRO stages (more communication); the largest micro-batch first
    (better GPU utilisation; reach the global batch with gradient accumulation)."""
    return (list(OFFLOADS).index(row["offload"]), row["checkpointing"], row["stage"], -row["micro_batch"])


def plan(model: str | dict, gpu_memory_gb: float, n_gpus: int = 1, seq_len: int | None = None,
         precision: str = "bf16", micro_batches=MICRO_BATCHES, overhead_gb: float = OVERHEAD_GB,
         dropout: bool = False, counting: str = "deepspeed") -> list[dict]:
    """Every (stage, offload, checkpointing, micro_batch) with its GPU and CPU bytes, in GB, sorted by
    `_preference`, for a model of formulas.models() (its name or its dict; seq_len defaults to its
    context). gpu_gb = model states + activations (+ the recomputed layer) + overhead_gb;
    fits = gpu_gb <= gpu_memory_gb. Activations are per GPU: data parallelism does not split them."""
    shape = models()[model] if isinstance(model, str) else model
    seq_len, rows = seq_len or shape["context"], []
    for offload, stages in OFFLOADS.items():
        for stage in stages:
            states = model_state_bytes(shape["params"], n_gpus, stage, offload, precision,
                                       shape["largest_layer_params"], counting)
            for ckpt in (False, True):
                for mb in micro_batches:
                    act = activation_bytes(seq_len, mb, shape["hidden"], shape["heads"], shape["n_layer"],
                                           shape["vocab"], ELEMENT_BYTES[precision], ckpt, dropout)["total"]
                    gpu = (states["gpu"] + act) / GB + overhead_gb
                    rows.append({"stage": stage, "offload": offload, "checkpointing": ckpt, "micro_batch": mb,
                                 "model_states_gb": states["gpu"] / GB, "activations_gb": act / GB,
                                 "overhead_gb": overhead_gb, "gpu_gb": gpu, "cpu_gb": states["cpu"] / GB,
                                 "fits": gpu <= gpu_memory_gb})
    return sorted(rows, key=_preference)


def best_plan(*args, **kwargs) -> dict | None:
    """The first row of `plan` that fits (the fastest by its preference), or None."""
    return next((row for row in plan(*args, **kwargs) if row["fits"]), None)


def row_for(rows: list[dict], stage: int, offload: str = "none", checkpointing: bool = False,
            micro_batch: int = 1) -> dict:
    """The row of `plan` for one choice."""
    return next(r for r in rows if (r["stage"], r["offload"], r["checkpointing"], r["micro_batch"])
                == (stage, offload, checkpointing, micro_batch))


def gpt2_examples(gpus=("T4", "A100 80GB")) -> dict:
    """GPT-2 1.5B (seq 1024) on one GPU of each kind, in bf16 where it has bf16, else fp16 (same
    bytes): the best plan, and whether plain ZeRO 0 with micro-batch 1 fits."""
    out = {}
    for gpu in gpus:
        rows = plan("GPT-2 1.5B", GPUS[gpu]["memory_gb"], precision="bf16" if GPUS[gpu]["bf16"] else "fp16")
        out[gpu] = {"plain_stage0_mb1": row_for(rows, 0), "best": next((r for r in rows if r["fits"]), None)}
    return out


def deepspeed_estimate(n_params: int, n_ranks: int, stage: int, largest_layer_params: int = 0,
                       offload: str = "none", buffer_factor: float = 1.5) -> dict:
    """DeepSpeed's own model-state estimate per GPU, and host RAM per node, on one node of n_ranks GPUs.

    Only stages 2 and 3 have an estimator (deepspeed/runtime/zero/, 0.19.8). Without offload they count
    more than the paper: ZeRO-2 2 + 18/N bytes per param where the paper says 2 + 14/N (the extra 4 is
    real but brief: `DeepSpeedZeroOptimizer.step` upcasts this rank's gradient partition to an fp32 copy
    before freeing the 16-bit one); ZeRO-3 18/N plus 4 bytes per param of the largest layer (room to
    gather one layer's 16-bit params and grads) where the paper says 16/N. Both assume fp16/bf16. Without
    offload the host figure is RAM for loading the model, not model states; DeepSpeed multiplies host
    bytes by a safety margin, `buffer_factor` (its additional_buffer_factor).
    """
    if stage == 2 and offload in ("none", "optimizer"):
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        cpu, gpu = estimate_zero2_model_states_mem_needs(n_params, n_ranks, 1, cpu_offload=offload != "none",
                                                         additional_buffer_factor=buffer_factor)
    elif stage == 3 and offload in OFFLOADS:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            n_params, largest_layer_params, n_ranks, 1, cpu_offload=offload != "none",
            cpu_offload_params=offload == "optimizer+params", additional_buffer_factor=buffer_factor)
    else:
        raise ValueError(f"DeepSpeed has estimators for ZeRO stages 2 and 3 only, not stage {stage} "
                         f"with offload={offload!r}")
    return {"gpu_bytes": gpu, "cpu_bytes": cpu}


def estimator_rows(n_params: int, largest_layer_params: int, n_gpus: int = 1) -> list[dict]:
    """`model_state_bytes` (bf16, DeepSpeed counting) beside DeepSpeed's estimators for every (stage,
    offload) they cover; DeepSpeed's host safety margin set to 1 to compare the counts themselves."""
    rows = []
    for stage, offload in ((2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")):
        theirs = deepspeed_estimate(n_params, n_gpus, stage, largest_layer_params, offload, buffer_factor=1.0)
        ours = model_state_bytes(n_params, n_gpus, stage, offload, "bf16", largest_layer_params)
        rows.append({"stage": stage, "offload": offload, "GPU GB (ours)": ours["gpu"] / GB,
                     "GPU GB (DeepSpeed)": theirs["gpu_bytes"] / GB, "host GB (ours)": ours["cpu"] / GB,
                     "host GB (DeepSpeed)": theirs["cpu_bytes"] / GB})
    return rows


def gpt2_table(n_ranks_list=(1, 8, 64)) -> list[dict]:
    """GB per device for GPT-2 sizes (bf16 + Adam, paper formula) beside DeepSpeed's estimators."""
    rows = []
    for size in gpt2_sizes():
        for n in n_ranks_list:
            row = {"model": size["name"], "params (M)": round(size["params"] / 1e6), "GPUs": n}
            for stage in (0, 1, 2, 3):
                row[f"stage {stage} GB"] = round(zero_model_states(size["params"], n, stage)["total"] / GB, 2)
            for stage in (2, 3):
                est = deepspeed_estimate(size["params"], n, stage, size["largest_layer_params"])
                row[f"DeepSpeed est. stage {stage} GB"] = round(est["gpu_bytes"] / GB, 2)
            rows.append(row)
    return rows


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
                         "helpers.memory.planner.GPUS with its memory and bf16 support")
    for name, value in (("n_gpus_per_node", n_gpus_per_node), ("n_nodes", n_nodes),
                        ("micro_batch", micro_batch), ("grad_accum", grad_accum)):
        _whole_number(name, value)
    if isinstance(stage, bool) or stage not in ds_config.ZERO_STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage: use 0, 1, 2 or 3")
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r} is not one of {tuple(OFFLOADS)} "
                         "(NVMe offload, ZeRO-Infinity, is not modelled here)")
    if stage not in OFFLOADS[offload]:
        if offload == "optimizer":
            raise ValueError(f"offload='optimizer' needs ZeRO stage 1, 2 or 3 (stage is {stage}): DeepSpeed's "
                             "offload_optimizer moves the optimizer partition, and stage 0 partitions nothing")
        raise ValueError(f"offload='optimizer+params' needs ZeRO stage 3 (stage is {stage}): only stage 3 "
                         "partitions the parameters that offload_param moves; use stage=3 or offload='optimizer'")
    if precision not in ds_config.PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {ds_config.PRECISIONS}")
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


def estimate(model: str = "GPT-2 1.5B", gpu: str = "T4", n_gpus_per_node: int = 1, n_nodes: int = 1,
             stage: int = 0, offload: str = "none", precision: str = "fp16", micro_batch: int = 1,
             grad_accum: int = 1, checkpointing: bool = False, seq_len: int | None = None) -> dict:
    """GB per GPU by part, host GB per node, and whether it fits, for one training setup.

    The row of `plan` for these choices (model_states_gb, activations_gb, overhead_gb, gpu_gb, plus
    stage/offload/checkpointing/micro_batch, so helpers.plots.plan_bars can draw it), and:
    gpu_memory_gb, free_gb; host_gb_per_node (offloaded states: each node's ranks hold their share);
    fits and reason ("needs 37.5 GB per GPU, the T4 has 16 GB"); world_size, global_batch (micro x
    accum x world) and tokens_per_step; notes for the reader; suggestion: when it does not fit, the
    fastest setup that does on the same GPUs (`best_plan`), or None.
    Gradient accumulation changes the batch, not the memory: gradients accumulate in place.
    """
    seq_len = check(model, gpu, n_gpus_per_node, n_nodes, stage, offload, precision, micro_batch, grad_accum,
                    checkpointing, seq_len)
    memory_gb, world = GPUS[gpu]["memory_gb"], n_gpus_per_node * n_nodes
    on = dict(model=model, gpu_memory_gb=memory_gb, n_gpus=world, seq_len=seq_len, precision=precision)
    row = row_for(plan(**on, micro_batches=(micro_batch,)), stage, offload, checkpointing, micro_batch)
    host_per_node = row.pop("cpu_gb") / n_nodes   # plan's host figure is all ranks' shares together
    verdict = "fits" if row["fits"] else "does not fit"
    global_batch = micro_batch * grad_accum * world
    return {**row, "model": model, "gpu": gpu, "n_params": models()[model]["params"], "seq_len": seq_len,
            "precision": precision, "gpu_memory_gb": memory_gb, "free_gb": memory_gb - row["gpu_gb"],
            "host_gb_per_node": host_per_node, "world_size": world,
            "reason": f"{verdict}: needs {row['gpu_gb']:.1f} GB per GPU, the {gpu} has {memory_gb:g} GB",
            "grad_accum": grad_accum, "global_batch": global_batch, "tokens_per_step": global_batch * seq_len,
            "notes": notes(gpu, world, stage, offload, precision, checkpointing, host_per_node),
            "suggestion": None if row["fits"] else best_plan(**on)}


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
        out.append("Checkpointing recomputes each layer's forward pass during backward: one more forward per step.")
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
