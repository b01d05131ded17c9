"""Count a step's host reads of tensor values: the calls that, on a GPU, make the host wait for the device
(`.item()`, `float(t)`, `bool(t)`, `.tolist()`, `torch.cuda.synchronize`). On a CPU they cost nothing, but the
same Python code runs on both, so counting them here shows on a CPU what a GPU step would wait for."""
from __future__ import annotations

import collections
import contextlib
import traceback

import torch

READS = ("item", "__float__", "__int__", "__bool__", "tolist")


@contextlib.contextmanager
def counted_reads():
    """{'file:line': count} of each host read made inside the block, by the first frame outside torch."""
    seen = collections.Counter()

    def caller() -> str:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "/torch/" not in frame.filename:
                return f"{frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno}"
        return "?"

    def wrap(original):
        def counting(*args, **kwargs):
            seen[caller()] += 1
            return original(*args, **kwargs)
        return counting

    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()   # DeepSpeed's own device waits go through it (a no-op on its CPU accelerator)
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    sync = torch.cuda.synchronize
    try:
        for name, original in saved.items():
            setattr(torch.Tensor, name, wrap(original))
        torch.cuda.synchronize = wrap(lambda *a, **k: None)   # no CUDA here: counted, not run
        accelerator.synchronize = wrap(accelerator.synchronize)
        yield seen
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        torch.cuda.synchronize = sync
        del accelerator.synchronize   # back to the class's method
