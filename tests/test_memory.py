"""Model-state accounting: the ZeRO paper's numbers, DeepSpeed's estimators, and bytes really held."""
import pytest
import torch

from helpers import memory
from helpers.memory import GB, bytes_per_param, deepspeed_estimate, zero_model_states

STAGES = (0, 1, 2, 3)


def test_the_papers_worked_example():
    """ZeRO paper Fig. 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12)."""
    totals = [round(zero_model_states(7.5e9, 64, s)["total"] / GB, 1) for s in STAGES]
    assert totals == [120.0, 31.4, 16.6, 1.9]
    rows = memory.paper_table(7.5e9, [1, 64])
    assert [round(r["total"], 1) for r in rows if r["n_ranks"] == 64] == totals
    assert {r["total"] for r in rows if r["n_ranks"] == 1} == {120.0}


@pytest.mark.parametrize("n_ranks", [2, 8, 64])
def test_each_stage_partitions_one_more_component(n_ranks):
    psi = 1e6
    one = {s: zero_model_states(psi, 1, s) for s in STAGES}
    many = {s: zero_model_states(psi, n_ranks, s) for s in STAGES}
    totals = [many[s]["total"] for s in STAGES]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    for stage in STAGES:   # which components are divided by N at this stage
        divided = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
        for part, is_divided in divided.items():
            assert many[stage][part] == pytest.approx(one[stage][part] / (n_ranks if is_divided else 1))
    assert {one[s]["total"] for s in STAGES} == {16 * psi}   # one rank: nothing to partition across


def test_bad_stage_or_ranks_are_refused():
    with pytest.raises(ValueError, match="stage=4"):
        zero_model_states(1e6, 2, 4)
    with pytest.raises(ValueError, match="n_ranks=0"):
        zero_model_states(1e6, 0, 1)
    with pytest.raises(ValueError, match="precision='fp8'"):
        bytes_per_param("fp8", 0)


def test_bytes_per_param_table():
    assert [bytes_per_param("bf16", s) for s in STAGES] == [(2, 2, 12)] * 4
    assert bytes_per_param("fp32", 0) == (4, 4, 8)
    assert [bytes_per_param("fp32", s) for s in (1, 2, 3)] == [(4, 4, 12)] * 3


@pytest.mark.parametrize("n_ranks", [1, 4, 64])
def test_deepspeed_estimate_is_deepspeeds_own(n_ranks):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    psi, layer = 124_439_808, 50257 * 768
    cpu2, gpu2 = estimate_zero2_model_states_mem_needs(psi, n_ranks, 1, cpu_offload=False)
    cpu3, gpu3, _ = estimate_zero3_model_states_mem_needs(psi, layer, n_ranks, 1, cpu_offload=False,
                                                         cpu_offload_params=False, zero_init=True)
    assert deepspeed_estimate(psi, n_ranks, 2) == {"gpu_bytes": gpu2, "cpu_bytes": cpu2}
    assert deepspeed_estimate(psi, n_ranks, 3, largest_layer_params=layer) == {"gpu_bytes": gpu3, "cpu_bytes": cpu3}
    # the documented per-param bytes: ZeRO-2 2 + 18/N (fp32 grads counted), ZeRO-3 18/N + 4 per largest-layer param
    assert gpu2 == pytest.approx(psi * (2 + 18 / n_ranks), abs=1)
    assert gpu3 == pytest.approx(psi * 18 / n_ranks + 4 * layer, abs=1)
    assert gpu2 - zero_model_states(psi, n_ranks, 2)["total"] == pytest.approx(4 * psi / n_ranks, abs=1)
    with pytest.raises(ValueError, match="stages 2 and 3"):
        deepspeed_estimate(psi, n_ranks, 1)


def test_gpt2_sizes():
    sizes = {row["name"]: row["params"] for row in memory.gpt2_sizes()}
    assert sizes == {"124M": 124_439_808, "355M": 354_823_168, "774M": 774_030_080, "1.5B": 1_557_611_200}


def test_measurement_settings_shrink_buckets_and_partition_everything():
    extra = memory.measurement_zero_extra(417_535)
    assert extra["reduce_bucket_size"] == extra["allgather_bucket_size"] == 417_536   # even, as DeepSpeed asks
    assert extra["stage3_param_persistence_threshold"] == 0


def test_storage_is_counted_once():
    base = torch.zeros(100)                    # 400 bytes
    views = [base[:50], base[50:], base.view(10, 10)]
    assert memory.storage_bytes(views) == 400
    tied = torch.nn.Linear(10, 10, bias=False)
    assert memory.storage_bytes([tied.weight, tied.weight, torch.zeros(3, device="meta")]) == 400
    seen = set()   # shared between calls: the second call finds nothing new
    assert memory.storage_bytes([base], seen) == 400 and memory.storage_bytes(views, seen) == 0


@pytest.fixture(scope="module")
def data():
    from helpers.data import SyntheticTextDataset
    return SyntheticTextDataset("markov", n_samples=256, seq_len=32, seed=0)


@pytest.mark.parametrize("stage, precision", [(s, "fp32") for s in STAGES] + [(0, "bf16"), (2, "bf16")] +
                         [pytest.param(s, "auto", marks=pytest.mark.precision) for s in STAGES])
def test_held_bytes_match_the_formula_on_one_rank(data, tmp_path, stage, precision):
    from helpers.trainer import AdvancedDeepSpeedTrainer
    extra = memory.measurement_zero_extra(420_000)   # the tiny model has 417,536 parameters
    trainer = AdvancedDeepSpeedTrainer(data, model_size="tiny", zero_stage=stage, precision=precision, micro_batch=8,
                                       grad_accum=2, warmup_steps=2, total_steps=10, zero_extra=extra,
                                       output_dir=tmp_path)
    held = memory.measure_held(trainer)
    want = zero_model_states(trainer.n_params, 1, stage, *bytes_per_param(trainer.precision, stage))
    for part in ("params", "grads", "optimizer"):
        assert held[part] == pytest.approx(want[part], rel=0.10), part
    # the only buffer is one reduce bucket (ZeRO-1 while gradients wait, ZeRO-3 always), sized by zero_extra
    assert held["buffers"] in (0, extra["reduce_bucket_size"] * bytes_per_param(trainer.precision, stage)[1])
    assert memory.zero2_overhang_bytes(trainer.engine) == 0   # one rank: no partition boundary to cut a param
    with pytest.raises(ValueError, match="grad_accum >= 2"):
        trainer.grad_accum = 1
        memory.measure_held(trainer)
