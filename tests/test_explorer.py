"""The memory explorer: its numbers equal the ZeRO/activation formulas worked by hand, the fits flag
flips exactly at the GPU's memory, its DeepSpeed config validates with the right batch product, bad
choices raise errors naming the field, and the widget re-renders when a control changes."""
import json

import pytest

from helpers import explorer, widgets
from helpers.config import ConfigError, validate

GB = 1e9
V = 50257   # GPT-2's vocabulary


def hand_activations(L, s, b, h, a, bytes_per_element, checkpointing):
    """Korthikanti et al. without dropout, by hand: (16sbh + as^2b) elements per layer, only 1 x sbh per
    layer plus one recomputed layer with checkpointing, and the logits + fp32 log-softmax (sbV each)."""
    layer = (16 * s * b * h + a * s * s * b) * bytes_per_element
    layers = L * s * b * h * bytes_per_element + layer if checkpointing else L * layer
    return layers + s * b * V * (4 + bytes_per_element)


def test_gpt2_xl_on_one_t4_by_hand():
    est = explorer.estimate("GPT-2 1.5B", "T4", 1, 1, stage=0, offload="none", precision="fp16", micro_batch=1,
                            grad_accum=1, checkpointing=False, seq_len=1024)
    psi = explorer.models()["GPT-2 1.5B"]["params"]
    # 2 + 2 + 12 bytes (fp16 params, grads; fp32 master + Adam m, v) + DeepSpeed's transient fp32 grad copy 4
    assert est["model_states_gb"] == pytest.approx(20 * psi / GB)
    assert est["activations_gb"] == pytest.approx(hand_activations(48, 1024, 1, 1600, 25, 2, False) / GB)
    assert est["gpu_gb"] == pytest.approx(est["model_states_gb"] + est["activations_gb"] + 1.0)
    assert not est["fits"] and est["reason"] == "does not fit: needs 37.5 GB per GPU, the T4 has 16 GB"
    assert est["suggestion"]["fits"] and est["suggestion"]["gpu_gb"] <= 16
    assert explorer.estimate("GPT-2 1.5B", "A100 80GB", precision="bf16")["fits"]


def test_two_nodes_zero3_param_offload_by_hand():
    """2 nodes x 8 GPUs, ZeRO-3 with optimizer and parameter offload, checkpointing, bf16, micro-batch 4."""
    est = explorer.estimate("GPT-2 355M", "A100 80GB", 8, 2, stage=3, offload="optimizer+params", precision="bf16",
                            micro_batch=4, grad_accum=3, checkpointing=True, seq_len=512)
    shape = explorer.models()["GPT-2 355M"]
    psi, largest = shape["params"], V * 1024
    assert est["model_states_gb"] == pytest.approx(4 * largest / GB)   # only the gathered layer stays
    assert est["activations_gb"] == pytest.approx(hand_activations(24, 512, 4, 1024, 16, 2, True) / GB)
    # Host: fp32 master + Adam (12) + fp32 grads (4) + 16-bit params (2), split over the two nodes
    assert est["host_gb_per_node"] == pytest.approx(18 * psi / 2 / GB)
    assert (est["world_size"], est["global_batch"], est["tokens_per_step"]) == (16, 4 * 3 * 16, 4 * 3 * 16 * 512)


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+params"])
def test_multi_node_figures_match_deepspeeds_estimator(offload):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    shape = explorer.models()["GPT-3 13B"]
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        shape["params"], shape["largest_layer_params"], num_gpus_per_node=8, num_nodes=4, cpu_offload=True,
        cpu_offload_params=offload == "optimizer+params", additional_buffer_factor=1.0)
    est = explorer.estimate("GPT-3 13B", "H100 80GB", 8, 4, stage=3, offload=offload, precision="bf16")
    assert est["model_states_gb"] == pytest.approx(gpu / GB)
    assert est["host_gb_per_node"] == pytest.approx(cpu / GB)   # DeepSpeed's cpu figure is per node


def test_zero2_fp32_four_gpus_by_hand():
    est = explorer.estimate("GPT-2 124M", "L4", 4, 1, stage=2, precision="fp32", micro_batch=2, seq_len=256)
    psi = explorer.models()["GPT-2 124M"]["params"]
    # fp32 params 4 whole; grads 4 + master/Adam 12 + fp32 grad copy 4, each split over 4 GPUs
    assert est["model_states_gb"] == pytest.approx((4 + 20 / 4) * psi / GB)
    assert est["activations_gb"] == pytest.approx(hand_activations(12, 256, 2, 768, 12, 4, False) / GB)
    assert est["host_gb_per_node"] == 0 and est["suggestion"] is None
    assert any("bf16" in note for note in est["notes"])   # the L4 has bf16: fp32 is flagged


def test_fits_flips_at_the_memory_boundary(monkeypatch):
    need = explorer.estimate("GPT-2 774M", "A100 40GB", stage=1, precision="bf16", micro_batch=2)["gpu_gb"]
    monkeypatch.setitem(explorer.GPUS, "exact", {"memory_gb": need, "bf16": True, "arch": "Ampere"})
    monkeypatch.setitem(explorer.GPUS, "a byte short", {"memory_gb": need - 1e-9, "bf16": True, "arch": "Ampere"})
    at = explorer.estimate("GPT-2 774M", "exact", stage=1, precision="bf16", micro_batch=2)
    below = explorer.estimate("GPT-2 774M", "a byte short", stage=1, precision="bf16", micro_batch=2)
    assert at["fits"] and at["free_gb"] == 0
    assert not below["fits"] and "the a byte short has" in below["reason"]


def test_micro_batch_flips_fits_where_the_formula_crosses_memory():
    rows = [explorer.estimate("GPT-2 1.5B", "A100 80GB", stage=0, precision="bf16", micro_batch=mb)
            for mb in (1, 2, 4, 8, 16)]
    fits = [r["fits"] for r in rows]
    assert fits[0] and not fits[-1] and fits == sorted(fits, reverse=True)   # one flip, from fits to not
    assert all(r["fits"] == (r["gpu_gb"] <= 80) for r in rows)


@pytest.mark.parametrize("gpus, nodes, stage, offload, precision", [
    (1, 1, 0, "none", "fp16"), (8, 1, 2, "optimizer", "bf16"), (8, 2, 3, "optimizer+params", "bf16"),
    (4, 3, 1, "none", "fp32")])
def test_config_validates_with_the_batch_product(gpus, nodes, stage, offload, precision):
    gpu = "T4" if precision == "fp16" else "H100 80GB"
    config = explorer.config_for("GPT-2 124M", gpu, gpus, nodes, stage, offload, precision, micro_batch=4, grad_accum=3)
    world = gpus * nodes
    validate(config, device="cuda", world_size=world)
    assert config["train_batch_size"] == 4 * 3 * world == explorer.estimate(
        "GPT-2 124M", gpu, gpus, nodes, stage, offload, precision, micro_batch=4, grad_accum=3)["global_batch"]
    zero = config["zero_optimization"]
    assert zero["stage"] == stage
    assert ("offload_optimizer" in zero) == (offload != "none")
    assert ("offload_param" in zero) == (offload == "optimizer+params")
    assert config.get(precision, {}).get("enabled", precision == "fp32")
    if world > 1:   # the product is tied to the world size: the same config on fewer GPUs is refused
        with pytest.raises(ConfigError, match="train_batch_size"):
            validate(config, device="cuda", world_size=world - 1)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_deepspeed_parses_the_config(precision):
    """DeepSpeed's own parser reads it back (on one process it takes world size 1)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    config = explorer.config_for(gpu="A100 80GB", stage=3, offload="optimizer+params", precision=precision,
                                 micro_batch=4, grad_accum=3)
    parsed = DeepSpeedConfig(config)
    batch = (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps)
    assert batch == (12, 4, 3)
    assert parsed.zero_optimization_stage == 3 and parsed.zero_config.offload_param.device == "cpu"
    assert parsed.float16_config.enabled == (precision == "fp16")
    assert parsed.bfloat16_config.enabled == (precision == "bf16")


BAD = [
    (dict(model="GPT-2 7B"), "model='GPT-2 7B'"),
    (dict(gpu="RTX 9090"), "gpu='RTX 9090'"),
    (dict(n_gpus_per_node=0), "n_gpus_per_node=0"),
    (dict(n_nodes=0), "n_nodes=0"),
    (dict(micro_batch=0), "micro_batch=0"),
    (dict(micro_batch=2.5), "micro_batch=2.5"),
    (dict(grad_accum=0), "grad_accum=0"),
    (dict(stage=4), "stage=4"),
    (dict(offload="nvme", stage=3), "offload='nvme'"),
    (dict(offload="optimizer", stage=0), r"offload='optimizer' needs ZeRO stage 1, 2 or 3 \(stage is 0\)"),
    (dict(offload="optimizer+params", stage=2), r"offload='optimizer\+params' needs ZeRO stage 3 \(stage is 2\)"),
    (dict(precision="int8"), "precision='int8'"),
    (dict(precision="bf16", gpu="T4"), "precision='bf16' on the T4.*use precision='fp16'"),
    (dict(precision="bf16", gpu="V100 32GB"), "precision='bf16' on the V100 32GB"),
    (dict(seq_len=2048), "seq_len=2048 is longer than the GPT-2 1.5B's context of 1024"),
    (dict(checkpointing="yes"), "checkpointing='yes'"),
]


@pytest.mark.parametrize("function", [explorer.estimate, explorer.config_for])
@pytest.mark.parametrize("bad, message", BAD, ids=[m.split("=")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_names_the_field(function, bad, message):
    with pytest.raises(ValueError, match=message):
        function(**{**widgets.DEFAULTS, **bad})


def test_render_without_a_browser():
    shown = widgets.render(widgets.DEFAULTS)
    assert shown["error"] is None and shown["figure"] is not None
    assert json.loads(shown["json"]) == explorer.config_for(**widgets.DEFAULTS)
    assert shown["verdict"].startswith("✗ does not fit: needs 37.5 GB") and "Fits instead: ZeRO" in shown["verdict"]
    broken = widgets.render({**widgets.DEFAULTS, "stage": 0, "offload": "optimizer"})
    assert broken["figure"] is None and broken["config"] is None and "offload='optimizer'" in broken["error"]


def test_widget_rerenders_when_a_control_changes():
    box = widgets.explorer(model="GPT-2 774M", gpu="A100 40GB", precision="bf16")
    before_verdict, before_chart = box.verdict.value, bytes(box.chart.value)   # 8.x keeps a memoryview
    assert before_chart.startswith(b"\x89PNG") and "train_batch_size&quot;: 8" in box.config_view.value

    box.controls["micro_batch"].value = 4   # what a slider drag does
    after = explorer.estimate(**box.settings)
    assert box.verdict.value != before_verdict and f"needs {after['gpu_gb']:.1f} GB" in box.verdict.value
    assert bytes(box.chart.value) != before_chart and "train_batch_size&quot;: 32" in box.config_view.value

    box.controls["offload"].value = "optimizer+params"   # at stage 0: refused, the chart is hidden
    assert "offload=&#x27;optimizer+params&#x27; needs ZeRO stage 3" in box.verdict.value
    assert box.chart.layout.display == "none" and box.config_view.value == ""
    box.controls["stage"].value = 3
    assert box.chart.layout.display is None and "&quot;offload_param&quot;" in box.config_view.value


def test_explorer_refuses_unknown_settings_and_bad_values():
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['zero_stage'\]"):
        widgets.explorer(zero_stage=2)
    with pytest.raises(ValueError, match="gpu='RTX 9090' is not one of"):
        widgets.explorer(gpu="RTX 9090")
