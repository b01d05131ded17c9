"""Notebook 05's activation sweep: one training step's memory measured in a fresh process, beside
Korthikanti et al.'s formula (formulas.activation_bytes), without and with activation checkpointing.
Checkpointing keeps only each layer's input and recomputes the rest in the backward pass.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from statistics import median_high

from .. import REPO_ROOT, with_repo_on_path
from helpers.memory.formulas import activation_bytes_for
from helpers.memory.measured import allocated_peak, tensor_peak


def _build(model_size: str, seq_len: int, vocab: int, precision: str, checkpointing: bool, device: str):
    """The tutorial's GPT-2, set up as the paper counts: eager attention (SDPA's fused kernels never
    store the as^2b scores) and a fused GeLU (HF's gelu_new is Python and saves three extra 4sbh intermediates)."""
    import torch
    from ..model import build_model, enable_checkpointing
    from ..precision import dtype
    model = build_model(vocab, seq_len, model_size)   # dropout off
    model.set_attn_implementation("eager")
    for block in model.transformer.h:
        block.mlp.act = torch.nn.GELU(approximate="tanh")   # same function as gelu_new, one kernel
    model.config.use_cache = False   # no KV cache in training
    if checkpointing:
        enable_checkpointing(model)
    return model.to(device=device, dtype=dtype(precision)).train()


def _child_measure(model_size: str, seq_len: int, micro_batch: int, checkpointing: bool, precision: str,
                   vocab: int, steps: int) -> dict:
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _build(model_size, seq_len, vocab, precision, checkpointing, device)
    ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()   # time the step, not its launch

    step()   # warm-up: lazy allocations (kernels, thread pools) and the .grad tensors
    # Keep the grads allocated (zeroed, not None): they are model states, so the baseline holds them
    # and the measured difference is the step's activations plus backward's transient buffers.
    model.zero_grad(set_to_none=False)
    # The tensors' own bytes on every device, so the formula checks mean the same on a CPU and a GPU; a GPU's
    # allocator also rounds each block up to 512 bytes and hands kernels scratch: its peak is read apart, below.
    with tensor_peak() as whole:
        with tensor_peak() as forward:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()   # forward's "end": what it holds for backward, the saved activations and logits
        del loss
    held, peak = forward["end"], whole["peak"]
    allocator = None
    if device == "cuda":
        with allocated_peak(device) as seen:
            model(input_ids=ids, labels=ids).loss.backward()
        allocator = seen["peak"]
    times = []
    for _ in range(steps):   # timed apart from the counting, which adds Python work to every op on a CPU
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_bytes": peak, "forward_bytes": held, "allocator_peak_bytes": allocator,
            "seconds": median_high(times) if times else None, "source": "tensors", "device": device,
            "n_params": sum(p.numel() for p in model.parameters())}


def _child_time(model_size: str, seq_len: int, micro_batch: int, precision: str, vocab: int, steps: int) -> dict:
    """Seconds per step without and with checkpointing, timed in turns in one process, the order flipped every
    round: a busy moment of a shared machine slows both, so their ratio holds where two runs' times would not."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {ckpt: _build(model_size, seq_len, vocab, precision, ckpt, device) for ckpt in (False, True)}
    ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)

    def timed_step(model) -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()   # time the step, not its launch
        return time.perf_counter() - start

    for model in models.values():
        timed_step(model)   # warm-up: lazy allocations, thread pools, the .grad tensors
    times = {ckpt: [] for ckpt in models}
    for turn in range(steps):
        for ckpt in ((False, True) if turn % 2 == 0 else (True, False)):
            times[ckpt].append(timed_step(models[ckpt]))
    return {"plain": median_high(times[False]), "checkpointed": median_high(times[True])}


def measure_step_memory(model_size: str = "tiny", seq_len: int = 256, micro_batch: int = 8,
                        checkpointing: bool = False, precision: str = "fp32", vocab: int = 512,
                        steps: int = 2, timeout: float = 300) -> dict:
    """Bytes one training step (forward + backward, plain PyTorch) adds on top of the model states,
    and its time, measured in a fresh process so nothing this kernel allocated earlier blurs the peak.

    Tensor bytes, counted by `tensor_peak` (each storage followed to its free, on any device); on a GPU also
    `allocator_peak_bytes`, the CUDA allocator's peak for a third step (None elsewhere). `forward_bytes`: what the
    step holds between forward and backward (the saved activations and logits). `seconds`: median of `steps`
    steps after a warm-up, timed without the counting.
    """
    return _in_child("--measure", timeout, model_size=model_size, seq_len=seq_len, micro_batch=micro_batch,
                     checkpointing=checkpointing, precision=precision, vocab=vocab, steps=steps)


def step_seconds(model_size: str, seq_len: int, micro_batch: int, precision: str, vocab: int, steps: int,
                 timeout: float = 300) -> dict:
    """{"plain": s, "checkpointed": s}: median seconds per training step without and with checkpointing,
    timed in turns in one fresh process (`_child_time`)."""
    return _in_child("--time", timeout, model_size=model_size, seq_len=seq_len, micro_batch=micro_batch,
                     precision=precision, vocab=vocab, steps=steps)


def _in_child(mode: str, timeout: float, **args) -> dict:
    env = with_repo_on_path(dict(os.environ))
    proc = subprocess.run([sys.executable, "-m", __name__, mode, json.dumps(args)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sweep(seq_lens=(256, 512, 1024), micro_batch: int = 1, model_size: str = "small",
          precision: str = "fp32", vocab: int = 512, steps: int = 1) -> list[dict]:
    """Measured vs predicted activation bytes, without and with checkpointing, at each seq_len.

    The defaults (4 layers, h = 256, a tiny vocabulary) make the layers' activations, not the logits or
    the allocator's noise, the bulk of the step. held_*: bytes kept between forward and backward;
    measured/predicted: the step's peak, which also holds what the formula leaves out (notebook 05 names it).
    seconds: per step, without and with checkpointing timed in turns in one process (`step_seconds`).
    """
    rows = []
    for seq_len in seq_lens:
        seconds = step_seconds(model_size, seq_len, micro_batch, precision, vocab, steps)
        for ckpt in (False, True):
            got = measure_step_memory(model_size, seq_len, micro_batch, ckpt, precision, vocab, steps=0)
            want = activation_bytes_for(model_size, seq_len, micro_batch, ckpt, precision, vocab)
            held = want["total"] - want["recompute"]   # what is stored between forward and backward
            rows.append({"seq_len": seq_len, "micro_batch": micro_batch, "checkpointing": ckpt,
                         "held_MB": got["forward_bytes"] / 1e6, "held_predicted_MB": held / 1e6,
                         "held_ratio": got["forward_bytes"] / held,
                         "measured_MB": got["peak_bytes"] / 1e6, "predicted_MB": want["total"] / 1e6,
                         "ratio": got["peak_bytes"] / want["total"],
                         **({"allocator_MB": got["allocator_peak_bytes"] / 1e6}   # a GPU's: rounding, scratch
                            if got["allocator_peak_bytes"] is not None else {}),
                         "seconds": seconds["checkpointed" if ckpt else "plain"]})
    return rows


def savings(rows: list[dict]) -> list[dict]:
    """Per seq_len: what checkpointing saved, measured and predicted. A difference of two peaks cancels
    what both runs share (backward's transient buffers, the logits, allocator slack)."""
    by = {(r["seq_len"], r["checkpointing"]): r for r in rows}
    out = []
    for s in sorted({r["seq_len"] for r in rows}):
        off, on = by[(s, False)], by[(s, True)]
        measured, predicted = off["measured_MB"] - on["measured_MB"], off["predicted_MB"] - on["predicted_MB"]
        out.append({"seq_len": s, "saved_measured_MB": measured, "saved_predicted_MB": predicted,
                    "ratio": measured / predicted, "slowdown": on["seconds"] / off["seconds"]})
    return out


if __name__ == "__main__":   # the measuring child: python -m helpers.topics.activations --measure|--time '{...}'
    print(json.dumps({"--measure": _child_measure, "--time": _child_time}[sys.argv[1]](**json.loads(sys.argv[2]))))
