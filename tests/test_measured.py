"""What a rank really holds: storages counted once, the tiny model's measurement settings, and the bytes
the ZeRO comparison's run holds on one rank against the ZeRO formula at every stage."""
import pytest
import torch

from helpers.memory import measured
from helpers.memory.formulas import bytes_per_param, zero_model_states
from helpers.programs import zero_stages

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


def test_allocated_peak_follows_every_allocation_and_free_on_a_cpu():
    with measured.allocated_peak("cpu") as counted:
        kept = torch.empty(1000, 1000)                          # 4,000,000 B, kept
        promised = torch.empty(250_000_000, dtype=torch.bfloat16)   # 500,000,000 B never written: RSS would miss it
        del promised
        product = torch.ones(100) * 2                           # a 400 B temporary and a 400 B result
    assert counted == {"peak": 504_000_000, "end": 4_000_400}
    assert kept.numel() and product.numel()


def test_allocated_peak_sees_a_free_made_on_another_thread():
    """Gloo's worker threads drop the last reference to a collective's tensors: torch's profiler never logged
    those frees (CI's zero.Init build read up to 8.7 MB more than the partitions a rank held)."""
    import threading
    with measured.allocated_peak("cpu") as counted:
        box = [torch.empty(1_000_000)]                          # 4,000,000 B
        view = box[0][10:]                                       # a view: no new storage, nothing counted
        del view
        elsewhere = threading.Thread(target=box.clear)          # the last reference, dropped on another thread
        elsewhere.start()
        elsewhere.join()
    assert counted == {"peak": 4_000_000, "end": 0}


@pytest.fixture(scope="module")
def data():
    from helpers.data import SyntheticTextDataset
    return SyntheticTextDataset("markov", n_samples=256, seq_len=32, seed=0)


@pytest.mark.parametrize("stage, precision", [(s, "fp32") for s in STAGES] + [(0, "bf16"), (2, "bf16")] +
                         [pytest.param(s, None, marks=pytest.mark.precision) for s in STAGES])
def test_held_bytes_match_the_formula_on_one_rank(data, tmp_path, stage, precision):
    """The ZeRO comparison's run on one rank, in this process (precision None: the rule's)."""
    r = zero_stages.run_here({"stage": stage}, data, tmp_path, steps=3, micro_batch=8, precision=precision)
    bucket = r["zero_config"]["reduce_bucket_size"]
    assert bucket == measured.measurement_zero_extra(r["n_params"])["reduce_bucket_size"]   # sized to the model
    held = r["held_bytes"]
    want = zero_model_states(r["n_params"], 1, stage, *bytes_per_param(r["precision"], stage))
    for part in ("params", "grads", "optimizer"):
        assert held[part] == pytest.approx(want[part], rel=0.10), part
    # the only buffer is one reduce bucket (ZeRO-1 while gradients wait, ZeRO-3 always), sized by measurement_zero_extra
    assert held["buffers"] in (0, bucket * bytes_per_param(r["precision"], stage)[1])
    assert r["zero2_overhang_bytes"] == 0   # one rank: no partition boundary to cut a param


def test_held_bytes_are_read_mid_accumulation_only():
    with pytest.raises(SystemExit):   # the program refuses it as a flag, before any model is built
        zero_stages.parse(["--out", "x", "--stages", "1", "--grad-accum", "1"])
