"""ZeRO-Offload: where the bytes live after a step, against the offload formulas of the planner;
and which precisions a runtime offers for notebook 05's 16-bit runs."""
import pytest

from helpers.data import SyntheticTextDataset
from helpers.memory.planner import model_state_bytes
from helpers.precision import ELEMENT_BYTES, loss_tolerance, trainable_precisions
from helpers.programs.zero_stages import run_here
from helpers.topics import offload

pytestmark = pytest.mark.precision   # follows the precision rule: run again with the other one forced


@pytest.fixture(scope="module")
def data():
    return SyntheticTextDataset("markov", n_samples=128, seq_len=32, seed=0)


CPU = {"device": "cpu", "pin_memory": False}


def test_zero2_offload_leaves_only_parameters_on_the_accelerator(data, tmp_path):
    blocks = {"ZeRO-2": {"stage": 2}, "ZeRO-2 + offload": {"stage": 2, "offload_optimizer": CPU}}
    plain, moved = offload.compare(run_here, data, blocks, steps=3, output_dir=tmp_path)
    psi, precision = moved["n_params"], moved["precision"]
    assert plain["host_bytes"] == 0 and plain["optimizer"] == "AdamW"
    assert moved["optimizer"] == "DeepSpeedCPUAdam" and moved["host_devices"] == ["cpu"]
    assert moved["zero_config"]["offload_optimizer"] == CPU   # the block as written reached DeepSpeed
    assert moved["accelerator_bytes"] == ELEMENT_BYTES[precision] * psi   # the model's own parameters
    # fp32 master + Adam (12) + fp32 gradient (4) + the partition in the training dtype (2 or 4), and, because
    # the program accumulates 2 micro-batches, the partition's accumulated gradients in the training dtype
    accumulated = ELEMENT_BYTES[precision] * psi
    assert moved["host_bytes"] - accumulated == model_state_bytes(psi, 1, 2, "optimizer", precision)["cpu"] \
        == (16 + ELEMENT_BYTES[precision]) * psi
    # same math, other optimizer
    assert moved["losses"] == pytest.approx(plain["losses"], abs=loss_tolerance(precision))


def test_zero3_param_offload_moves_the_partitions_too(data, tmp_path):
    blocks = {"ZeRO-3 + offload optimizer + params": {"stage": 3, "offload_optimizer": CPU, "offload_param": CPU}}
    [r] = offload.compare(run_here, data, blocks, steps=3, output_dir=tmp_path)
    formula = model_state_bytes(r["n_params"], 1, 3, "optimizer+params", r["precision"])["cpu"]
    # DeepSpeed 0.19 keeps one more gradient copy, in the training dtype, on the host (see notebook 05)
    assert formula <= r["host_bytes"] <= formula + ELEMENT_BYTES[r["precision"]] * r["n_params"]
    assert r["accelerator_bytes"] < r["host_bytes"] / 4


def test_rows_report_ratios_to_the_first_configuration():
    fake = [{"name": n, "accelerator_bytes": 1e6, "host_bytes": 0, "host_devices": [], "optimizer": "AdamW",
             "step_s": s, "losses": [1.0]} for n, s in (("a", [1, 3, 1]), ("b", [2, 2, 9]))]
    assert [r["time vs first"] for r in offload.rows(fake)] == [1.0, 2.0]   # medians: one slow step moves neither


@pytest.mark.parametrize("device, capability, expected", [
    ("cpu", None, ["fp32", "bf16"]), ("cuda", (7, 5), ["fp32", "fp16"]), ("cuda", (8, 0), ["fp32", "bf16", "fp16"])])
def test_trainable_precisions(device, capability, expected):
    assert list(trainable_precisions(device, capability)) == expected
