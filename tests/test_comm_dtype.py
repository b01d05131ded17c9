"""Cheaper communication: bf16 gradients halve the bytes on the wire; ZeRO++ is refused on a CPU, accepted on CUDA."""
import math

import pytest
import torch

from helpers.comms import dtype_rows
from helpers.config import build_config, validate
from helpers.errors import ConfigError
from helpers.launch import per_run, run_program
from helpers.programs import comm_dtype


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """One real 2-rank launch at ZeRO-2: fp32 then bf16 gradient communication, same model, data and seed."""
    ranks = run_program("comm_dtype", 2, out_dir=tmp_path_factory.mktemp("comm"), dtypes=("fp32", "bf16"), stage=2, steps=3)
    return per_run(ranks, "runs", "dtype")


def test_bf16_sends_half_the_gradient_bytes_of_fp32(two_rank_runs):
    fp32, bf16 = two_rank_runs["fp32"][0], two_rank_runs["bf16"][0]
    assert (fp32["engine_comm_dtype"], bf16["engine_comm_dtype"]) == ("float32", "bfloat16")
    # Independent of the logger: every gradient crosses the wire once per step, as fp32 or bf16 elements.
    for run, element_bytes in ((fp32, 4), (bf16, 2)):
        logged = sum(int(size) * count for sizes in run["gradient_logged"].values() for size, count in sizes.items())
        assert logged == run["n_params"] * element_bytes
    assert bf16["gradient_sent_bytes"] == fp32["gradient_sent_bytes"] / 2
    assert bf16["gradient_sent_bytes"] > 0


def test_parameter_all_gather_is_not_compressed(two_rank_runs):
    """communication_data_type is a gradient setting: ZeRO's all-gather of updated fp32 weights is unchanged."""
    fp32, bf16 = two_rank_runs["fp32"][0], two_rank_runs["bf16"][0]
    assert bf16["comm_logged"]["all_gather_into_tensor"] == fp32["comm_logged"]["all_gather_into_tensor"]
    table = {row["comm dtype"]: row for row in dtype_rows(two_rank_runs)}
    assert table["bf16"]["gradient vs fp32"] == 0.5
    # ZeRO-2 sends 2 units of gradients (all-reduce) + 1 of weights: bf16 makes it 1 + 1, i.e. 2/3.
    assert table["bf16"]["total vs fp32"] == pytest.approx(2 / 3, rel=1e-4)


def test_bf16_communication_keeps_the_loss_close(two_rank_runs):
    table = {row["comm dtype"]: row for row in dtype_rows(two_rank_runs)}
    assert table["fp32"]["max |loss - fp32 loss|"] == 0.0
    assert math.isfinite(table["bf16"]["final loss"])
    assert table["bf16"]["max |loss - fp32 loss|"] < 1e-3


def test_scalar_reductions_are_not_counted_as_gradients():
    logged = {"all_reduce": {4: 1, 1024: 2}, "all_gather_into_tensor": {512: 1}, "reduce_scatter_tensor": {8: 1}}
    assert comm_dtype.gradient_collectives(logged) == {"all_reduce": {1024: 2}, "reduce_scatter_tensor": {}}


def test_rows_need_the_fp32_reference():
    with pytest.raises(ValueError, match="include 'fp32'"):
        dtype_rows({"bf16": []})


def zeropp_config(**features) -> dict:
    return build_config(zero_stage=3, zero_extra=features)


def test_zeropp_block_is_accepted_for_cuda():
    config = zeropp_config(zero_quantized_weights=True, zero_quantized_gradients=True, zero_hpz_partition_size=8)
    assert validate(config, device="cuda") is config


def test_zeropp_is_refused_on_a_cpu_by_the_validator():
    with pytest.raises(ConfigError) as err:
        validate(zeropp_config(zero_quantized_weights=True), device="cpu")
    message = str(err.value)
    assert "zero_optimization.zero_quantized_weights" in message
    assert "CUDA GPU" in message and "communication_data_type" in message
    with pytest.raises(ConfigError):
        validate(zeropp_config(zero_quantized_gradients=True), device="cpu")


def test_unknown_zeropp_feature_is_named():
    with pytest.raises(ValueError, match="'activations'"):
        comm_dtype.zeropp_block(("weights", "activations"))


def test_deepspeed_has_no_cpu_quantizer_kernel():
    """Why quantized weights fail inside deepspeed.initialize on a CPU (zeropp_trial's notes; helpers.config refuses them)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine has the quantizer kernel")
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer
    with pytest.raises(ValueError) as err:
        CUDAQuantizer()   # what zero.Init builds when zero_quantized_weights is on
    failure = comm_dtype.describe_failure(err.value, "deepspeed.initialize")
    assert failure["error"] == "ValueError: This op had not been implemented on CPU backend."
    assert failure["where"].startswith("runtime/zero/partition_parameters.py:")
    assert "QuantizerBuilder().load()" in failure["where"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="ZeRO++ needs a CUDA GPU")
def test_zeropp_trains_on_gpu(tmp_path):
    gpus = torch.cuda.device_count()
    ranks = run_program("comm_dtype", gpus, out_dir=tmp_path, zeropp=("weights", "gradients", "hpz"), hpz=gpus,
                        steps=3, precision="auto")
    for r in ranks:
        assert r["ran"], r["error"]
        assert r["engine_read"]["zero_quantized_weights"] and r["engine_read"]["zero_quantized_gradients"]
        assert all(math.isfinite(x) for x in r["losses"])
