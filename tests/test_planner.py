""""What fits": model states per GPU agree with DeepSpeed's estimators; more GPUs, higher stages and
offload never need more GPU memory; GPT-2 1.5B on one 16 GB GPU needs tricks. The explorer's numbers
equal the ZeRO/activation formulas worked by hand, the fits flag flips exactly at the GPU's memory, its
DeepSpeed config validates with the right batch product, and bad choices raise errors naming the field."""
import pytest

from helpers.config import validate
from helpers.errors import ConfigError
from helpers.memory import planner
from helpers.memory.formulas import models, zero_model_states

N, L = models()["GPT-2 1.5B"]["params"], models()["GPT-2 1.5B"]["largest_layer_params"]
GB = 1e9
V = 50257   # GPT-2's vocabulary


def deepspeed_gpu_bytes(n_params, n_gpus, stage, largest_layer_params):
    """DeepSpeed's own estimate of a GPU's model-state bytes, no offload (its estimators cover stages 2-3)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    if stage == 2:
        return estimate_zero2_model_states_mem_needs(n_params, n_gpus, 1, cpu_offload=False)[1]
    return estimate_zero3_model_states_mem_needs(n_params, largest_layer_params, n_gpus, 1, cpu_offload=False,
                                                 cpu_offload_params=False, zero_init=True)[1]


@pytest.mark.parametrize("n_ranks", [1, 4, 64])
def test_deepspeed_estimators_count_the_documented_bytes(n_ranks):
    psi, layer = 124_439_808, 50257 * 768
    gpu2, gpu3 = (deepspeed_gpu_bytes(psi, n_ranks, stage, layer) for stage in (2, 3))
    # the documented per-param bytes: ZeRO-2 2 + 18/N (fp32 grads counted), ZeRO-3 18/N + 4 per largest-layer param
    assert gpu2 == pytest.approx(psi * (2 + 18 / n_ranks), abs=1)
    assert gpu3 == pytest.approx(psi * 18 / n_ranks + 4 * layer, abs=1)
    assert gpu2 - zero_model_states(psi, n_ranks, 2)["total"] == pytest.approx(4 * psi / n_ranks, abs=1)


@pytest.mark.parametrize("n_gpus", [1, 2, 8, 64])
@pytest.mark.parametrize("stage", [2, 3])
def test_model_states_equal_deepspeeds_estimate(stage, n_gpus):
    ds = deepspeed_gpu_bytes(N, n_gpus, stage, L)
    assert planner.model_state_bytes(N, n_gpus, stage, largest_layer_params=L) == {"gpu": pytest.approx(ds, abs=1),
                                                                                "cpu": 0.0}
    # The ZeRO paper's count leaves out the transient fp32 gradient copy (DeepSpeed's stage-3 figure adds 2)
    paper = planner.model_state_bytes(N, n_gpus, stage, largest_layer_params=L, counting="paper")["gpu"]
    assert ds - paper == pytest.approx((4 if stage == 2 else 2) * N / n_gpus, abs=1)


@pytest.mark.parametrize("n_gpus", [1, 8])
def test_offload_gpu_bytes_equal_deepspeeds_estimate(n_gpus):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    _, gpu2 = estimate_zero2_model_states_mem_needs(N, n_gpus, 1, cpu_offload=True)
    assert planner.model_state_bytes(N, n_gpus, 2, "optimizer", largest_layer_params=L)["gpu"] == gpu2
    for offload, params_too in (("optimizer", False), ("optimizer+params", True)):
        _, gpu3, _ = estimate_zero3_model_states_mem_needs(N, L, n_gpus, 1, cpu_offload=True,
                                                           cpu_offload_params=params_too)
        assert planner.model_state_bytes(N, n_gpus, 3, offload, largest_layer_params=L)["gpu"] == \
            pytest.approx(gpu3, abs=1)


def test_impossible_offloads_are_refused():
    with pytest.raises(ValueError, match="not possible"):
        planner.model_state_bytes(N, 1, 0, "optimizer")
    with pytest.raises(ValueError, match="not possible"):
        planner.model_state_bytes(N, 1, 2, "optimizer+params")


@pytest.mark.parametrize("counting", ["paper", "deepspeed"])
def test_more_gpus_or_higher_stage_never_need_more(counting):
    def gpu(stage, n_gpus, offload="none"):
        return planner.model_state_bytes(N, n_gpus, stage, offload, largest_layer_params=L, counting=counting)["gpu"]
    for offload, stages in planner.OFFLOADS.items():
        for stage in stages:
            sizes = [gpu(stage, n, offload) for n in (1, 2, 4, 8, 64)]
            assert sizes == sorted(sizes, reverse=True)
    for n_gpus in (2, 8, 64):
        assert gpu(0, n_gpus) >= gpu(1, n_gpus) >= gpu(2, n_gpus) >= gpu(3, n_gpus)
    # On one GPU nothing is partitioned: stages 0-2 hold the same; stage 3 adds its gathered layer,
    # so (paper count) it needs *more* than stage 2 there. DeepSpeed's count hides it (18 vs 20 bytes).
    assert gpu(0, 1) == gpu(1, 1) == gpu(2, 1)
    if counting == "paper":
        assert gpu(3, 1) == gpu(2, 1) + 4 * L


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_moves_bytes_from_gpu_to_cpu(stage):
    none = planner.model_state_bytes(N, 4, stage, "none", largest_layer_params=L)
    opt = planner.model_state_bytes(N, 4, stage, "optimizer", largest_layer_params=L)
    assert opt["gpu"] < none["gpu"] and opt["cpu"] > none["cpu"]
    if stage == 3:
        both = planner.model_state_bytes(N, 4, 3, "optimizer+params", largest_layer_params=L)
        assert both["gpu"] < opt["gpu"] and both["cpu"] > opt["cpu"]


def test_plan_rows_and_preference():
    rows = planner.plan("GPT-2 1.5B", 16)
    assert len(rows) == (4 + 3 + 1) * 2 * len(planner.MICRO_BATCHES)
    assert rows == sorted(rows, key=planner._preference)
    for row in rows:
        assert row["gpu_gb"] == pytest.approx(row["model_states_gb"] + row["activations_gb"] + row["overhead_gb"])
        assert row["fits"] == (row["gpu_gb"] <= 16)
    assert planner.best_plan("GPT-2 1.5B", 16) == next(r for r in rows if r["fits"])
    assert planner.best_plan("GPT-2 1.5B", 0.5) is None   # under the fixed overhead: nothing fits
    shorter = planner.plan("GPT-2 1.5B", 16, seq_len=512)   # activations follow the sequence, states don't
    assert all(a["activations_gb"] > b["activations_gb"] and a["model_states_gb"] == b["model_states_gb"]
               for a, b in zip(rows, shorter))


def test_gpt2_xl_needs_tricks_on_a_16_gb_gpu():
    rows = planner.plan("GPT-2 1.5B", 16, precision="fp16")
    plain = [r for r in rows if r["stage"] == 0 and not r["checkpointing"]]
    assert plain and not any(r["fits"] for r in plain)
    assert planner.row_for(rows, 0) == next(r for r in plain if r["micro_batch"] == 1)
    a100 = planner.plan("GPT-2 1.5B", 80, precision="bf16")
    best = planner.best_plan("GPT-2 1.5B", 16, precision="fp16")
    assert best is not None and (best["offload"] != "none" or best["stage"] > 0 or best["checkpointing"])
    assert planner.row_for(a100, 0)["fits"]   # 31 GB of states + 5 GB of activations


@pytest.mark.parametrize("n_gpus", [1, 8])
def test_offload_host_bytes_are_deepspeeds_plus_the_partition_copy(n_gpus):
    """Host RAM with offload: DeepSpeed's count at ZeRO-3 (safety margin 1) and at ZeRO-2 on up to 4 GPUs;
    ZeRO-2 also keeps the partition's bf16 copy the CPU step writes into (2 bytes/param), which its
    estimator leaves out, and the estimator's max(4 x GPUs, 16) per node grows past 4 GPUs, ours does not."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    cpu2, _ = estimate_zero2_model_states_mem_needs(N, n_gpus, 1, cpu_offload=True, additional_buffer_factor=1)
    ours2 = planner.model_state_bytes(N, n_gpus, 2, "optimizer", "bf16", L)["cpu"]
    assert ours2 == pytest.approx(18 * N, abs=1)
    assert cpu2 == pytest.approx(max(4 * n_gpus, 16) * N, abs=1)
    for offload, params_too in (("optimizer", False), ("optimizer+params", True)):
        cpu3, _, _ = estimate_zero3_model_states_mem_needs(N, L, n_gpus, 1, cpu_offload=True,
                                                           cpu_offload_params=params_too, additional_buffer_factor=1)
        assert planner.model_state_bytes(N, n_gpus, 3, offload, "bf16", L)["cpu"] == pytest.approx(cpu3, abs=1)


def hand_activations(L, s, b, h, a, bytes_per_element, checkpointing):
    """Korthikanti et al. without dropout, by hand: (16sbh + as^2b) elements per layer, only 1 x sbh per
    layer plus one recomputed layer with checkpointing, and the logits + fp32 log-softmax (sbV each)."""
    layer = (16 * s * b * h + a * s * s * b) * bytes_per_element
    layers = L * s * b * h * bytes_per_element + layer if checkpointing else L * layer
    return layers + s * b * V * (4 + bytes_per_element)


def test_gpt2_xl_on_one_t4_by_hand():
    est = planner.estimate("GPT-2 1.5B", "T4", 1, 1, stage=0, offload="none", precision="fp16", micro_batch=1,
                            grad_accum=1, checkpointing=False, seq_len=1024)
    psi = models()["GPT-2 1.5B"]["params"]
    # 2 + 2 + 12 bytes (fp16 params, grads; fp32 master + Adam m, v) + DeepSpeed's transient fp32 grad copy 4
    assert est["model_states_gb"] == pytest.approx(20 * psi / GB)
    assert est["activations_gb"] == pytest.approx(hand_activations(48, 1024, 1, 1600, 25, 2, False) / GB)
    assert est["gpu_gb"] == pytest.approx(est["model_states_gb"] + est["activations_gb"] + 1.0)
    assert not est["fits"] and est["reason"] == "does not fit: needs 37.5 GB per GPU, the T4 has 16 GB"
    assert est["suggestion"] is None   # every offload that fits the GPU needs more host RAM than Colab's 12.7 GB
    offloaded = planner.estimate("GPT-2 1.5B", "T4", stage=1, offload="optimizer", precision="fp16", micro_batch=1)
    host = offloaded["host_gb_per_node"]   # fp32 master, Adam m and v, fp32 grads, and the fp16 copy: 18 bytes each
    assert host == pytest.approx(18 * psi / GB) and offloaded["gpu_gb"] <= 16 and not offloaded["fits"]
    assert offloaded["reason"].endswith(f"and {host:.1f} GB of host RAM per node where the T4's has 12.7")
    assert planner.estimate("GPT-2 1.5B", "A100 80GB", precision="bf16")["fits"]


def test_a_plan_fits_only_where_the_host_holds_what_it_offloads():
    rows = planner.plan("GPT-2 1.5B", 16, precision="fp16", host_memory_gb=12.7)
    unchecked = planner.plan("GPT-2 1.5B", 16, precision="fp16")
    for row, same in zip(rows, unchecked):
        assert row["fits"] == (same["fits"] and row["cpu_gb"] <= 12.7)
    assert planner.best_plan("GPT-2 1.5B", 16, precision="fp16", host_memory_gb=12.7) is None
    assert planner.best_plan("GPT-2 1.5B", 16, precision="fp16", host_memory_gb=64)["offload"] != "none"


def test_two_nodes_zero3_param_offload_by_hand():
    """2 nodes x 8 GPUs, ZeRO-3 with optimizer and parameter offload, checkpointing, bf16, micro-batch 4."""
    est = planner.estimate("GPT-2 355M", "A100 80GB", 8, 2, stage=3, offload="optimizer+params", precision="bf16",
                            micro_batch=4, grad_accum=3, checkpointing=True, seq_len=512)
    shape = models()["GPT-2 355M"]
    psi, largest = shape["params"], V * 1024
    assert est["model_states_gb"] == pytest.approx(4 * largest / GB)   # only the gathered layer stays
    assert est["activations_gb"] == pytest.approx(hand_activations(24, 512, 4, 1024, 16, 2, True) / GB)
    # Host: fp32 master + Adam (12) + fp32 grads (4) + 16-bit params (2), split over the two nodes
    assert est["host_gb_per_node"] == pytest.approx(18 * psi / 2 / GB)
    assert (est["world_size"], est["global_batch"], est["tokens_per_step"]) == (16, 4 * 3 * 16, 4 * 3 * 16 * 512)


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+params"])
def test_multi_node_figures_match_deepspeeds_estimator(offload):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    shape = models()["GPT-3 13B"]
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        shape["params"], shape["largest_layer_params"], num_gpus_per_node=8, num_nodes=4, cpu_offload=True,
        cpu_offload_params=offload == "optimizer+params", additional_buffer_factor=1.0)
    est = planner.estimate("GPT-3 13B", "H100 80GB", 8, 4, stage=3, offload=offload, precision="bf16")
    assert est["model_states_gb"] == pytest.approx(gpu / GB)
    assert est["host_gb_per_node"] == pytest.approx(cpu / GB)   # DeepSpeed's cpu figure is per node


def test_zero2_fp32_four_gpus_by_hand():
    est = planner.estimate("GPT-2 124M", "L4", 4, 1, stage=2, precision="fp32", micro_batch=2, seq_len=256)
    psi = models()["GPT-2 124M"]["params"]
    # fp32 params 4 whole; grads 4 + master/Adam 12 + fp32 grad copy 4, each split over 4 GPUs
    assert est["model_states_gb"] == pytest.approx((4 + 20 / 4) * psi / GB)
    assert est["activations_gb"] == pytest.approx(hand_activations(12, 256, 2, 768, 12, 4, False) / GB)
    assert est["host_gb_per_node"] == 0 and est["suggestion"] is None
    assert any("bf16" in note for note in est["notes"])   # the L4 has bf16: fp32 is flagged


def test_fits_flips_at_the_memory_boundary(monkeypatch):
    need = planner.estimate("GPT-2 774M", "A100 40GB", stage=1, precision="bf16", micro_batch=2)["gpu_gb"]
    a100 = planner.GPUS["A100 40GB"]
    monkeypatch.setitem(planner.GPUS, "exact", {**a100, "memory_gb": need})
    monkeypatch.setitem(planner.GPUS, "a byte short", {**a100, "memory_gb": need - 1e-9})
    at = planner.estimate("GPT-2 774M", "exact", stage=1, precision="bf16", micro_batch=2)
    below = planner.estimate("GPT-2 774M", "a byte short", stage=1, precision="bf16", micro_batch=2)
    assert at["fits"] and at["free_gb"] == 0
    assert not below["fits"] and "the a byte short has" in below["reason"]


def test_micro_batch_flips_fits_where_the_formula_crosses_memory():
    rows = [planner.estimate("GPT-2 1.5B", "A100 80GB", stage=0, precision="bf16", micro_batch=mb)
            for mb in (1, 2, 4, 8, 16)]
    fits = [r["fits"] for r in rows]
    assert fits[0] and not fits[-1] and fits == sorted(fits, reverse=True)   # one flip, from fits to not
    assert all(r["fits"] == (r["gpu_gb"] <= 80) for r in rows)


@pytest.mark.parametrize("gpus, nodes, stage, offload, precision", [
    (1, 1, 0, "none", "fp16"), (8, 1, 2, "optimizer", "bf16"), (8, 2, 3, "optimizer+params", "bf16"),
    (4, 3, 1, "none", "fp32")])
def test_config_validates_with_the_batch_product(gpus, nodes, stage, offload, precision):
    gpu = "T4" if precision == "fp16" else "H100 80GB"
    config = planner.config_for("GPT-2 124M", gpu, gpus, nodes, stage, offload, precision, micro_batch=4, grad_accum=3)
    world = gpus * nodes
    validate(config, device="cuda", world_size=world)
    assert config["train_batch_size"] == 4 * 3 * world == planner.estimate(
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
    config = planner.config_for(gpu="A100 80GB", stage=3, offload="optimizer+params", precision=precision,
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


@pytest.mark.parametrize("function", [planner.estimate, planner.config_for])
@pytest.mark.parametrize("bad, message", BAD, ids=[m.split("=")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_names_the_field(function, bad, message):
    with pytest.raises(ValueError, match=message):
        function(**bad)


def test_plan_shrinks_the_micro_batch_before_raising_the_stage():
    """The calculator's order (what notebook 05 says it does): at one offload and checkpointing choice it tries
    every micro-batch of stage 0 (largest first) before stage 1, every stage before checkpointing, and
    checkpointing before offload."""
    rows = planner.plan("GPT-2 1.5B", 80, precision="bf16")
    keys = [(list(planner.OFFLOADS).index(r["offload"]), r["checkpointing"], r["stage"], -r["micro_batch"]) for r in rows]
    assert keys == sorted(keys)
    first_stage0_mb1 = next(i for i, r in enumerate(rows) if (r["offload"], r["checkpointing"], r["stage"], r["micro_batch"]) == ("none", False, 0, 1))
    first_stage1 = next(i for i, r in enumerate(rows) if (r["offload"], r["checkpointing"], r["stage"]) == ("none", False, 1))
    assert first_stage0_mb1 < first_stage1
    best = planner.best_plan("GPT-2 1.5B", 40, precision="bf16")   # stage 0 at a small micro-batch, not stage 1 at 32
    assert (best["stage"], best["offload"], best["checkpointing"]) == (0, "none", False) and best["micro_batch"] < 32, best


def test_fused_attention_needs_less_activation_memory():
    eager, sdpa = (planner.row_for(planner.plan("GPT-2 1.5B", 80, attention=att), 0, micro_batch=8)
                   for att in ("eager", "sdpa"))
    assert sdpa["activations_gb"] < eager["activations_gb"] and sdpa["model_states_gb"] == eager["model_states_gb"]
