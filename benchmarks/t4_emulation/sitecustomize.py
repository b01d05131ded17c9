"""A T4 (Turing, sm_75, 16 GB, no bf16) as far as the tutorial can tell, on a bigger GPU: every Python process
started with this folder first on PYTHONPATH imports it at start-up (`python -m benchmarks.gpu` does so for its
T4 emulation lane; no shipped helper knows about it):

    PYTHONPATH=benchmarks/t4_emulation python -c "import torch; print(torch.cuda.get_device_capability())"  # (7, 5)

What the tutorial reads, answered as on a T4: torch.cuda.get_device_capability -> (7, 5), get_device_properties
(major 7, minor 5, a T4's total memory, name "Tesla T4 (emulated)"), get_device_name, is_bf16_supported -> False,
mem_get_info (free and total within the T4's memory). What the process can do, limited as on a T4: the caching
allocator capped at a T4's memory (set_per_process_memory_fraction, when CUDA starts: a process that never
touches the GPU, a rank program on the CPU, creates no CUDA context for it), and the SDPA kernels a T4 lacks
switched off: flash attention and cuDNN attention (both sm_80 or newer: torch's own tests gate them on
SM80OrLater, torch/testing/_internal/common_cuda.py). A T4 keeps the memory-efficient kernel (any CUDA GPU there;
its backward is not deterministic) and the math one, so those stay on: scaled_dot_product_attention picks among
them as on a T4.
Not emulated: Turing's kernels and speed (the real GPU's run), Triton on sm_75. The answers hold without a GPU
too, so a test can check them on a CPU; what needs CUDA (the memory cap) applies only where CUDA starts.
"""
import os
import sys
import types

T4_CAPABILITY = (7, 5)
T4_TOTAL_MEMORY = 15_835_660_288   # bytes, as torch reports a T4 (16 GB sold, less what the driver keeps)
T4_NAME = "Tesla T4 (emulated)"


def _patch_torch():
    import torch
    cuda = torch.cuda
    real_properties, real_mem_get_info = cuda.get_device_properties, cuda.mem_get_info

    def get_device_properties(device=None):
        real = real_properties(device if device is not None else cuda.current_device()) if cuda.is_available() else None
        fields = {k: getattr(real, k) for k in dir(real) if not k.startswith("_")} if real is not None else {}
        return types.SimpleNamespace(**{**fields, "name": T4_NAME, "major": T4_CAPABILITY[0],
                                        "minor": T4_CAPABILITY[1], "total_memory": T4_TOTAL_MEMORY})

    def mem_get_info(device=None):
        free, _ = real_mem_get_info(device)
        used_here = cuda.memory_reserved(device)   # the cap counts this process's allocations, not the others'
        return min(free, max(T4_TOTAL_MEMORY - used_here, 0)), T4_TOTAL_MEMORY

    def cap_memory():   # runs when CUDA starts in this process (torch.cuda._lazy_call)
        cuda.set_per_process_memory_fraction(min(1.0, T4_TOTAL_MEMORY / real_properties(0).total_memory))

    cuda.get_device_capability = lambda device=None: T4_CAPABILITY
    cuda.get_device_properties = get_device_properties
    cuda.get_device_name = lambda device=None: T4_NAME
    cuda.is_bf16_supported = lambda including_emulation=True: False
    cuda.mem_get_info = mem_get_info
    torch.backends.cuda.enable_flash_sdp(False)   # sm_80+
    torch.backends.cuda.enable_cudnn_sdp(False)   # sm_80+ (and cuDNN 9)
    cuda._lazy_call(cap_memory)


def _chain():
    """Run the sitecustomize this one hides, if the interpreter has one further down sys.path."""
    from importlib.machinery import PathFinder
    here = os.path.dirname(os.path.abspath(__file__))
    spec = PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != here])
    if spec and spec.loader:
        spec.loader.exec_module(types.ModuleType("_sitecustomize_below"))


os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "7.5+PTX")   # DeepSpeed's JIT builds for the T4, run as PTX here
_patch_torch()
_chain()
