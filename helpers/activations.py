"""Activation memory of a GPT-2 training step: the formula of Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models" (Sec. 4.1), and a measurement to check it.

Model states (helpers.memory) are fixed by the parameter count; activations grow with the batch and
the sequence (quadratically, through attention scores), so at long sequences they are what runs out.
Activation checkpointing keeps only each layer's input and recomputes the rest in the backward pass.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def activation_elements_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                                  dropout: bool = False) -> tuple[float, float]:
    """(elements saved for backward, dropout-mask bytes) of one transformer layer.

    Counted tensor by tensor as in the paper (s = seq_len, b = micro_batch, h = hidden, a = heads):
      attention: QKV-projection input sbh, Q and K 2sbh, softmax output as^2b, [softmax-dropout output
        as^2b], V sbh, output-projection input sbh              -> 5sbh + as^2b  [+ as^2b]
      MLP: first-linear input sbh, GeLU input 4sbh, second-linear input 4sbh -> 9sbh
      two LayerNorms: their inputs, sbh each                  -> 2sbh
    Dropout adds 1-byte masks: as^2b (attention probabilities), sbh (after attention), sbh (after MLP).
    """
    sbh, as2b = seq_len * micro_batch * hidden, heads * seq_len ** 2 * micro_batch
    elements = 16 * sbh + as2b
    if not dropout:
        return elements, 0.0
    return elements + as2b, 2 * sbh + as2b


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                               bytes_per_element: float = 2, checkpointing: bool = False,
                               dropout: bool = False) -> float:
    """Bytes one transformer layer keeps for its backward pass.

    The paper's sbh(34 + 5as/h) is the 16-bit case with dropout: elements (16sbh + 2as^2b) x 2 bytes
    + masks (2sbh + as^2b) x 1 byte = 34sbh + 5as^2b. By block: attention 11sbh + 5as^2b (QKV input
    2sbh, Q K 4sbh, softmax 2as^2b, its mask as^2b, dropout output 2as^2b, V 2sbh, output-projection
    input 2sbh, its mask sbh), MLP 19sbh (input 2sbh, GeLU input 8sbh, GeLU output 8sbh, mask sbh),
    LayerNorms 4sbh. Without dropout there are no masks and the dropout output is the softmax itself:
    (16sbh + as^2b) x bytes_per_element, i.e. sbh(32 + 2as/h) in 16-bit and twice that in fp32.
    With full checkpointing a layer keeps only its input: bytes_per_element x sbh (2sbh in 16-bit);
    the one layer being recomputed is added once per model by `activation_bytes`.
    """
    if checkpointing:
        return bytes_per_element * seq_len * micro_batch * hidden
    elements, mask_bytes = activation_elements_per_layer(seq_len, micro_batch, hidden, heads, dropout)
    return elements * bytes_per_element + mask_bytes


def activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, n_layer: int, vocab: int,
                     bytes_per_element: float = 2, checkpointing: bool = False, dropout: bool = False) -> dict:
    """Activation bytes of the whole model, by term.

    layers: n_layer x `activation_bytes_per_layer`.
    recompute: with checkpointing, one layer's full activations exist again while its backward runs.
    logits: kept apart because it follows the vocabulary, not the layers, and at small h with a 50k
      vocabulary it is often the largest term: the loss's fp32 log-softmax (the paper's 4sbv) plus the
      logits tensor itself, which HF's model output holds (bytes_per_element x sbv).
    """
    per_layer = activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, bytes_per_element,
                                           checkpointing, dropout)
    recompute = (activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, bytes_per_element,
                                            False, dropout) if checkpointing else 0.0)
    logits = seq_len * micro_batch * vocab * (4 + bytes_per_element)
    out = {"layers": n_layer * per_layer, "recompute": recompute, "logits": logits}
    return {**out, "total": sum(out.values())}


# ---------------------------------------------------------------- measurement (runs in a child process)

def peak_source(device_type: str) -> str:
    """How a step's peak is read: the CUDA caching allocator's counters on a GPU, the process's peak
    resident set size (RSS) elsewhere (a CPU has no allocator statistics)."""
    return "cuda" if device_type == "cuda" else "rss"


def _rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since start or the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0), so a warm-up step's peak doesn't count."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _build(model_size: str, seq_len: int, vocab: int, precision: str, checkpointing: bool, device: str):
    """The tutorial's GPT-2, set up as the paper counts: eager attention (SDPA's fused kernels never
    store the as^2b scores) and a fused GeLU (HF's gelu_new is Python and saves three extra 4sbh intermediates)."""
    import torch
    from .model import build_model, enable_checkpointing
    model = build_model(vocab, seq_len, model_size)   # dropout off
    model.set_attn_implementation("eager")
    for block in model.transformer.h:
        block.mlp.act = torch.nn.GELU(approximate="tanh")   # same function as gelu_new, one kernel
    model.config.use_cache = False   # no KV cache in training
    if checkpointing:
        enable_checkpointing(model)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return model.to(device=device, dtype=dtype).train()


def _child_measure(model_size: str, seq_len: int, micro_batch: int, checkpointing: bool, precision: str,
                   vocab: int, steps: int) -> dict:
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    source = peak_source(device)
    model = _build(model_size, seq_len, vocab, precision, checkpointing, device)
    ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device, generator=None)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    step()   # warm-up: lazy allocations (kernels, thread pools) and the .grad tensors
    # Keep the grads allocated (zeroed, not None): they are model states, so the baseline holds them
    # and the measured difference is the step's activations plus backward's transient buffers.
    model.zero_grad(set_to_none=False)
    if source == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()   # if refused, the lifetime peak also holds the warm-up step's (about equal)
        base = _rss_bytes("VmRSS")
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    # Bytes held between forward and backward: the saved activations (and logits), no transients.
    held = (torch.cuda.memory_allocated() if source == "cuda" else _rss_bytes("VmRSS")) - base
    loss.backward()
    del loss
    if source == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _rss_bytes("VmHWM") - base
    times = [time.perf_counter() - start]
    for _ in range(steps - 1):
        start = time.perf_counter()
        step()
        if source == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    n_params = sum(p.numel() for p in model.parameters())
    return {"peak_bytes": peak, "forward_bytes": held, "seconds": sorted(times)[len(times) // 2], "source": source,
            "device": device, "n_params": n_params}


def child_env() -> dict:
    """Environment for the measuring child. glibc keeps freed blocks below its (self-raising, up to
    32 MB) mmap threshold in the heap, so RSS would show the allocator's high-water, not live tensors;
    a fixed 64 KiB threshold returns every large tensor to the OS when it is freed."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def measure_step_memory(model_size: str = "tiny", seq_len: int = 256, micro_batch: int = 8,
                        checkpointing: bool = False, precision: str = "fp32", vocab: int = 512,
                        steps: int = 2, timeout: float = 300) -> dict:
    """Bytes one training step (forward + backward, plain PyTorch) adds on top of the model states,
    and its time, measured in a fresh process so nothing this kernel allocated earlier blurs the peak.

    CPU: peak RSS during the step minus RSS before it. CUDA: max_memory_allocated minus
    memory_allocated before it. `forward_bytes`: what the step holds between forward and backward
    (the saved activations and logits). `seconds`: median of `steps` steps (the first after a warm-up).
    """
    args = dict(model_size=model_size, seq_len=seq_len, micro_batch=micro_batch, checkpointing=checkpointing,
                precision=precision, vocab=vocab, steps=steps)
    proc = subprocess.run([sys.executable, "-m", "helpers.activations", "--measure", json.dumps(args)],
                          cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def predict(model_size: str, seq_len: int, micro_batch: int, checkpointing: bool, precision: str = "fp32",
            vocab: int = 512) -> dict:
    """`activation_bytes` for one of the tutorial's model sizes (no dropout: build_model turns it off)."""
    from .model import MODEL_SIZES
    n_layer, hidden, heads = MODEL_SIZES[model_size]
    return activation_bytes(seq_len, micro_batch, hidden, heads, n_layer, vocab,
                            {"fp32": 4, "bf16": 2, "fp16": 2}[precision], checkpointing)


def sweep(seq_lens=(256, 512, 1024), micro_batch: int = 1, model_size: str = "small",
          precision: str = "fp32", vocab: int = 512, steps: int = 1) -> list[dict]:
    """Measured vs predicted activation bytes, without and with checkpointing, at each seq_len.

    The defaults (4 layers, h = 256, a tiny vocabulary, seq up to 1024) make the layers' activations,
    not the logits or the allocator's noise, the bulk of the step, and run in under a minute on 2 cores
    (most of it starting the six child processes).

    held_*: bytes kept between forward and backward; without checkpointing RSS matched the formula
    within 1% on a 2-core box. measured/predicted: the step's peak, 5-15% above the formula without
    checkpointing and up to ~50% above with it at seq 1024, for two things the formula leaves out:
    backward's transient gradient of the attention scores (about as^2b x bytes) and, with HF's eager
    attention under checkpointing, the b x s^2 fp32 causal mask it keeps as a checkpoint input.
    """
    rows = []
    for seq_len in seq_lens:
        for ckpt in (False, True):
            got = measure_step_memory(model_size, seq_len, micro_batch, ckpt, precision, vocab, steps)
            want = predict(model_size, seq_len, micro_batch, ckpt, precision, vocab)
            held = want["total"] - want["recompute"]   # what is stored between forward and backward
            rows.append({"seq_len": seq_len, "micro_batch": micro_batch, "checkpointing": ckpt,
                         "held_MB": got["forward_bytes"] / 1e6, "held_predicted_MB": held / 1e6,
                         "held_ratio": got["forward_bytes"] / held,
                         "measured_MB": got["peak_bytes"] / 1e6, "predicted_MB": want["total"] / 1e6,
                         "ratio": got["peak_bytes"] / want["total"], "seconds": got["seconds"]})
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


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":
        print(json.dumps(_child_measure(**json.loads(sys.argv[2]))))
    else:
        for row in sweep():
            print(row)
