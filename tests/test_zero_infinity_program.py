"""helpers/programs/zero_infinity.py without launching ranks: its option checks, the config it builds, and
where it finds the swap files (notebook 08's run covers the real launch, and holds the files against the
ZeRO-Infinity paper's accounting)."""
import pytest

from helpers.launch import checked_flags
from helpers.model import build_model
from helpers.programs import zero_infinity


@pytest.mark.parametrize("n_ranks, options, message", [
    (2, {"vocab": 1024}, "no parameter would reach the disk; use vocab >= 4096"),
    (2, {"model_size": "tiny", "vocab": 4096}, "use vocab >= 8192"),
    (2, {"steps": 1}, "the first step is not timed"),
])
def test_a_run_that_would_swap_no_parameter_or_time_no_step_is_refused_before_any_rank_starts(n_ranks, options,
                                                                                              message, tmp_path):
    with pytest.raises(ValueError, match=message):
        checked_flags("zero_infinity", n_ranks, "torchrun", tmp_path, options)


@pytest.mark.skipif(not zero_infinity.nvme_available(), reason="no libaio here: the program refuses to start")
def test_the_defaults_pass_on_two_ranks(tmp_path):
    checked_flags("zero_infinity", 2, "torchrun", tmp_path, {})


@pytest.fixture(scope="module")
def small_model():
    return build_model(4096, 32, "small")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_nvme_config_validates_and_fetches_on_demand_with_buffers_for_the_largest_partition(small_model, tmp_path,
                                                                                                 precision):
    a = zero_infinity.parse(["--out", str(tmp_path)])
    config = zero_infinity.infinity_config(a, "nvme", precision, small_model, tmp_path / "nvme")   # validate()s it
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_prefetch_bucket_size"] == 0
    for block in ("offload_optimizer", "offload_param"):
        assert zero[block]["device"] == "nvme" and zero[block]["nvme_path"] == str(tmp_path / "nvme")
    largest_partition = max(p.numel() for p in small_model.parameters()) // 2
    assert zero["offload_param"]["buffer_size"] >= largest_partition
    assert config["aio"]["block_size"] == zero_infinity.SWAP_MIN_BYTES
    assert "torch_adam" not in config["optimizer"]["params"]   # offload: DeepSpeedCPUAdam


def test_the_cpu_config_differs_only_in_where_the_states_go(small_model, tmp_path):
    a = zero_infinity.parse(["--out", str(tmp_path)])
    cpu = zero_infinity.infinity_config(a, "cpu", "bf16", small_model, tmp_path / "nvme")
    nvme = zero_infinity.infinity_config(a, "nvme", "bf16", small_model, tmp_path / "nvme")
    assert cpu["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": False}
    drop = ("offload_optimizer", "offload_param")
    assert {k: v for k, v in cpu["zero_optimization"].items() if k not in drop} == \
        {k: v for k, v in nvme["zero_optimization"].items() if k not in drop}
    assert "aio" not in cpu and {k: v for k, v in nvme.items() if k not in ("aio", "zero_optimization")} == \
        {k: v for k, v in cpu.items() if k != "zero_optimization"}


def test_swap_files_are_sorted_by_the_folders_deepspeed_writes(tmp_path):
    root = tmp_path / "zero_stage_3"
    for rel, size in {"bfloat16params/rank1/7_param.tensor.swp": 3, "optimizer/rank1/0.tensor.swp": 5,
                      "optimizer/rank1/0_gradient_0_9.tensor.swp": 2, "optimizer/rank0/0.tensor.swp": 11}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * size)
    assert zero_infinity.swap_files(tmp_path, 1) == {
        "optimizer_states": {"zero_stage_3/optimizer/rank1/0.tensor.swp": 5},
        "gradients": {"zero_stage_3/optimizer/rank1/0_gradient_0_9.tensor.swp": 2},
        "parameters": {"zero_stage_3/bfloat16params/rank1/7_param.tensor.swp": 3}}


def test_without_libaio_the_program_says_what_to_install_before_any_rank_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(zero_infinity, "nvme_available", lambda: False)
    with pytest.raises(ValueError, match=r"apt-get install libaio-dev") as refused:
        checked_flags("zero_infinity", 2, "torchrun", tmp_path, {})
    assert "\n" not in str(refused.value)
