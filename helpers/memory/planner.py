"""What fits on a GPU: bytes per GPU for a ZeRO stage, offload, checkpointing and micro-batch (model states
as DeepSpeed counts them + activations + a fixed overhead), and the explorer's checks and config. A planning
aid, not a promise: it leaves out communication buckets and fragmentation beyond OVERHEAD_GB.
"""
from __future__ import annotations

from ..config import ZERO_STAGES, build_config, validate
from ..errors import require_positive_int
from ..hardware import GPUS
from ..precision import ELEMENT_BYTES, check_name, gpu_has_bf16, trainable_precisions
from .formulas import GB, activation_bytes, bytes_per_param, models, zero_model_states

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

    counting="paper": ZeRO paper bytes (formulas.bytes_per_param); "deepspeed": as DeepSpeed 0.19's
    estimators count, with the transient fp32 copy of the gradient partition (4 bytes/param/N at stages
    0-2, 2 at stage 3). Stage 3 also needs room to gather one layer: 4 bytes x the largest layer.
    Offloading the optimizer moves fp32 master, Adam state and fp32 gradients to host RAM; at stages 1-2
    the host also keeps the partition in the training dtype for the CPU step's result (measured in notebook
    05, where a node's host bytes stay flat in its GPU count, unlike the estimator's max(4 x GPUs, 16)
    bytes per parameter). Offloading params leaves only the gathered layer on the GPU.
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
         host_memory_gb: float | None = None, attention: str = "eager") -> list[dict]:
    """Every (stage, offload, checkpointing, micro_batch) with its GPU and CPU bytes, in GB, sorted by
    `_preference`, for a model of formulas.models() (its name or its dict; seq_len defaults to its
    context). gpu_gb = model states + activations (+ the recomputed layer) + overhead_gb;
    fits = gpu_gb <= gpu_memory_gb, and the offloaded states (cpu_gb, all n_gpus ranks' shares) fit in
    host_memory_gb where it is given (a free Colab T4 has 12.7 GB of host RAM: less than many offloads need).
    Activations are per GPU: data parallelism does not split them. attention="eager" (the default) counts the
    a s^2 b attention scores eager attention keeps; "sdpa" or "flash" (HF's default on a GPU, fused kernels)
    keep none, so the same model needs less (formulas.activation_bytes_per_layer).

    Order (`_preference`): within one offload and checkpointing choice, every micro-batch of a stage (largest
    first) comes before the next stage, so the first row that fits has shrunk the micro-batch before it raises
    the ZeRO stage; it raises the stage before it checkpoints, and checkpoints before it offloads."""
    shape = models()[model] if isinstance(model, str) else model
    seq_len, rows = seq_len or shape["context"], []
    for offload, stages in OFFLOADS.items():
        for stage in stages:
            states = model_state_bytes(shape["params"], n_gpus, stage, offload, precision,
                                       shape["largest_layer_params"])
            for ckpt in (False, True):
                for mb in micro_batches:
                    act = activation_bytes(seq_len, mb, shape["hidden"], shape["heads"], shape["n_layer"],
                                           shape["vocab"], ELEMENT_BYTES[precision], ckpt, attention)["total"]
                    gpu = (states["gpu"] + act) / GB + overhead_gb
                    host_fits = host_memory_gb is None or states["cpu"] / GB <= host_memory_gb
                    rows.append({"stage": stage, "offload": offload, "checkpointing": ckpt, "micro_batch": mb,
                                 "model_states_gb": states["gpu"] / GB, "activations_gb": act / GB,
                                 "overhead_gb": overhead_gb, "gpu_gb": gpu, "cpu_gb": states["cpu"] / GB,
                                 "host_fits": host_fits, "fits": gpu <= gpu_memory_gb and host_fits})
    return sorted(rows, key=_preference)


def best_plan(*args, **kwargs) -> dict | None:
    """The first row of `plan` that fits (the fastest by its preference), or None."""
    return next((row for row in plan(*args, **kwargs) if row["fits"]), None)


def row_for(rows: list[dict], stage: int, offload: str = "none", checkpointing: bool = False,
            micro_batch: int = 1) -> dict:
    """The row of `plan` for one choice."""
    return next(r for r in rows if (r["stage"], r["offload"], r["checkpointing"], r["micro_batch"])
                == (stage, offload, checkpointing, micro_batch))


def check(model: str, gpu: str, n_gpus_per_node: int, n_nodes: int, stage: int, offload: str, precision: str,
          micro_batch: int, grad_accum: int, checkpointing: bool, seq_len: int | None) -> int:
    """Raise ValueError naming the field (and the fix) for any choice DeepSpeed or the hardware would
    refuse; return the sequence length to use (the model's context when seq_len is None)."""
    if model not in models():
        raise ValueError(f"model={model!r} is not one of {list(models())}")
    if gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r} is not one of {list(GPUS)}: pick one, or add it to "
                         "helpers.hardware.GPUS with its memory and compute capability")
    for name, value in (("n_gpus_per_node", n_gpus_per_node), ("n_nodes", n_nodes),
                        ("micro_batch", micro_batch), ("grad_accum", grad_accum)):
        require_positive_int(name, value)
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
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
    if check_name(precision) not in trainable_precisions("cuda", GPUS[gpu]["capability"]):   # bf16 below Ampere
        raise ValueError(f"precision='bf16' on the {gpu}: {GPUS[gpu]['arch']} GPUs have no bf16 tensor cores "
                         "(they arrived with Ampere); use precision='fp16' (the same memory) or a newer GPU")
    if not isinstance(checkpointing, bool):
        raise ValueError(f"checkpointing={checkpointing!r} must be True or False")
    context = models()[model]["context"]
    if seq_len is None:
        return context
    require_positive_int("seq_len", seq_len)
    if seq_len > context:
        raise ValueError(f"seq_len={seq_len} is longer than the {model}'s context of {context} tokens: "
                         f"use seq_len <= {context}")
    return seq_len


def estimate(model: str = "GPT-2 1.5B", gpu: str = "T4", n_gpus_per_node: int = 1, n_nodes: int = 1,
             stage: int = 0, offload: str = "none", precision: str = "fp16", micro_batch: int = 1,
             grad_accum: int = 1, checkpointing: bool = False, seq_len: int | None = None) -> dict:
    """The row of `plan` for one training setup (GB per GPU by part), with host GB per node, whether it
    fits and why, the batch it makes (accumulation changes the batch, not the memory), notes for the reader,
    and, when it does not fit, the fastest setup that does on the same GPUs (`best_plan`)."""
    seq_len = check(model, gpu, n_gpus_per_node, n_nodes, stage, offload, precision, micro_batch, grad_accum,
                    checkpointing, seq_len)
    memory_gb, world, host_gb = GPUS[gpu]["memory_gb"], n_gpus_per_node * n_nodes, GPUS[gpu]["host_gb"]
    on = dict(model=model, gpu_memory_gb=memory_gb, n_gpus=world, seq_len=seq_len, precision=precision,
              host_memory_gb=None if host_gb is None else host_gb * n_nodes)
    row = row_for(plan(**on, micro_batches=(micro_batch,)), stage, offload, checkpointing, micro_batch)
    host_per_node = row.pop("cpu_gb") / n_nodes   # plan's host figure is all ranks' shares together
    verdict = "fits" if row["fits"] else "does not fit"
    host = "" if row["host_fits"] else f", and {host_per_node:.1f} GB of host RAM per node where the {gpu}'s has {host_gb:g}"
    global_batch = micro_batch * grad_accum * world
    return {**row, "model": model, "gpu": gpu, "n_params": models()[model]["params"], "seq_len": seq_len,
            "precision": precision, "gpu_memory_gb": memory_gb, "free_gb": memory_gb - row["gpu_gb"],
            "host_gb_per_node": host_per_node, "world_size": world,
            "reason": f"{verdict}: needs {row['gpu_gb']:.1f} GB per GPU, the {gpu} has {memory_gb:g} GB{host}",
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
    if precision == "fp32" and gpu_has_bf16(GPUS[gpu]["capability"]):
        out.append(f"The {gpu} has bf16: it halves parameter and activation bytes and runs on tensor cores.")
    return out


def config_for(model: str = "GPT-2 1.5B", gpu: str = "T4", n_gpus_per_node: int = 1, n_nodes: int = 1,
               stage: int = 0, offload: str = "none", precision: str = "fp16", micro_batch: int = 1,
               grad_accum: int = 1, checkpointing: bool = False, seq_len: int | None = None) -> dict:
    """The DeepSpeed config for these choices, validated for CUDA and n_gpus_per_node x n_nodes ranks.
    Checkpointing leaves no trace in it: DeepSpeed's "activation_checkpointing" block configures only
    models that call deepspeed.checkpointing; an HF model turns it on itself (model.enable_checkpointing)."""
    check(model, gpu, n_gpus_per_node, n_nodes, stage, offload, precision, micro_batch, grad_accum,
          checkpointing, seq_len)
    world = n_gpus_per_node * n_nodes
    config = build_config(micro_batch=micro_batch, grad_accum=grad_accum, world_size=world, zero_stage=stage,
                          precision=precision, offload_optimizer=offload != "none",
                          offload_param=offload == "optimizer+params")
    return validate(config, device="cuda", world_size=world)
