"""Per-step measurements: memory in use and the TensorBoard scalars read back from disk."""
from __future__ import annotations

from pathlib import Path

import torch


def memory_mib(device: str) -> float:
    """Peak memory so far in MiB: the CUDA allocator's peak on a GPU, the process's peak resident
    set (RAM actually used, from the kernel's own accounting) on a CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def read_tensorboard(logdir: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar in the event files under `logdir`: {tag: (steps, values)}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logdir = Path(logdir)
    if not any(logdir.rglob("events.out.tfevents.*")):
        raise FileNotFoundError(f"no TensorBoard event files under {logdir}: was the tensorboard monitor enabled?")
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0 = keep every point
    acc.Reload()
    return {tag: ([e.step for e in acc.Scalars(tag)], [e.value for e in acc.Scalars(tag)])
            for tag in acc.Tags()["scalars"]}
