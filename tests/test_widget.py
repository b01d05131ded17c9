"""The memory explorer widget: it renders without a browser, re-renders when a control changes, and
refuses unknown settings."""
import json

import pytest

from helpers.memory import planner, widget
from helpers.memory.widget import Explorer


def test_render_without_a_browser():
    shown = widget.render(widget.DEFAULTS)
    assert shown["error"] is None and shown["figure"] is not None
    assert json.loads(shown["json"]) == planner.config_for(**widget.DEFAULTS)
    assert shown["verdict"].startswith("✗ does not fit: needs 37.5 GB")
    assert "Nothing fits on 1 x T4 (16 GB each, 12.7 GB of host RAM)" in shown["verdict"]   # offloads outgrow the host
    wider = widget.render({**widget.DEFAULTS, "gpu": "A100 40GB", "micro_batch": 4})   # 40 GB and 83.5 GB of host RAM
    assert "Fits instead: ZeRO" in wider["verdict"]
    broken = widget.render({**widget.DEFAULTS, "stage": 0, "offload": "optimizer"})
    assert broken["figure"] is None and broken["config"] is None and "offload='optimizer'" in broken["error"]


def test_widget_rerenders_when_a_control_changes():
    box = Explorer(model="GPT-2 774M", gpu="A100 40GB", precision="bf16")
    before_verdict, before_chart = box.verdict.value, bytes(box.chart.value)   # 8.x keeps a memoryview
    assert before_chart.startswith(b"\x89PNG") and "train_batch_size&quot;: 8" in box.config_view.value

    box.controls["micro_batch"].value = 4   # what a slider drag does
    after = planner.estimate(**box.settings)
    assert box.verdict.value != before_verdict and f"needs {after['gpu_gb']:.1f} GB" in box.verdict.value
    assert bytes(box.chart.value) != before_chart and "train_batch_size&quot;: 32" in box.config_view.value

    box.controls["offload"].value = "optimizer+params"   # at stage 0: refused, the chart is hidden
    assert "offload=&#x27;optimizer+params&#x27; needs ZeRO stage 3" in box.verdict.value
    assert box.chart.layout.display == "none" and box.config_view.value == ""
    box.controls["stage"].value = 3
    assert box.chart.layout.display is None and "&quot;offload_param&quot;" in box.config_view.value


def test_explorer_refuses_unknown_settings_and_bad_values():
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['zero_stage'\]"):
        Explorer(zero_stage=2)
    with pytest.raises(ValueError, match="gpu='RTX 9090' is not one of"):
        Explorer(gpu="RTX 9090")
