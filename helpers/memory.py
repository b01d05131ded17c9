"""Model-state memory per rank: the ZeRO paper's formulas, DeepSpeed's own estimators, and the bytes a
rank really holds, counted from its tensors.

Model states = parameters + gradients + optimizer state (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", Fig. 1). Activations and communication
buffers are not model states; `held_bytes` reports the buffers separately.

How DeepSpeed's estimators differ from the paper (read in deepspeed/runtime/zero/, 0.19.8; no offload):
- ZeRO-2, `estimate_zero2_model_states_mem_needs`: 2 + 18/N bytes per param, 20 at N=1 where the paper
  says 2 + 14/N (16 at N=1). Its 18 = 2 fp16 grads + 4 fp32 grads + 4 fp32 params + 8 Adam m, v.
  The extra 4 is real but brief: `DeepSpeedZeroOptimizer.step` upcasts this rank's gradient partition
  to an fp32 copy (`single_partition_of_fp32_groups[i].grad`) before freeing the 16-bit one.
- ZeRO-3, `estimate_zero3_model_states_mem_needs`: 18/N per param plus 4 bytes per param of the largest
  layer (`largest_layer_memory`, room to gather one layer's 16-bit params and grads); the paper says
  16/N. The source doesn't itemise the 18; the same transient fp32 gradient copy
  (`fp32_partitioned_groups_flat[i].grad`, made in `_prepare_fp32_grad_for_sub_group`) exists here.
- Both return (cpu_bytes, gpu_bytes[, largest_layer_bytes]) and assume fp16/bf16 training; the CPU
  figure is host RAM for loading the model (1.5x buffer factor), not model states.
"""
from __future__ import annotations

GB = 1e9   # the paper's GB (its 7.5B-parameter example: 120, 31.4, 16.6, 1.9 GB on 64 GPUs)
# Where DeepSpeed's ZeRO optimizers keep gradients (stages 1-2: DeepSpeedZeroOptimizer; 3: _Stage3)
GRAD_ATTRS = ("averaged_gradients", "all_grad_tensors", "grads_in_partition", "grad_partitions_flat_buffer")
GPT2_CONFIGS = {"124M": (12, 768), "355M": (24, 1024), "774M": (36, 1280), "1.5B": (48, 1600)}  # n_layer, n_embd


def zero_model_states(n_params: float, n_ranks: int, stage: int, param_bytes: float = 2,
                      grad_bytes: float = 2, optimizer_bytes: float = 12) -> dict:
    """Bytes of model states per rank (paper Fig. 1). Stage 1 partitions the optimizer state across
    the N ranks, stage 2 also the gradients, stage 3 also the parameters."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} is not a ZeRO stage (0-3)")
    if n_ranks < 1:
        raise ValueError(f"n_ranks={n_ranks} must be at least 1")

    def per_rank(bytes_each, partitioned_from_stage):
        return bytes_each * n_params / (n_ranks if stage >= partitioned_from_stage else 1)

    out = {"params": per_rank(param_bytes, 3), "grads": per_rank(grad_bytes, 2),
           "optimizer": per_rank(optimizer_bytes, 1)}
    return {**out, "total": sum(out.values())}


def bytes_per_param(precision: str, stage: int) -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes per parameter that DeepSpeed 0.19 keeps in this tutorial's runs
    (AdamW; measured with `held_bytes` on 1 and 2 ranks, stages 0-3, fp32 and bf16).

    bf16/fp16: (2, 2, 12), the paper's mixed precision, at every stage: 16-bit params and grads; the
      optimizer keeps fp32 master params + Adam m + v. Stage 0: `FP16_UnfusedOptimizer.fp32_groups`
      (`FP16_Optimizer` with FusedAdam on a GPU); stages 1-2: `DeepSpeedZeroOptimizer.
      single_partition_of_fp32_groups`; stage 3: `DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat`.
      Gradients stay 16-bit (grad_accum_dtype defaults to the model's dtype). fp16 is GPU-only, so only
      bf16 was measured here; fp16 goes through the same classes.
    fp32, stage 0: (4, 4, 8): torch AdamW steps the model's own fp32 params, so no master copy: m + v.
    fp32, stages 1-3: (4, 4, 12): the ZeRO optimizers clone their partition into an fp32 "master"
      copy even when the model already is fp32, so ZeRO-1 on one rank holds more than DDP. (ZeRO-3 means
      to reuse the partition when dtype and device match, but compares a torch.device with a device-name
      string, which is never equal, so it clones too.)
    """
    if precision in ("bf16", "fp16"):
        return 2, 2, 12
    if precision == "fp32":
        return (4, 4, 8) if stage == 0 else (4, 4, 12)
    raise ValueError(f"precision={precision!r} is not one of 'fp32', 'bf16', 'fp16'")


def paper_table(n_params: float, n_ranks_list, stages=(0, 1, 2, 3), param_bytes: float = 2,
                grad_bytes: float = 2, optimizer_bytes: float = 12) -> list[dict]:
    """Rows {n_ranks, stage, params, grads, optimizer, total} in GB per rank, for plots and tables."""
    return [{"n_ranks": n, "stage": s, **{k: v / GB for k, v in zero_model_states(
                n_params, n, s, param_bytes, grad_bytes, optimizer_bytes).items()}}
            for n in n_ranks_list for s in stages]


def deepspeed_estimate(n_params: int, n_ranks: int, stage: int, largest_layer_params: int = 0) -> dict:
    """DeepSpeed's own model-state estimate per GPU (and host RAM), no offload, one node of n_ranks
    GPUs. Only stages 2 and 3 have an estimator; see the module docstring for how they differ."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        cpu, gpu = estimate_zero2_model_states_mem_needs(n_params, num_gpus_per_node=n_ranks, num_nodes=1,
                                                         cpu_offload=False)
    elif stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(n_params, largest_layer_params,
                                                            num_gpus_per_node=n_ranks, num_nodes=1, cpu_offload=False,
                                                            cpu_offload_params=False, zero_init=True)
    else:
        raise ValueError(f"DeepSpeed has estimators for ZeRO stages 2 and 3 only, not stage {stage}")
    return {"gpu_bytes": gpu, "cpu_bytes": cpu}


def gpt2_sizes(vocab_size: int = 50257, n_positions: int = 1024) -> list[dict]:
    """The four GPT-2 sizes: parameter count (tied embeddings) and the largest layer (the embedding)."""
    from .model import gpt2_param_count
    return [{"name": name, "n_layer": n_layer, "n_embd": d,
             "params": gpt2_param_count(vocab_size, n_positions, n_layer, d), "largest_layer_params": vocab_size * d}
            for name, (n_layer, d) in GPT2_CONFIGS.items()]


def measurement_zero_extra(n_params: int) -> dict:
    """ZeRO settings that let a tiny model's measurement show the formulas.

    DeepSpeed's communication buckets default to 5e8 elements (2 GB in fp32), allocated whole: they
    would dwarf a 0.4M-param model. Below stage3_param_persistence_threshold (1e5 elements) ZeRO-3
    keeps a parameter whole on every rank; for a tiny model that is every parameter.
    """
    bucket = n_params + n_params % 2   # allgather_bucket_size must be even
    return {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 0}


def _tensors(obj):
    """Every tensor inside nested dicts/lists/tuples (None and other objects skipped)."""
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the storages under `tensors`, each counted once: views and shared (tied) tensors
    share one storage. `seen` carries over between calls so no byte lands in two components."""
    total, seen = 0, set() if seen is None else seen
    for t in tensors:
        if t.device.type == "meta":   # shape-only placeholders own no memory
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def held_bytes(engine) -> dict:
    """Bytes of model states (and communication buffers) this rank holds now, by component.

    Where DeepSpeed 0.19 keeps them (attributes of `engine.optimizer`, or of the model's params):
    params: the module's params (stages 0-2: views of `bit16_groups_flat`); stage 3: `param.ds_tensor`.
    grads: `param.grad`/`grad_accum` (stage 0, and stage 1 until the accumulation boundary); stage 2
      partitions `averaged_gradients`, `all_grad_tensors`, `grads_in_partition` (with whole boundary
      params: see `zero2_overhang_bytes`); stage 3 `grad_partitions_flat_buffer`.
    optimizer: fp32 master params (the inner optimizer's params unless they are the model's own; stage 3
      `fp32_partitioned_groups_flat`) + the inner optimizer's state (Adam exp_avg, exp_avg_sq).
    buffers: reduce buckets `ipg_buckets`: ZeRO-1 while gradients wait for the boundary's reduction,
      ZeRO-3 from init on (ZeRO-2 frees its bucket after each backward).
    """
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)   # the torch optimizer inside DeepSpeed's wrapper, if any
    model = list(engine.module.parameters())   # tied weights (wte = lm_head) appear once
    # fp32 master copies: the inner optimizer's params; ZeRO-3 lends them to it only during step()
    masters = [p for group in inner.param_groups for p in group["params"]]
    masters += list(getattr(opt, "fp32_partitioned_groups_flat", []))
    seen = set()   # shared across components: a storage counted once lands in the first that names it

    def count(*objs):
        return storage_bytes(_tensors(objs), seen)

    return {"params": count(model, [getattr(p, "ds_tensor", None) for p in model]),
            "grads": count([p.grad for p in model + masters], [getattr(p, "grad_accum", None) for p in model],
                           [getattr(opt, name, None) for name in GRAD_ATTRS]),
            "optimizer": count(masters, list(inner.state.values())),
            "buffers": count([getattr(b, "buffer", None) for b in getattr(opt, "ipg_buckets", {}).values()])}


def zero2_overhang_bytes(engine) -> int:
    """Gradient bytes a ZeRO-2 rank holds beyond its 1/N share (0 at other stages).

    DeepSpeedZeroOptimizer keeps the *whole* gradient of every parameter that overlaps its partition
    (`params_in_partition`; `grads_in_partition` and `all_grad_tensors` are sized by their full numel),
    so a parameter cut by a partition boundary is held whole by both neighbouring ranks. That adds up
    to two parameters per rank: negligible when a partition is much larger than the largest layer,
    but not for a tiny model (or a 50k-vocab embedding split over many ranks).
    """
    if engine.zero_optimization_stage() != 2:
        return 0
    opt = engine.optimizer
    extra = sum(sum(p.numel() for p in params) - size
                for params, size in zip(opt.params_in_partition, opt.partition_size))
    return extra * opt.gradient_accumulation_dtype.itemsize


def measure_held(trainer) -> dict:
    """`held_bytes` at the moment the paper's formulas describe: Adam state exists (one step ran) and
    a micro-batch's gradients are accumulating. Needs grad_accum >= 2: DeepSpeed's ZeRO-1 keeps the
    full gradient while accumulating (its peak, as in the paper), but at the end of the window it
    reduces it and keeps only its partition, so after the last backward it looks like ZeRO-2."""
    engine, accum = trainer.engine, trainer.grad_accum
    if accum < 2:
        raise ValueError("measure_held needs a trainer with grad_accum >= 2 (see the docstring)")
    if trainer.step == 0:
        trainer.train_step()
    for micro in range(accum):
        ids = trainer.batches.next().to(engine.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        if micro == 0:
            held = held_bytes(engine)
        engine.step()   # only the last micro-batch's call updates the weights
    return held


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
