"""What a rank really holds: storages counted once, the tiny model's measurement settings, and the bytes
a trainer holds on one rank against the ZeRO formula at every stage."""
import pytest
import torch

from helpers.memory import measured
from helpers.memory.formulas import bytes_per_param, zero_model_states

STAGES = (0, 1, 2, 3)


def test_measurement_settings_shrink_buckets_and_partition_everything():
    extra = measured.measurement_zero_extra(417_535)
    assert extra["reduce_bucket_size"] == extra["allgather_bucket_size"] == 417_536   # even, as DeepSpeed asks
    assert extra["stage3_param_persistence_threshold"] == 0


def test_storage_is_counted_once():
    base = torch.zeros(100)                    # 400 bytes
    views = [base[:50], base[50:], base.view(10, 10)]
    assert measured.storage_bytes(views) == 400
    tied = torch.nn.Linear(10, 10, bias=False)
    assert measured.storage_bytes([tied.weight, tied.weight, torch.zeros(3, device="meta")]) == 400
    seen = set()   # shared between calls: the second call finds nothing new
    assert measured.storage_bytes([base], seen) == 400 and measured.storage_bytes(views, seen) == 0


@pytest.fixture(scope="module")
def data():
    from helpers.data import SyntheticTextDataset
    return SyntheticTextDataset("markov", n_samples=256, seq_len=32, seed=0)


@pytest.mark.parametrize("stage, precision", [(s, "fp32") for s in STAGES] + [(0, "bf16"), (2, "bf16")] +
                         [pytest.param(s, "auto", marks=pytest.mark.precision) for s in STAGES])
def test_held_bytes_match_the_formula_on_one_rank(data, tmp_path, stage, precision):
    trainer = measured.measuring_trainer(data, zero_stage=stage, precision=precision, micro_batch=8, grad_accum=2,
                                         warmup_steps=2, total_steps=10, output_dir=tmp_path)
    bucket = trainer.config["zero_optimization"]["reduce_bucket_size"]
    assert bucket == measured.measurement_zero_extra(trainer.n_params)["reduce_bucket_size"]   # sized to the model
    held = measured.measure_held(trainer)
    want = zero_model_states(trainer.n_params, 1, stage, *bytes_per_param(trainer.precision, stage))
    for part in ("params", "grads", "optimizer"):
        assert held[part] == pytest.approx(want[part], rel=0.10), part
    # the only buffer is one reduce bucket (ZeRO-1 while gradients wait, ZeRO-3 always), sized by measurement_zero_extra
    assert held["buffers"] in (0, bucket * bytes_per_param(trainer.precision, stage)[1])
    assert measured.zero2_overhang_bytes(trainer.engine) == 0   # one rank: no partition boundary to cut a param
    with pytest.raises(ValueError, match="grad_accum >= 2"):
        trainer.grad_accum = 1
        measured.measure_held(trainer)
