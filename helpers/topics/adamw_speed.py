"""torch's AdamW implementations timed side by side on the same gradients (notebook 03: why the configs ask
for `"fused": true` with `torch_adam`)."""
import statistics
import time

import torch


def compare_adamw(module: torch.nn.Module, variants: dict[str, dict], repeats: int = 20) -> list[dict]:
    """torch.optim.AdamW built with each variant's options (e.g. {"fused": True}) on copies of `module`'s
    parameters, all given the same random gradients: the median milliseconds per step, and how far each
    variant's parameters end up from the first variant's after the same steps (float rounding only,
    if they compute the same update). The module itself is left untouched."""
    gen = torch.Generator().manual_seed(0)   # its own generator: the global RNG stays as it was
    grads = [torch.randn(p.shape, generator=gen).to(p) for p in module.parameters()]
    rows, reference = [], None
    for name, options in variants.items():
        params = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt = torch.optim.AdamW(params, **{"lr": 1e-3, **options})
        times = []
        for _ in range(repeats + 1):   # the first step allocates Adam's state: not timed
            start = time.perf_counter()
            opt.step()
            if params[0].is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        reference = reference or params
        diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
        rows.append({"optimizer": name, "ms per step": 1e3 * statistics.median(times[1:]),
                     "max |Δparam| vs first": diff})
    return rows
