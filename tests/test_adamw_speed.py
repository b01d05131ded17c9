"""helpers.topics.adamw_speed: AdamW variants on the same gradients."""
import torch

from helpers.topics.adamw_speed import compare_adamw


def test_compare_adamw_times_each_variant_on_the_same_gradients_and_leaves_the_module_alone():
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    before = [p.detach().clone() for p in module.parameters()]
    rows = compare_adamw(module, {"default": {}, "fused": {"fused": True}, "lr 10x": {"lr": 1e-2}}, repeats=3)
    assert [r["optimizer"] for r in rows] == ["default", "fused", "lr 10x"]
    assert all(r["ms per step"] > 0 for r in rows)
    assert rows[0]["max |Δparam| vs first"] == 0
    assert rows[1]["max |Δparam| vs first"] < 1e-6   # the same update, float rounding apart
    assert rows[2]["max |Δparam| vs first"] > 1e-3   # a different update shows up: the comparison can fail
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
