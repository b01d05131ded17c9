"""The memory explorer as ipywidgets: a control for every choice of planner.estimate, and a chart, a verdict
and the DeepSpeed JSON that follow them. Only API ipywidgets 7.7 (Colab) and 8.x share; the chart is a PNG
in an Image widget and the text HTML, so they update the same in every front end and tests read them from
.value. All the logic is in `render`, testable alone.
"""
from __future__ import annotations

import html
import io
import json

import ipywidgets as widgets

from .. import plots
from ..precision import PRECISIONS
from . import planner
from .formulas import models

DEFAULTS = dict(model="GPT-2 1.5B", gpu="T4", n_gpus_per_node=1, n_nodes=1, stage=0, offload="none",
                precision="fp16", micro_batch=1, grad_accum=8, checkpointing=False, seq_len=1024)
SEQ_LENS = (256, 512, 1024, 2048, 4096)
WIDE = {"description_width": "initial"}   # long labels are not cut off


def figure(est: dict):
    """The estimate as one bar of GB per GPU by part, against the GPU's memory."""
    title = (f"{est['model']} on {est['world_size']} x {est['gpu']}, ZeRO {est['stage']}: "
             f"{'fits' if est['fits'] else 'does not fit'}")
    return plots.plan_bars([est], est["gpu_memory_gb"], title, name="explorer")


def verdict(est: dict) -> str:
    """The estimate in a few lines of plain text: fits or not (and what would), the batch, the notes."""
    lines = [("✓ " if est["fits"] else "✗ ") + est["reason"]
             + (f" ({est['free_gb']:.1f} GB to spare)" if est["fits"] else "")]
    tip = est["suggestion"]
    if not est["fits"]:
        lines.append(f"Fits instead: ZeRO {tip['stage']}, offload {tip['offload']}, "
                     f"{'checkpointing' if tip['checkpointing'] else 'no checkpointing'}, micro-batch "
                     f"{tip['micro_batch']} ({tip['gpu_gb']:.1f} GB)" if tip else
                     f"Nothing fits on {est['world_size']} x {est['gpu']} ({est['gpu_memory_gb']:g} GB each"
                     + (f", {host:g} GB of host RAM" if (host := planner.GPUS[est['gpu']]['host_gb']) else "")
                     + f") at sequence length {est['seq_len']}: add GPUs, shorten the sequence or pick a smaller model.")
    gpus = f"{est['world_size']} GPU{'s' if est['world_size'] > 1 else ''}"
    lines.append(f"Global batch {est['global_batch']} = micro-batch {est['micro_batch']} x accumulation "
                 f"{est['grad_accum']} x {gpus} ({est['tokens_per_step']:,} tokens per step)")
    return "\n".join(lines + [f"• {note}" for note in est["notes"]])


def render(state: dict) -> dict:
    """Everything the explorer shows for one set of choices, without a browser: estimate, config, json,
    verdict (text) and figure; or, for choices DeepSpeed or the GPU would refuse, error (the message
    naming the field) and None/empty elsewhere."""
    try:
        est, config = planner.estimate(**state), planner.config_for(**state)
    except ValueError as error:   # helpers.config.ConfigError is a ValueError too
        return {"error": str(error), "estimate": None, "config": None, "json": "", "verdict": f"✗ {error}",
                "figure": None}
    return {"error": None, "estimate": est, "config": config, "json": json.dumps(config, indent=2),
            "verdict": verdict(est), "figure": figure(est)}


def _slider(description: str, value: int, high: int) -> widgets.IntSlider:
    return widgets.IntSlider(value=value, min=1, max=max(high, value), description=description,
                             continuous_update=False, style=WIDE)


def make_controls(state: dict) -> dict:
    """A widget per argument of planner.estimate, keyed by that argument's name."""
    return {
        "model": widgets.Dropdown(options=list(models()), value=state["model"], description="model"),
        "gpu": widgets.Dropdown(options=list(planner.GPUS), value=state["gpu"], description="GPU"),
        "n_gpus_per_node": _slider("GPUs per node", state["n_gpus_per_node"], 16),
        "n_nodes": _slider("nodes", state["n_nodes"], 64),
        "precision": widgets.ToggleButtons(options=list(PRECISIONS), value=state["precision"],
                                           description="precision", style=WIDE),
        "stage": widgets.ToggleButtons(options=[(str(s), s) for s in (0, 1, 2, 3)], value=state["stage"],
                                       description="ZeRO stage", style=WIDE),
        "offload": widgets.ToggleButtons(options=list(planner.OFFLOADS), value=state["offload"],
                                         description="offload", style=WIDE),
        "micro_batch": _slider("micro-batch", state["micro_batch"], 64),
        "grad_accum": _slider("grad. accumulation", state["grad_accum"], 64),
        "seq_len": widgets.Dropdown(options=sorted({*SEQ_LENS, state["seq_len"]}), value=state["seq_len"],
                                    description="sequence length", style=WIDE),
        "checkpointing": widgets.Checkbox(value=state["checkpointing"], description="activation checkpointing"),
    }


class Explorer(widgets.VBox):
    """The controls above a verdict, the memory chart and the DeepSpeed JSON; any change re-renders."""

    def __init__(self, **initial):
        unknown = set(initial) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"Explorer() got unknown setting(s) {sorted(unknown)}: use {list(DEFAULTS)}")
        state = {**DEFAULTS, **initial}
        planner.check(**state)   # a clear error naming the field, not a Dropdown's "invalid selection"
        super().__init__()
        self.controls = make_controls(state)
        self.verdict = widgets.HTML()
        self.chart = widgets.Image(format="png")
        self.config_view = widgets.HTML()
        names = list(self.controls)
        columns = [widgets.VBox([self.controls[n] for n in names[:5]]),
                   widgets.VBox([self.controls[n] for n in names[5:]])]
        self.children = [widgets.HBox(columns), self.verdict, self.chart, self.config_view]
        for control in self.controls.values():
            control.observe(lambda change: self.refresh(), names="value")
        self.refresh()

    @property
    def settings(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def __repr__(self) -> str:
        """The plain-text form a saved notebook shows where no live kernel draws the widget: the
        settings and the verdict, not the widget tree."""
        settings = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return f"Memory explorer ({settings}):\n{self.shown['verdict']}"

    def refresh(self) -> dict:
        """Recompute from the controls' values and update the views; returns what `render` gave."""
        self.shown = shown = render(self.settings)
        ok = shown["error"] is None
        colour = "#1a7f37" if ok and shown["estimate"]["fits"] else "#b3261e"
        first, *rest = html.escape(shown["verdict"]).split("\n")
        self.verdict.value = (f"<div><b style='color:{colour}'>{first}</b>"
                              + "".join(f"<br>{line}" for line in rest) + "</div>")
        self.chart.layout.display = None if ok else "none"
        if ok:
            png = io.BytesIO()
            shown["figure"].savefig(png, format="png", dpi=90)
            self.chart.value = png.getvalue()
            self.config_view.value = ("<details open><summary>DeepSpeed config (JSON)</summary><pre>"
                                      f"{html.escape(shown['json'])}</pre></details>")
        else:
            self.config_view.value = ""
        return shown

