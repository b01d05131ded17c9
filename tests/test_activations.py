"""Activation memory measured: one real training step in a child process, against the formula."""
import pytest

from helpers.memory.formulas import activation_bytes_for
from helpers.memory.measured import peak_source
from helpers.topics import activations


def test_peak_source_per_device():
    assert peak_source("cuda") == "cuda"
    assert peak_source("cpu") == "rss"


def test_a_real_step_matches_the_formula_and_checkpointing_lowers_the_peak():
    """'small' (4 layers, h=256) at seq 512: the layers' activations (~100 MB) dwarf RSS noise."""
    off = activations.measure_step_memory("small", 512, 2, checkpointing=False, steps=1)
    on = activations.measure_step_memory("small", 512, 2, checkpointing=True, steps=1)
    assert off["source"] == on["source"] == "tensors"   # the tensors' own bytes on every device (tensor_peak)
    assert 0 < on["peak_bytes"] < 0.6 * off["peak_bytes"]
    assert off["seconds"] > 0
    assert (off["allocator_peak_bytes"] is None) == (off["device"] == "cpu")   # a GPU's allocator is read apart
    predicted = activation_bytes_for("small", 512, 2, checkpointing=False)["total"]   # held between forward and
    assert off["forward_bytes"] == pytest.approx(predicted, rel=0.1)                  # backward: what it counts


def test_savings_subtracts_the_checkpointed_peak():
    rows = [{"seq_len": 256, "checkpointing": ckpt, "measured_MB": m, "predicted_MB": p, "seconds": t}
            for ckpt, m, p, t in ((False, 30.0, 25.0, 1.0), (True, 10.0, 5.0, 1.5))]
    assert activations.savings(rows) == [{"seq_len": 256, "saved_measured_MB": 20.0, "saved_predicted_MB": 20.0,
                                          "ratio": 1.0, "slowdown": 1.5}]


def test_step_seconds_times_both_variants_in_one_child():
    got = activations.step_seconds("tiny", 64, 1, "fp32", 512, steps=2)
    assert set(got) == {"plain", "checkpointed"} and all(seconds > 0 for seconds in got.values()), got
