"""Notebook 08's figures: ZeRO-3's knobs (memory against traffic) and ZeRO-Infinity's tiers (bytes per tier).
Each takes the notebook's own rows, returns the figure (shown once, as the cell's value) and saves it as PNG
under `save_dir`/figures, like helpers.plots."""
from __future__ import annotations

import matplotlib.pyplot as plt

from helpers.plots import finish


def knob_tradeoff(rows: list[dict], save_dir=None):
    """One point per knob setting (settings on the same point share it): the most parameter elements whole at once in a step (memory) against the
    all-gather MiB the step sent (traffic), annotated with the setting's name and all-gather count."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    points = {}   # settings that land on the same point share one label, a line each
    for r in rows:
        xy = (round(r["all-gather MiB"], 2), r["peak whole in a step"] / 1e6)
        points.setdefault(xy, []).append(f"{r['setting']} ({r['all-gathers']} calls)")
    for (x, y), names in points.items():
        ax.scatter(x, y, s=40)
        ax.annotate("\n".join(names), (x, y), xytext=(6, 0), textcoords="offset points", fontsize=8, va="center")
    ax.set(title="ZeRO-3's knobs: memory against traffic (rank 0, one step)", xlabel="all-gather MiB in the step",
           ylabel="peak parameters whole (M)")
    ax.set_xlim(0, 1.35 * max(r["all-gather MiB"] for r in rows))
    ax.set_ylim(0, 1.15 * max(r["peak whole in a step"] for r in rows) / 1e6)
    return finish(fig, save_dir, "zero3_knobs")


def memory_tiers(tiers: dict[str, dict[str, float]], save_dir=None):
    """Stacked bars, one per run ("cpu", "nvme"): MiB on the device, in host RAM (by what it holds) and on disk."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    runs = list(tiers)
    parts = [p for p in tiers[runs[0]] if p != "device"]
    bottom = [tiers[run]["device"] for run in runs]
    ax.bar(runs, bottom, label="device", color="black")
    for part in parts:
        values = [tiers[run][part] for run in runs]
        ax.bar(runs, values, bottom=bottom, label=part, hatch="//" if part == "disk" else None)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title="Where rank 0's model states wait between steps", ylabel="MiB", xlabel="offload device")
    ax.legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    return finish(fig, save_dir, "zero_infinity_tiers")
