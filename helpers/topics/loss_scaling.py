"""Dynamic loss scaling for fp16 (notebook 06 explains why): `expected_scales` replays the rule DeepSpeed's
`DynamicLossScaler` applies to the scale, from the overflows alone, so a check can assert DeepSpeed followed it.
"""
from __future__ import annotations

from itertools import pairwise


def expected_scales(overflows: list[bool], init_scale: float, scale_window: int, min_scale: float = 1.0,
                    hysteresis: int = 1, consecutive_hysteresis: bool = False) -> list[float]:
    """The scale each step should have used, given which steps overflowed (the rule in the module doc).

    Written from the rule, not from DeepSpeed's code. Counting detail: DeepSpeed does not count the
    first clean step after an overflow (its `stable_interval` is steps since the overflow minus one),
    so the first doubling comes on the (scale_window + 1)-th clean step, later ones every window.
    """
    scale, budget, clean = float(init_scale), hysteresis, 0   # start behaves like an overflow just before
    used = []
    for overflow in overflows:
        used.append(scale)
        if overflow:
            clean = 0
            if budget > 1:
                budget -= 1            # absorb this overflow, keep the scale
            else:
                scale = max(scale / 2, min_scale)
            continue
        clean += 1
        if consecutive_hysteresis:
            budget = hysteresis        # any clean step refills the budget
        if clean > 1 and (clean - 1) % scale_window == 0:
            scale *= 2
            budget = hysteresis
    return used


def summarize(history: list[dict], final_scale: float) -> dict:
    """The numbers a reader checks, from per-step records {"scale" (used), "overflow", "loss"} and the
    scale the run ended with."""
    scales = [r["scale"] for r in history] + [final_scale]
    ratios = [b / a for a, b in pairwise(scales)]
    return {"steps": len(history), "overflows": sum(r["overflow"] for r in history),
            "halvings": sum(r == 0.5 for r in ratios), "doublings": sum(r == 2.0 for r in ratios),
            "first_scale": scales[0], "final_scale": scales[-1],
            "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"]}
