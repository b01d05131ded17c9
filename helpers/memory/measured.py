"""What a rank really holds, counted from its tensors, and a process's peak memory read from the OS.

Counting storages (not tensors) is what makes the count honest: DeepSpeed's flat buffers are viewed by
many parameters, and tied weights share one storage; each storage is counted once. Activations and
communication buffers are not model states, so `held_bytes` reports the buffers apart.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from helpers.memory.formulas import bytes_per_param, zero_model_states

# Where DeepSpeed's ZeRO optimizers keep gradients (stages 1-2: DeepSpeedZeroOptimizer; 3: _Stage3)
GRAD_ATTRS = ("averaged_gradients", "all_grad_tensors", "grads_in_partition", "grad_partitions_flat_buffer")


def measurement_zero_extra(n_params: int) -> dict:
    """ZeRO settings that let a tiny model's measurement show the formulas: buckets of the model's size, not
    DeepSpeed's 5e8 elements, and no parameter kept whole below ZeRO-3's persistence threshold (1e5)."""
    bucket = n_params + n_params % 2   # allgather_bucket_size must be even
    return {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 0}


def tensors_in(obj) -> list:
    """Every tensor inside nested dicts/lists/tuples (None and other objects skipped)."""
    import torch
    return [leaf for leaf in torch.utils._pytree.tree_leaves(obj) if isinstance(leaf, torch.Tensor)]


@contextlib.contextmanager
def saved_for_backward():
    """The tensors autograd keeps for the backward pass of what runs inside (torch's saved-tensor hooks
    see them, compiled graphs' included): `storage_bytes` of the list is that forward's activation memory."""
    import torch
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        yield saved


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


def _inner(opt):
    """The torch optimizer inside DeepSpeed's wrapper (the optimizer itself at ZeRO 0 in fp32)."""
    return getattr(opt, "optimizer", opt)


def _fp32_masters(opt) -> list:
    """The fp32 master copies: the inner optimizer's params; ZeRO-3 lends them to it only during step()."""
    return ([p for group in _inner(opt).param_groups for p in group["params"]]
            + list(getattr(opt, "fp32_partitioned_groups_flat", [])))


def held_bytes(engine, seen: set | None = None) -> dict:
    """Bytes of model states (and communication buffers) this rank holds now, by component.

    Where DeepSpeed 0.19 keeps them (attributes of `engine.optimizer`, or of the model's params):
    params: the module's params (stages 0-2: views of `bit16_groups_flat`); stage 3: `param.ds_tensor`;
      with ZeRO-1/2 offload also the host copy of this rank's partition the CPU step writes into.
    grads: `param.grad`/`grad_accum` (stage 0, and stage 1 until the accumulation boundary); stage 2
      partitions `averaged_gradients`, `all_grad_tensors`, `grads_in_partition` (with whole boundary
      params: see `zero2_overhang_bytes`); stage 3 `grad_partitions_flat_buffer`.
    optimizer: fp32 master params (the inner optimizer's params unless they are the model's own; stage 3
      `fp32_partitioned_groups_flat`) + the inner optimizer's state (Adam exp_avg, exp_avg_sq).
    buffers: reduce buckets `ipg_buckets`: ZeRO-1 while gradients wait for the boundary's reduction,
      ZeRO-3 from init on (ZeRO-2 frees its bucket after each backward).
    `seen`: storages counted already (split_by_side's host side), left out here.
    """
    opt = engine.optimizer
    model = list(engine.module.parameters())   # tied weights (wte = lm_head) appear once
    masters = _fp32_masters(opt)
    seen = set() if seen is None else seen   # shared across components: a storage lands in the first that names it

    def count(*objs):
        return storage_bytes(tensors_in(objs), seen)

    return {"params": count(model, [getattr(p, "ds_tensor", None) for p in model],
                            getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None)),   # offload: host copy
            "grads": count([p.grad for p in model + masters], [getattr(p, "grad_accum", None) for p in model],
                           [getattr(opt, name, None) for name in GRAD_ATTRS]),
            "optimizer": count(masters, list(_inner(opt).state.values())),
            "buffers": count([getattr(b, "buffer", None) for b in getattr(opt, "ipg_buckets", {}).values()])}


def zero2_overhang_bytes(engine) -> int:
    """Gradient bytes a ZeRO-2 rank holds beyond its 1/N share (0 at other stages): DeepSpeedZeroOptimizer
    keeps the whole gradient of every parameter overlapping its partition (`params_in_partition`), so one cut
    by a boundary is held whole by both neighbours; negligible unless layers are large beside a partition."""
    if engine.zero_optimization_stage() != 2:
        return 0
    opt = engine.optimizer
    extra = sum(sum(p.numel() for p in params) - size
                for params, size in zip(opt.params_in_partition, opt.partition_size))
    return extra * opt.gradient_accumulation_dtype.itemsize


def host_side_tensors(engine) -> list:
    """The tensors ZeRO-Offload keeps on the offload device (host) for this engine's config."""
    opt, host = engine.optimizer, []
    if engine.zero_cpu_offload():   # the CPU optimizer works on host fp32 partitions
        masters = _fp32_masters(opt)
        host += [masters, [p.grad for p in masters], list(_inner(opt).state.values()),
                 # gradients land on the offload device: ZeRO-3's flat partition buffer, ZeRO-1/2's
                 # accumulation copies (both allocated on `opt.device`, the CPU, when offloading)
                 getattr(opt, "grad_partitions_flat_buffer", None), getattr(opt, "accumulated_grads_in_cpu", None),
                 # ZeRO-1/2: a copy of this rank's partition in the training dtype, where the CPU step's
                 # result waits to be copied back (stage_1_and_2.py: param_buffer_of_bit16_for_cpu_offload)
                 getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None)]
    if engine.zero_offload_param():   # ZeRO-3: each parameter's own partition
        host.append([getattr(p, "ds_tensor", None) for p in engine.module.parameters()])
    return list(tensors_in(host))


def split_by_side(engine) -> dict:
    """Bytes held on the accelerator side vs the host (offload) side, and the devices the host tensors
    are really on. On a CPU-only machine both sides are the same RAM: only the structure differs."""
    host, seen = host_side_tensors(engine), set()
    host_bytes = storage_bytes(host, seen)   # counted first: what held_bytes then finds is the accelerator side's
    return {"accelerator_bytes": sum(held_bytes(engine, seen).values()), "host_bytes": host_bytes,
            "host_devices": sorted({t.device.type for t in host})}


def peak_source(device_type: str) -> str:
    """How a step's peak is read: the CUDA caching allocator's counters on a GPU, the process's peak
    resident set size (RSS) elsewhere (a CPU has no allocator statistics)."""
    return "cuda" if device_type == "cuda" else "rss"


def rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since start or the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_now(device: str) -> int:
    """Bytes in use now, read as `peak_source` says."""
    import torch
    return torch.cuda.memory_allocated() if peak_source(device) == "cuda" else rss_bytes("VmRSS")


def memory_mark(device: str) -> int:
    """Reset the peak counter; return the bytes in use now (the baseline the peak is measured from)."""
    if peak_source(device) == "cuda":
        import torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:   # reset the kernel's peak-RSS mark (Linux >= 4.0), so a warm-up step's peak doesn't count;
        with contextlib.suppress(OSError):   # if refused, the peak also holds what ran before (imports, warm-up)
            Path("/proc/self/clear_refs").write_text("5")
    return memory_now(device)


def peak_memory(device: str) -> int:
    """Peak bytes in use since `memory_mark`."""
    if peak_source(device) != "cuda":
        return rss_bytes("VmHWM")
    import torch
    # No synchronize: the caching allocator's counters live on the host and count a block when it is handed out,
    # as the host queues the kernel, so they are current without waiting for the GPU (a wait per step otherwise).
    return torch.cuda.max_memory_allocated()



def _live_storages():
    """A TorchDispatchMode that follows every tensor storage an op returns until it is freed, on whichever
    thread frees it (gloo's worker threads drop the last reference to a collective's tensors)."""
    import threading
    import weakref
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveStorages(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.known, self.lock = set(), threading.RLock()   # RLock: a finalizer may run inside __torch_dispatch__

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            # an in-place op or a view returns an input's storage, maybe one allocated before the block
            inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if self._real(t)}
            out = func(*args, **kwargs)
            for tensor in tree_leaves(out):
                if self._real(tensor) and id(tensor.untyped_storage()) not in inputs:
                    self._count(tensor.untyped_storage())
            return out

        @staticmethod
        def _real(tensor) -> bool:
            return isinstance(tensor, torch.Tensor) and tensor.device.type != "meta"

        def _count(self, storage):
            with self.lock:
                # one Python object per storage while it lives (PyTorch keeps it): seen once
                if id(storage) in self.known or storage.nbytes() == 0:
                    return
                self.known.add(id(storage))
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, id(storage), storage.nbytes())

        def _freed(self, key, nbytes):
            with self.lock:
                self.known.discard(key)
                self.live -= nbytes

    return LiveStorages()


@contextlib.contextmanager
def allocated_peak(device: str):
    """Tensor bytes allocated inside the block, less those freed: {"peak": the most at any moment, "end": what is
    still held at its end}, filled in when the block ends. On a GPU from torch.cuda's allocator counters (each
    block rounded up to 512 bytes, and the scratch a kernel takes); on a CPU by `tensor_peak`."""
    if peak_source(device) != "cuda":
        with tensor_peak() as result:
            yield result
        return
    import gc
    gc.collect()   # tensors of earlier objects freed inside the block would count against it
    result = {}
    base = memory_mark(device)
    yield result
    result.update(peak=peak_memory(device) - base, end=memory_now(device) - base)


@contextlib.contextmanager
def tensor_peak():
    """`allocated_peak`'s {"peak", "end"} counted from the tensors themselves, on any device: every storage an op
    returns is followed to its free, its exact nbytes counted (RSS would show the C allocator keeping freed pages,
    and untouched `torch.empty` pages not at all; torch's profiler misses frees made on other threads, such as
    gloo's). Scratch memory an op frees before returning is not seen: what a formula of stored tensors counts."""
    import gc
    gc.collect()   # tensors of earlier objects freed inside the block would count against it
    result = {}
    with _live_storages() as storages:
        yield result
        gc.collect()   # a reference cycle made inside the block is not held by anyone
        import torch.distributed
        if torch.distributed.is_initialized():   # a gloo worker frees a collective's tensor just after the wait returns
            torch.distributed.barrier()
    result.update(peak=storages.peak, end=storages.live)


# ---- the ZeRO comparison's table (notebook 04) ----

def memory_rows(results: dict[int, list]) -> list[dict]:
    """Per stage and rank of helpers/programs/zero_stages.py's results ({stage: [rank results]}): measured
    bytes per component beside the formula at this N and precision.
    ZeRO-2's gradients are shown without the boundary overhang (whole gradients of parameters a
    partition boundary cuts through), which is reported in its own column."""
    rows = []
    for stage, ranks in results.items():
        for r in ranks:
            sizes = bytes_per_param(r["precision"], stage)
            formula = zero_model_states(r["n_params"], r["world_size"], stage, *sizes)
            held = dict(r["held_bytes"], grads=r["held_bytes"]["grads"] - r["zero2_overhang_bytes"])
            rows.append({"stage": stage, "rank": r["rank"], **{f"{k} measured": held[k] for k in
                         ("params", "grads", "optimizer")}, **{f"{k} formula": formula[k] for k in
                         ("params", "grads", "optimizer")}, "boundary grads": r["zero2_overhang_bytes"],
                         "buffers": held["buffers"], "device peak MB": r["peak_memory_mb"]})
    return rows


def stacked_parts(rows: list[dict], rank: int = 0) -> tuple[dict, dict]:
    """(measured, formula) per stage for one rank, as {stage: {part: bytes}}, for plots.stacked_memory."""
    mine = {row["stage"]: row for row in rows if row["rank"] == rank}
    measured = {s: {"params": r["params measured"], "grads": r["grads measured"] + r["boundary grads"],
                    "optimizer": r["optimizer measured"], "buffers": r["buffers"]} for s, r in mine.items()}
    formula = {s: {k: r[f"{k} formula"] for k in ("params", "grads", "optimizer")} for s, r in mine.items()}
    return measured, formula
