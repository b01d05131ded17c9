"""The one home of precision: the names, their bytes and torch dtypes, the config block each needs and the
precision a config asks for; which precision to train in (GPUs by compute capability, CPUs by measurement),
the override, the CPU matmul measurement behind it, and how closely two runs in a precision can agree.
torch is imported only where a dtype or a measurement is needed (the planner and formulas run without it)."""
from __future__ import annotations

import os
import time

from .errors import ConfigError

# name -> bytes per element and the torch dtype's name: every table of precisions is read from this one.
PRECISIONS = {"fp32": {"bytes": 4, "torch": "float32"},
              "bf16": {"bytes": 2, "torch": "bfloat16"},
              "fp16": {"bytes": 2, "torch": "float16"}}
ELEMENT_BYTES = {name: spec["bytes"] for name, spec in PRECISIONS.items()}
# bf16 tensor cores arrived with Ampere (sm_80). Below it torch emulates bf16 on a GPU, many times slower.
GPU_BF16_CAPABILITY = (8, 0)


def gpu_has_bf16(capability: tuple) -> bool:
    """Whether a CUDA GPU of this compute capability has bf16 tensor cores (the one home of that rule)."""
    return tuple(capability) >= GPU_BF16_CAPABILITY


def trainable_precisions(device: str, capability: tuple | None = None) -> tuple[str, ...]:
    """The precisions this tutorial trains in on `device` ("cuda" or "cpu"; a GPU's compute `capability`, when
    known, decides bf16), the one home of that rule: fp32 everywhere; bf16 on a CPU and on a GPU with bf16
    tensor cores; fp16 on CUDA GPUs only. DeepSpeed 0.19.8 also takes fp16 on a CPU with oneDNN fp16 kernels
    (accelerator/cpu_accelerator.py is_fp16_supported: AVX512-FP16/AMX-FP16), a path none of the tests runs;
    on a CPU bf16 has fp32's range and needs no loss scaling."""
    bf16 = device != "cuda" or capability is None or gpu_has_bf16(capability)
    return ("fp32",) + (("bf16",) if bf16 else ()) + (("fp16",) if device == "cuda" else ())


def check_name(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is not one of {tuple(PRECISIONS)}")
    return precision


def dtype(precision: str):
    """The torch dtype a precision trains in: dtype("bf16") is torch.bfloat16."""
    import torch
    return getattr(torch, PRECISIONS[check_name(precision)]["torch"])


def precision_block(precision: str) -> dict:
    """The config entries for one precision. fp16 uses dynamic loss scaling (loss_scale 0)."""
    blocks = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                                "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}}
    return blocks[check_name(precision)]


def bare_backward_accepted(config: dict) -> bool:
    """Whether DeepSpeed 0.19.8 accepts a bare `loss.backward()` on an engine built from `config`, the one home of
    that rule. Only a ZeRO optimizer (stage 1-3) hooks the forward's outputs so that torch's backward runs
    DeepSpeed's prologue and epilogue (`DeepSpeedEngine.__init__`: `_support_torch_style_backward`, PR #7665, in
    0.18.3); at ZeRO 0 `_backward_prologue` raises. In fp16 with dynamic loss scaling (`loss_scale` 0, every fp16
    config here) the ZeRO optimizer needs its scaler (`ZeROOptimizer.needs_scaler`), so `_backward_post_hook`
    raises "Loss scaling is required" unless the loss went through `engine.backward` or `engine.scale`."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    dynamic_fp16 = precision_of(config) == "fp16" and config["fp16"].get("loss_scale", 0) == 0
    return stage >= 1 and not dynamic_fp16


def precision_of(config: dict) -> str:
    """The precision a DeepSpeed config asks for: its enabled fp16 or bf16 block, else fp32."""
    if (config.get("fp16") or {}).get("enabled"):
        return "fp16"
    return "bf16" if (config.get("bf16") or {}).get("enabled") else "fp32"


# CPU instruction sets with native bf16 math. Without them PyTorch emulates bf16 matmuls (much slower
# than fp32). With them bf16 can still be slower: avx512_bf16 alone measured 0.56x fp32 on an Intel Xeon,
# AMX 3.5x faster on another. So a flag only says bf16 is worth measuring.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
PRECISION_ENV = "TUTORIAL_PRECISION"   # "fp32" / "bf16" (or "fp16" on a GPU): overrides the rule
BF16_MARGIN = 1.5   # on a CPU, bf16 must run matmuls this many times faster than fp32 to be chosen
# Children (torchrun ranks, notebook kernels) inherit the parent's CPU measurement, so every rank of a
# job picks the same precision and none pays for the measurement again.
MEASURED_ENV = "TUTORIAL_CPU_MATMUL_TFLOPS"


def cpuinfo_field(name: str) -> str:
    """The first value of `name` in Linux's /proc/cpuinfo ("" elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":")[0].strip() == name), "")
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    """The CPU feature flags Linux reports (empty elsewhere)."""
    return set(cpuinfo_field("flags").split())


def choose_precision(capability: tuple | None, flags: set[str] = frozenset(),
                     speeds: dict | None = None) -> tuple[str, str]:
    """(precision, reason) for a CUDA capability, or for the CPU when capability is None.

    On a CPU `speeds` is the measured matmul TFLOP/s per dtype ({"fp32": .., "bf16": ..}); it is only
    consulted where the CPU has native bf16 instructions (elsewhere bf16 is emulated: never faster).
    """
    if capability is not None:
        if gpu_has_bf16(capability):
            return "bf16", f"CUDA sm_{capability[0]}{capability[1]} (Ampere or newer) has bf16 tensor cores"
        return "fp16", (f"CUDA sm_{capability[0]}{capability[1]} has no bf16 tensor cores: "
                        "fp16 with dynamic loss scaling")
    native = sorted(set(CPU_BF16_FLAGS) & set(flags))
    if not native:
        return "fp32", "CPU has no native bf16 instructions (avx512_bf16/amx_bf16), where bf16 is emulated and slower"
    if not speeds:
        raise ValueError("a CPU with native bf16 needs the measured matmul speeds to choose: pass speeds=")
    ratio = speeds["bf16"] / speeds["fp32"]
    measured = f"bf16 matmuls measured {ratio:.2f}x fp32 ({', '.join(native)})"
    if ratio >= BF16_MARGIN:
        return "bf16", f"{measured}: at least {BF16_MARGIN}x, so bf16"
    return "fp32", f"{measured}: below {BF16_MARGIN}x, so fp32 (a bf16 flag is not a speed)"


def forced_precision(device: str, capability: tuple | None = None) -> str | None:
    """The precision named by $TUTORIAL_PRECISION, checked against what this device can run (a GPU's
    compute `capability` decides bf16: below sm_80 torch only emulates it, many times slower)."""
    value = os.environ.get(PRECISION_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    allowed = trainable_precisions(device, capability)
    if value == "bf16" and device == "cuda" and value not in allowed:
        raise ValueError(f"{PRECISION_ENV}=bf16 on a GPU of sm_{capability[0]}{capability[1]}, which has no bf16 "
                         "tensor cores: use fp16 (with dynamic loss scaling) or fp32, or unset it")
    if value not in allowed:
        raise ValueError(f"{PRECISION_ENV}={value!r} is not one of {allowed} (or 'auto') on this {device}: "
                         f"unset it to let the rule choose")
    return value


def cpu_matmul_speeds() -> dict[str, float]:
    """fp32 and bf16 matmul TFLOP/s on this CPU, measured once per process tree (see MEASURED_ENV).

    The two are timed in alternation, best of three rounds each, so a neighbour's load hits both alike;
    a 1.5x margin then separates AMX (3-4x) from avx512_bf16 alone (about 0.5x) with room to spare."""
    cached = os.environ.get(MEASURED_ENV)
    if cached:
        try:
            speeds = {k: float(v) for k, v in (item.split("=") for item in cached.split(","))}
        except ValueError:
            speeds = {}
        if set(speeds) != {"fp32", "bf16"} or min(speeds.values()) <= 0:
            raise ValueError(f"{MEASURED_ENV}={cached!r} is not 'fp32=<TFLOP/s>,bf16=<TFLOP/s>': this process "
                             "sets it for the processes it starts; unset it to measure again")
        return speeds
    best = {"fp32": 0.0, "bf16": 0.0}
    for _ in range(3):
        for name in best:
            best[name] = max(best[name], matmul_tflops(dtype(name), "cpu", n=512, seconds=0.1))
    os.environ[MEASURED_ENV] = ",".join(f"{k}={v!r}" for k, v in best.items())   # repr: read back exactly
    return best


# How far apart two computations of the same numbers may land when only their rounding differs: every
# comparison the notebooks and tests make across stages, kernels, dtypes or devices takes its tolerance here.

def eps(precision: str) -> float:
    """The gap between 1.0 and the next number in the training dtype."""
    import torch
    return torch.finfo(dtype(precision)).eps


def loss_tolerance(precision: str) -> float:
    """Two runs of the same math that only round differently (ZeRO stages, offload, reordered reductions),
    compared step by step, for a loss of a few nats: a loose bound, which catches a run that goes wrong (a lost
    update, a wrong gradient) but not a slow drift.

    fp32: 1e-5 (measured: at most 2.4e-7 between ZeRO stages 0-3 over 12 steps). 16-bit: 8 units of the dtype's
    epsilon (bf16 0.0625, fp16 0.0078). The loss itself is computed in fp32 (HF's loss upcasts the logits), so
    this is not the loss's own rounding: it is room for 16-bit weights whose updates round differently, which
    moves every later loss. Notebook 04 derives a per-step bound from the run's own progress
    (`tolerance_per_step`, its appendix), about 5x tighter at its last step."""
    return 1e-5 if precision == "fp32" else 2 * 4.0 * eps(precision)


def relative_loss_tolerance(precision: str) -> float:
    """Compiled vs eager training (inductor fuses operations, which round differently), as the largest relative
    loss difference over a run of ~100 steps: 1e-3 in fp32 (measured 1.9e-7 on a CPU the rule trains in fp32);
    in either 16-bit format 2**-5 = 0.031, four units of bf16's last place at 1.0 (measured 8.3e-4 in bf16)."""
    eps(precision)   # an unknown precision is refused
    return 1e-3 if precision == "fp32" else 4 * eps("bf16")


def logit_tolerance(precision: str) -> float:
    """The same weights in the same dtype on the same device, through two model objects (an engine and the
    model exported from its checkpoint): two units in the last place at |logit| < 16. Measured 0.0 on a CPU;
    on another device both must run there (a CPU and a GPU kernel round 16-bit sums differently)."""
    return 1e-5 if precision == "fp32" else 2 * 16 * eps(precision)


def repeat_tolerance(device: str, precision: str) -> float:
    """A run repeated from the same state (a resumed run against the straight one), compared step by step in
    loss: bitwise on a CPU, where every kernel is deterministic. On a GPU some backward kernels add in a varying
    order (attention's dQ: flash's and the memory-efficient SDPA's, which a T4 runs; atomics), so two runs from
    one state round apart at every step, as two ZeRO stages do: the precision's loss_tolerance (a fixed 1e-3 would
    not hold over 150 resumed bf16 steps). Derived by that analogy, not measured in fp16: the GPU kit's T4
    emulation keeps the memory-efficient kernel so that a loan measures it (benchmarks/gpu_plan.py)."""
    return 0.0 if device == "cpu" else loss_tolerance(precision)


def matmul_tflops(element_type, device: str, n: int = 1024, seconds: float = 0.5) -> float:
    """Measured dense matmul throughput (TFLOP/s) for one torch dtype: 2n^3 FLOPs per n x n product."""
    import torch
    a = torch.randn(n, n, device=device).to(element_type)
    b = torch.randn(n, n, device=device).to(element_type)

    def run(reps: int) -> float:
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()   # GPU work is asynchronous: wait before reading the clock
        return time.perf_counter() - start

    run(1)   # warm-up: the first call pays for kernel selection
    reps, elapsed = 1, 0.0
    while elapsed < seconds:   # double the work until the timing is long enough to trust
        reps *= 2
        elapsed = run(reps)
    return 2 * n**3 * reps / elapsed / 1e12


# Every rank program's --precision flag, and how its value becomes a precision (helpers.runtime.resolve_precision:
# "auto" is the one this machine's rule picks, which helpers.runtime.detect() knows).
AUTO = "auto"


def add_precision_flag(parser, default: str = AUTO, help: str | None = None) -> None:
    """The one --precision option of the rank programs: "auto" (the rule's pick, the default) or a precision's
    name; helpers.runtime.resolve_precision turns the parsed value into the precision to train in."""
    if default != AUTO:
        check_name(default)
    parser.add_argument("--precision", default=default, choices=(AUTO, *PRECISIONS),
                        help=help or f"the training precision; {AUTO}: the one this machine's rule picks")
