"""Precision choice and the single-process distributed environment."""
import os
from pathlib import Path

import pytest

from helpers.runtime import choose_precision, cpu_flags, detect, free_port


@pytest.mark.parametrize("capability, flags, expected", [
    ((9, 0), set(), "bf16"),            # H100 / H200
    ((8, 0), set(), "bf16"),            # A100
    ((7, 5), set(), "fp16"),            # T4 (Colab free tier)
    ((6, 0), set(), "fp16"),            # P100
    (None, {"avx2"}, "fp32"),           # CPU without native bf16
    (None, {"avx2", "avx512_bf16"}, "bf16"),
    (None, {"amx_bf16"}, "bf16"),
])
def test_precision_rule(capability, flags, expected):
    precision, reason = choose_precision(capability, flags)
    assert precision == expected and reason


def test_detect_on_this_machine_is_consistent():
    rt = detect()
    assert rt.device in ("cpu", "cuda") and rt.memory_gb > 0
    flags = cpu_flags() if rt.device == "cpu" else set()
    assert rt.precision == choose_precision(rt.capability, flags)[0]


def test_free_port_is_bindable():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def run_fresh(code: str, **env) -> dict:
    """Run `code` in a new Python process (no process group yet) and return the dict it prints."""
    import json, subprocess, sys
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                              "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


SETUP_TWICE = """
import json
from helpers.runtime import init_single_process
first = init_single_process(); second = init_single_process()
print(json.dumps({"first": first, "second": second}))
"""


def test_single_process_env_fills_only_what_is_missing():
    got = run_fresh(SETUP_TWICE, MASTER_ADDR="localhost")
    first = got["first"]
    assert first["RANK"] == "0" and first["WORLD_SIZE"] == "1" and first["LOCAL_RANK"] == "0"
    assert first["MASTER_ADDR"] == "localhost"        # a value that was already set is kept
    assert int(first["MASTER_PORT"]) > 0
    assert got["second"] == first                      # a re-run changes nothing, the port included


def test_compare_adamw_times_each_variant_on_the_same_gradients_and_leaves_the_module_alone():
    import torch

    from helpers.runtime import compare_adamw
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    before = [p.detach().clone() for p in module.parameters()]
    rows = compare_adamw(module, {"default": {}, "fused": {"fused": True}, "lr 10x": {"lr": 1e-2}}, repeats=3)
    assert [r["optimizer"] for r in rows] == ["default", "fused", "lr 10x"]
    assert all(r["ms per step"] > 0 for r in rows)
    assert rows[0]["max |Δparam| vs first"] == 0
    assert rows[1]["max |Δparam| vs first"] < 1e-6   # the same update, float rounding apart
    assert rows[2]["max |Δparam| vs first"] > 1e-3   # a different update shows up: the comparison can fail
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
