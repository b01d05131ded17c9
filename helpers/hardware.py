"""The GPUs the tutorial plans for (memory, compute capability, host RAM, peak throughput), for the planner,
the device matrix and the Colab estimate; `runtime_for` gives the `Runtime` detect() returns on one. No torch."""
from __future__ import annotations


# Memory as sold, in 10^9 bytes (formulas.GB). torch reports a little more (24.2 GB on an A10G or L4, 25.8 on an
# RTX 4090, all sold as 24 GB), which with what the driver reserves leaves a cautious margin. host_gb: RAM of the
# usual machine around the GPU where there is one (Colab's free T4 and its A100; the H200 machine this project is
# lent), None where it varies.
# peak_tflops: dense 16-bit tensor-core throughput from NVIDIA's data sheets (fp16 on Turing and Volta, bf16
# from Ampere), None where not given here.
GPUS = {
    "T4": {"memory_gb": 16, "capability": (7, 5), "arch": "Turing", "host_gb": 12.7, "peak_tflops": 65},
    "V100 32GB": {"memory_gb": 32, "capability": (7, 0), "arch": "Volta", "host_gb": None, "peak_tflops": 125},
    "A10G": {"memory_gb": 24, "capability": (8, 6), "arch": "Ampere", "host_gb": None, "peak_tflops": None},
    "L4": {"memory_gb": 24, "capability": (8, 9), "arch": "Ada", "host_gb": None, "peak_tflops": 121},
    "A100 40GB": {"memory_gb": 40, "capability": (8, 0), "arch": "Ampere", "host_gb": 83.5, "peak_tflops": 312},
    "A100 80GB": {"memory_gb": 80, "capability": (8, 0), "arch": "Ampere", "host_gb": None, "peak_tflops": 312},
    "H100 80GB": {"memory_gb": 80, "capability": (9, 0), "arch": "Hopper", "host_gb": None, "peak_tflops": 989},
    "H200": {"memory_gb": 141, "capability": (9, 0), "arch": "Hopper", "host_gb": 137, "peak_tflops": 989},
}
# The GPUs the device matrix builds every notebook's, program's and GPU script's configs for.
MATRIX_GPUS = ("T4", "A100 40GB", "H200")


def runtime_for(gpu: str):
    """What helpers.runtime.detect() returns on one of GPUS (memory as sold, a little under what torch reports)."""
    from .precision import choose_precision
    from .runtime import Runtime
    spec = GPUS[gpu]
    precision, reason = choose_precision(spec["capability"])
    return Runtime("cuda", f"NVIDIA {gpu}", spec["capability"], spec["memory_gb"], precision, reason)


def gpu_named(name: str) -> str:
    """A GPUS key from a name or its start, as a command line gives it: "H100" -> "H100 80GB" (the first in GPUS
    order where several match); a name that matches none ends the command, listing what there is."""
    if name in GPUS:
        return name
    matches = [g for g in GPUS if g.lower().startswith(name.lower())]
    if not matches:
        raise SystemExit(f"--gpu {name!r}: not one of {', '.join(GPUS)}")
    return matches[0]
