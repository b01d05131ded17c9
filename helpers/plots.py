"""Matplotlib figures for the notebooks. Each takes plain data, returns the figure and, given a
directory, also saves it there as PNG (so a headless run leaves its plots on disk)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np


def finish(fig, save_dir: str | Path | None, name: str):
    """Lay out, save if asked, and close: the notebook shows the returned figure exactly once
    (as the cell's value) instead of pyplot also drawing every open figure at the cell's end."""
    fig.tight_layout()
    plt.close(fig)
    if save_dir is not None:
        path = Path(save_dir) / "figures" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    return fig


def bars(labels, values, title: str, ylabel: str, save_dir=None, name="bars", highlight=None):
    """A labelled bar chart; `highlight` (a label) is drawn in a second colour."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    colours = ["tab:orange" if label == highlight else "tab:blue" for label in labels]
    ax.bar(labels, values, color=colours)
    for i, v in enumerate(values):
        ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=9)
    ax.set(title=title, ylabel=ylabel)
    return finish(fig, save_dir, name)


def token_frequencies(counts_by_name: dict[str, np.ndarray], top: int = 60, save_dir=None):
    """Sorted token frequencies of several datasets side by side (rank-frequency plot): the `top` most common
    tokens, each as its share of all the tokens counted (not only of those plotted)."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for label, counts in counts_by_name.items():
        counts = np.asarray(counts, dtype=float)
        freq = np.sort(counts)[::-1][:top]
        ax.plot(np.arange(1, len(freq) + 1), freq / counts.sum(), marker=".", label=label)
    ax.set(title=f"Token frequency, {top} most common tokens", xlabel="rank", ylabel="share of all tokens")
    ax.legend()
    return finish(fig, save_dir, "token_frequencies")


def transition_matrix(P: np.ndarray, words: list[str], n: int = 24, save_dir=None):
    """The top-left n x n corner of the Markov transition matrix (all of it when it has fewer words)."""
    n = min(n, len(words))
    fig, ax = plt.subplots(figsize=(5.5, 4.8))
    im = ax.imshow(P[:n, :n], cmap="Blues")
    ax.set_xticks(range(n), words[:n], rotation=90, fontsize=7)
    ax.set_yticks(range(n), words[:n], fontsize=7)
    ax.set(title=f"P(next word | word), first {n} of {len(words)} words", xlabel="next word", ylabel="word")
    fig.colorbar(im, ax=ax, shrink=0.8)
    return finish(fig, save_dir, "transition_matrix")


def floors(rows: dict[str, dict[str, float]], save_dir=None):
    """Per dataset: the ln V ceiling, the best-possible floor, and any measured losses."""
    names = list(rows)
    keys = list(dict.fromkeys(k for r in rows.values() for k in r))
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(keys)
    for j, key in enumerate(keys):
        values = [rows[n].get(key, np.nan) for n in names]
        pos = np.arange(len(names)) + j * width
        ax.bar(pos, values, width, label=key)
        for x, v in zip(pos, values):
            ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(np.arange(len(names)) + width * (len(keys) - 1) / 2, names)
    ax.set(title="Loss floors (nats/token)", ylabel="nats/token")
    ax.legend(fontsize=8, loc="upper right")
    return finish(fig, save_dir, "floors")


def training_curves(scalars: dict, floor: float, ln_vocab: float, save_dir=None):
    """Loss (with the floor and ln V), learning rate, gradient norm, throughput and memory, from TensorBoard."""
    panels = [("train/loss", "loss (nats/token)"), ("train/lr", "learning rate"),
              ("train/grad_norm", "gradient norm (before clipping)"), ("train/tokens_per_s", "tokens/s"),
              ("train/memory_mb", "peak memory (MB)")]
    fig, axes = plt.subplots(1, 5, figsize=(16, 3.2))
    for ax, (tag, label) in zip(axes, panels):
        steps, values = scalars[tag]
        ax.plot(steps, values, lw=1)
        ax.set(title=label, xlabel="step")
    axes[0].axhline(floor, color="green", ls="--", label=f"floor {floor:.3f}")
    axes[0].axhline(ln_vocab, color="red", ls=":", label=f"ln V {ln_vocab:.3f}")
    axes[0].legend(fontsize=8)
    return finish(fig, save_dir, "training_curves")


def table(rows, index: str | None = None):
    """A pandas DataFrame from a dict (one row per key) or a list of dicts, for tidy display."""
    import pandas as pd
    if isinstance(rows, dict):
        return pd.DataFrame({"value": [str(v) for v in rows.values()]}, index=list(rows))
    frame = pd.DataFrame(rows)
    return frame.set_index(index) if index else frame


def stacked_memory(measured: dict[int, dict], predicted: dict[int, dict], save_dir=None,
                   title: str = "Model states held per rank"):
    """Per ZeRO stage: measured bytes per rank (left bar) beside the formula (right bar), stacked by
    component (params, grads, optimizer; buffers on top of the measured bar where present)."""
    parts = ["params", "grads", "optimizer", "buffers"]
    colours = dict(zip(parts, ["tab:blue", "tab:orange", "tab:green", "tab:gray"]))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for i, stage in enumerate(sorted(measured)):
        for offset, source, hatch in ((-0.2, measured[stage], None), (0.2, predicted[stage], "//")):
            bottom = 0.0
            for part in parts:
                value = source.get(part, 0) / 1e6
                ax.bar(i + offset, value, 0.38, bottom=bottom, color=colours[part], hatch=hatch,
                       edgecolor="white", label=part if (i == 0 and offset < 0) else None)
                bottom += value
    ax.set_xticks(range(len(measured)), [f"stage {s}\nmeasured | formula" for s in sorted(measured)])
    ax.set(title=title, ylabel="MB per rank")
    ax.legend()
    return finish(fig, save_dir, "zero_memory")


def loss_overlay(curves: dict[str, list[float]], save_dir=None, name="loss_overlay", title="Loss per step",
                 first_step: int = 1):
    """Loss curves on the same steps, each drawn thinner and dashed differently, so equal ones stay visible."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, (label, losses) in enumerate(curves.items()):
        ax.plot(range(first_step, first_step + len(losses)), losses, lw=3 - 0.5 * i, alpha=0.8, ls=["-", "--", ":", "-."][i % 4],
                label=label)
    ax.set(title=title, xlabel="step", ylabel="loss")
    ax.legend()
    return finish(fig, save_dir, name)


def per_device_vs_ranks(rows: list[dict], save_dir=None, title="Model states per device"):
    """Lines of bytes per device against the number of ranks, one per stage (log-log)."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for stage in sorted({r["stage"] for r in rows}):
        pts = sorted((r["ranks"], r["gb"]) for r in rows if r["stage"] == stage)
        ax.plot(*zip(*pts), marker="o", label=f"stage {stage}")
    ax.set(xscale="log", yscale="log", xlabel="data-parallel ranks N", ylabel="GB per device", title=title)
    ax.legend()
    return finish(fig, save_dir, "per_device_vs_ranks")


def activation_sweep(rows: list[dict], save_dir=None):
    """Left: a step's peak activation memory against sequence length, measured (solid) and the formula
    (dashed), without and with checkpointing. Right: the step time of each."""
    fig, (mem, time) = plt.subplots(1, 2, figsize=(10, 3.6))
    for ckpt, colour in ((False, "tab:red"), (True, "tab:green")):
        mine = sorted((r for r in rows if r["checkpointing"] == ckpt), key=lambda r: r["seq_len"])
        seqs, label = [r["seq_len"] for r in mine], "checkpointing" if ckpt else "no checkpointing"
        mem.plot(seqs, [r["measured_MB"] for r in mine], "o-", color=colour, label=f"{label}: measured")
        mem.plot(seqs, [r["predicted_MB"] for r in mine], "s--", color=colour, alpha=0.6, label=f"{label}: formula")
        time.plot(seqs, [1e3 * r["seconds"] for r in mine], "o-", color=colour, label=label)
    mem.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="MB", title="Activation memory of one step")
    time.set(xscale="log", xlabel="sequence length", ylabel="ms", title="Step time (forward + backward)")
    for ax in (mem, time):
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.legend(fontsize=8)
    return finish(fig, save_dir, "activation_checkpointing")


def device_vs_host(rows: list[dict], save_dir=None, title="Where the model states live"):
    """Per configuration: bytes on the accelerator side and on the host (offload) side, stacked."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = [r["config"].replace(" + ", "\n+ ") for r in rows]
    accel, host = [r["accelerator MB"] for r in rows], [r["host MB"] for r in rows]
    ax.bar(names, accel, color="tab:blue", label="accelerator side")
    ax.bar(names, host, bottom=accel, color="tab:gray", label="host side (offloaded)")
    ax.set(title=title, ylabel="MB held by the rank")
    ax.legend()
    return finish(fig, save_dir, "offload_placement")


def plan_bars(rows: list[dict], memory_gb: float, title: str, save_dir=None, name="what_fits"):
    """GPU GB of a few plans, stacked by part, against the GPU's memory (a horizontal line)."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    labels = [f"ZeRO {r['stage']}\n{r['offload']}\n{'ckpt' if r['checkpointing'] else 'no ckpt'}, mb {r['micro_batch']}"
              for r in rows]
    bottom = np.zeros(len(rows))
    for part, colour in (("model_states_gb", "tab:blue"), ("activations_gb", "tab:orange"), ("overhead_gb", "tab:gray")):
        values = np.array([r[part] for r in rows])
        ax.bar(labels, values, bottom=bottom, color=colour, label=part.replace("_gb", "").replace("_", " "))
        bottom += values
    ax.axhline(memory_gb, color="black", ls="--", label=f"GPU memory {memory_gb:g} GB")
    ax.set(title=title, ylabel="GB per GPU")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8)
    return finish(fig, save_dir, name)


def expert_load(fractions: np.ndarray, save_dir=None, title="Share of tokens routed to each expert"):
    """(steps, experts) shares as stacked areas over training; a balanced router sits at 1/E each."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    steps = np.arange(1, len(fractions) + 1)
    ax.stackplot(steps, fractions.T, labels=[f"expert {e}" for e in range(fractions.shape[1])], alpha=0.85)
    for e in range(1, fractions.shape[1]):
        ax.axhline(e / fractions.shape[1], color="white", lw=0.8, ls="--")
    ax.set(xlim=(1, len(steps)), ylim=(0, 1), xlabel="step", ylabel="share of tokens", title=title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return finish(fig, save_dir, "moe_expert_load")


def moe_curves(curves: dict, save_dir=None):
    """Left: LM loss of the MoE model and its dense twin. Right: the router's auxiliary loss."""
    fig, (lm, aux) = plt.subplots(1, 2, figsize=(10, 3.3))
    lm.plot(curves["step"], curves["lm_loss"], label="MoE (LM loss)")
    lm.plot(curves["step"], curves["dense_loss"], ls="--", label="dense twin")
    lm.set(xlabel="step", ylabel="loss", title="Language-model loss")
    lm.legend()
    aux.plot(curves["step"], curves["aux_loss"], color="tab:purple")
    aux.set(xlabel="step", ylabel="aux loss (sum over layers)", title="Load-balancing loss")
    return finish(fig, save_dir, "moe_losses")


def pipeline_timeline(stage_events: list[list[dict]], save_dir=None, title: str = "", name="pipeline_timeline"):
    """Gantt chart of one measured pipeline step: a row per stage, forward (F) and backward (B) boxes
    labelled by micro-batch; the gaps between them are the bubble."""
    fig, ax = plt.subplots(figsize=(10, 1 + 0.7 * len(stage_events)))
    compute = {"ForwardPass": "tab:blue", "BackwardPass": "tab:orange"}
    t0 = min(e["start"] for events in stage_events for e in events if e["name"] in compute)
    for stage, events in enumerate(stage_events):
        for e in (e for e in events if e["name"] in compute):
            left, width = 1e3 * (e["start"] - t0), 1e3 * (e["end"] - e["start"])
            ax.barh(stage, width, left=left, color=compute[e["name"]], edgecolor="black")
            ax.text(left + width / 2, stage, f"{e['name'][0]}{e['mb']}", ha="center", va="center", fontsize=8)
    ax.set_yticks(range(len(stage_events)), [f"stage {s}" for s in range(len(stage_events))])
    ax.invert_yaxis()
    ax.set(xlabel="ms since the first forward (gaps = idle)", title=title)
    return finish(fig, save_dir, name)


def loss_scale(history: list[dict], save_dir=None, title="Dynamic loss scaling"):
    """Top: the loss scale each step used (log2), overflow steps marked. Bottom: skipped steps so far.
    history: per step {"step", "scale", "overflow"}."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 4.2), sharex=True)
    steps = [h["step"] for h in history]
    top.step(steps, [np.log2(h["scale"]) for h in history], where="post", label="scale")
    bad = [h for h in history if h["overflow"]]
    top.scatter([h["step"] for h in bad], [np.log2(h["scale"]) for h in bad], color="tab:red", zorder=3,
                label="overflow (step skipped)")
    top.set(ylabel="log2(loss scale)", title=title)
    top.legend(fontsize=8)
    bottom.step(steps, np.cumsum([h["overflow"] for h in history]), where="post", color="tab:red")
    bottom.set(xlabel="step", ylabel="skipped steps")
    return finish(fig, save_dir, "loss_scale")


def curriculum(result: dict, save_dir=None):
    """Left: sequence length per step (the curriculum's difficulty) of both runs. Right: held-out loss
    at full length against tokens seen."""
    fig, (length, loss) = plt.subplots(1, 2, figsize=(10, 3.4))
    for name, style in (("curriculum", "-"), ("baseline", "--")):
        run = result[name]
        length.step([h["step"] for h in run["history"]], [h["seq_len"] for h in run["history"]], where="post",
                    ls=style, label=name)
        loss.plot([e["tokens_seen"] for e in run["evals"]], [e["heldout_loss"] for e in run["evals"]], "o" + style,
                  ms=3, label=name)
    length.set(xlabel="step", ylabel="sequence length", title="Difficulty over steps")
    loss.set(xlabel="tokens seen", ylabel="held-out loss (full length)", title="Loss against tokens seen")
    for ax in (length, loss):
        ax.legend()
    return finish(fig, save_dir, "curriculum")


def compile_break_even(cumulative: dict[str, list[float]], compile_s: float, step_s: dict[str, float],
                       break_even: float | None, save_dir=None):
    """Wall seconds spent after n steps, eager vs compiled (the two keys of `cumulative` and `step_s`, the
    eager run first): the measured run (solid) and, dashed, where the measured compile time and steady
    step times lead (first compiled step + n x step time)."""
    eager, compiled = cumulative
    fig, ax = plt.subplots(figsize=(7, 3.4))
    n_max = max(len(c) for c in cumulative.values())
    horizon = int(1.3 * break_even) if break_even and break_even > n_max else n_max
    n = np.arange(1, horizon + 1)
    for (name, seconds), colour in zip(cumulative.items(), ("tab:blue", "tab:orange")):
        ax.plot(np.arange(1, len(seconds) + 1), seconds, color=colour, label=f"{name}, measured")
        start = seconds[0] - step_s[name]   # what the first step cost beyond a steady one
        ax.plot(n, start + n * step_s[name], color=colour, linestyle="--", alpha=0.6, label=f"{name}, projected")
    if break_even:
        ax.axvline(break_even, color="grey", linestyle=":", label=f"break-even: {break_even:,.0f} steps")
    saved_ms = 1e3 * (step_s[eager] - step_s[compiled])
    title = (f"Compiling cost {compile_s:.0f} s once, then saved {saved_ms:.1f} ms a step" if break_even
             else f"Compiling cost {compile_s:.0f} s; the compiled steps were not faster here")
    ax.set(title=title, xlabel="optimizer steps", ylabel="wall seconds so far")
    ax.legend(fontsize=8)
    return finish(fig, save_dir, "compile_break_even")


def ulysses_layout(p: int = 2, tokens: int = 8, heads: int = 4, save_dir=None):
    """DeepSpeed-Ulysses' all-to-all, drawn: a (tokens x heads) grid of one sequence's q (or k, v) coloured by
    the rank that holds each block, before attention (each rank: s/p tokens, all heads) and during it
    (each rank: all s tokens, h/p heads). The all-to-all is the move between the two."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    colours = plt.get_cmap("tab10")
    layouts = {"before attention: rank = token block\n(MLPs, norms, embeddings run here)":
               lambda t, h: t * p // tokens,
               "inside attention: rank = head block\n(each rank sees the whole sequence)":
               lambda t, h: h * p // heads}
    for ax, (title, owner) in zip(axes, layouts.items()):
        grid = np.array([[owner(t, h) for h in range(heads)] for t in range(tokens)])
        ax.imshow(grid, cmap=colours, vmin=0, vmax=9, aspect="auto")
        for t in range(tokens):
            for h in range(heads):
                ax.text(h, t, f"r{grid[t, h]}", ha="center", va="center", fontsize=8, color="white")
        ax.set(title=title, xlabel="attention head", ylabel="token position", xticks=range(heads), yticks=range(tokens))
    axes[0].annotate("", xy=(1.32, 0.5), xytext=(1.04, 0.5), xycoords="axes fraction",
                     arrowprops={"arrowstyle": "<->", "lw": 2})
    axes[0].text(1.18, 0.58, "all-to-all", transform=axes[0].transAxes, ha="center", fontsize=9)
    return finish(fig, save_dir, "ulysses_layout")


def sequence_memory(rows: list[dict], budget_bytes: float, longest: dict[int, int], save_dir=None):
    """Activation bytes one rank saves for backward against sequence length, with 1 and with p ranks splitting
    each sequence (measured points, the fitted line extended), and a memory budget: where each line crosses
    it is the longest sequence that fits."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    lengths = [r["sequence length"] for r in rows]
    split_key = next(k for k in rows[0] if k.startswith("bytes per rank"))
    reach = max(longest.values()) * 1.1
    for p, key, colour in ((1, "bytes, 1 rank", "tab:red"), (max(longest), split_key, "tab:blue")):
        slope = budget_bytes / longest[p]   # bytes per token of one rank, as the longest sequence was found
        ax.plot(lengths, [r[key] / 1e6 for r in rows], "o", color=colour, label=f"{p} rank(s): measured")
        ax.plot([0, reach], [0, slope * reach / 1e6], "--", color=colour, alpha=0.6,
                label=f"{p} rank(s): longest that fits {longest[p]:,} tokens")
    ax.axhline(budget_bytes / 1e6, color="black", lw=1, label=f"budget {budget_bytes / 1e6:.0f} MB")
    ax.set(xlabel="sequence length (tokens)", ylabel="MB saved for backward per rank",
           title="Activation memory per rank: sequence parallelism divides it by p")
    ax.legend(fontsize=8)
    return finish(fig, save_dir, "sequence_memory")


# Notebook 08: ZeRO-3's knobs (memory against traffic) and ZeRO-Infinity's tiers (bytes per tier).
def knob_tradeoff(rows: list[dict], save_dir=None):
    """One point per knob setting (settings on the same point share it): the most parameter elements whole at
    once in a step (memory) against the all-gather MB the step sent (traffic), annotated with the setting's name
    and all-gather count."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    points = {}   # settings that land on the same point share one label, a line each
    for r in rows:
        xy = (round(r["all-gather MB"], 2), r["peak whole in a step"] / 1e6)
        points.setdefault(xy, []).append(f"{r['setting']} ({r['all-gathers']} calls)")
    for (x, y), names in points.items():
        ax.scatter(x, y, s=40)
        ax.annotate("\n".join(names), (x, y), xytext=(6, 0), textcoords="offset points", fontsize=8, va="center")
    ax.set(title="ZeRO-3's knobs: memory against traffic (rank 0, one step)", xlabel="all-gather MB in the step",
           ylabel="peak parameters whole (M)")
    ax.set_xlim(0, 1.35 * max(r["all-gather MB"] for r in rows))
    ax.set_ylim(0, 1.15 * max(r["peak whole in a step"] for r in rows) / 1e6)
    return finish(fig, save_dir, "zero3_knobs")


def memory_tiers(tiers: dict[str, dict[str, float]], save_dir=None):
    """Stacked bars, one per run ("cpu", "nvme"): MB on the device, in host RAM (by what it holds) and on disk."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    runs = list(tiers)
    parts = [p for p in tiers[runs[0]] if p != "device"]
    bottom = [tiers[run]["device"] for run in runs]
    ax.bar(runs, bottom, label="device", color="black")
    for part in parts:
        values = [tiers[run][part] for run in runs]
        ax.bar(runs, values, bottom=bottom, label=part, hatch="//" if part == "disk" else None)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title="Where rank 0's model states wait between steps", ylabel="MB", xlabel="offload device")
    ax.legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    return finish(fig, save_dir, "zero_infinity_tiers")
