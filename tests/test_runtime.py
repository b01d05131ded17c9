"""Precision choice and the single-process distributed environment."""
import os

import pytest

from helpers.runtime import choose_precision, cpu_flags, detect, free_port, init_single_process


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


def test_single_process_env_keeps_existing_values(monkeypatch):
    import torch.distributed as dist
    if not dist.is_initialized():
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    env = init_single_process()
    assert env["WORLD_SIZE"] == "1" and dist.is_initialized()
    again = init_single_process()   # a re-run must not move the port
    assert again == env and os.environ["MASTER_PORT"] == env["MASTER_PORT"]
