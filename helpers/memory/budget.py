"""Will this run fit? Its memory estimated before anything is built, by the formulas notebooks 04-05 teach
(model states by ZeRO stage and offload, one micro-batch's activations, the data), against what is free:
host RAM on a CPU (shared by this machine's ranks), the GPU's free memory on a GPU. A run that cannot fit
is refused with the numbers and the fix, instead of swapping or dying minutes later; one that comes close
is warned about.
"""
from __future__ import annotations

import warnings

from ..config import micro_batch_of, zero_stage_of
from ..errors import CostWarning, InputError
from ..precision import ELEMENT_BYTES, precision_of
from .formulas import GB, activation_bytes
from .planner import OVERHEAD_GB, model_state_bytes

# What a process needs besides the formulas' tensors: on a GPU the CUDA context and workspaces (the planner's
# figure); on a CPU the engine's own buffers and allocator slack (measured 0.08-0.15 GB for the tiny model here).
OVERHEAD = {"cpu": 0.2 * GB, "cuda": OVERHEAD_GB * GB}
CLOSE = 0.8   # warn above this share of the free memory: allocator slack and fragmentation are not counted
DATA_BYTES_PER_TOKEN = 8 * 3   # int64 ids in the token table, the torch tensors made from it, and a copy


def offload_of(config: dict) -> str:
    """The planner's name for where the config puts the states. An offload block with device "none" moves nothing;
    parameters offloaded alone are counted as the planner's optimizer+params (it has no parameters-only plan)."""
    zero = config.get("zero_optimization") or {}
    moved = {k for k in ("offload_optimizer", "offload_param") if (zero.get(k) or {}).get("device", "none") != "none"}
    return "optimizer+params" if "offload_param" in moved else "optimizer" if moved else "none"


def run_bytes(config: dict, model_size: str, n_positions: int, seq_len: int, vocab_size: int, world_size: int = 1,
              checkpointing: bool = False, data_tokens: int = 0) -> dict:
    """Bytes per rank of a run of the tutorial's GPT-2: on the device (model states there, activations) and on
    the host (offloaded states, the data); the parameter count they follow from."""
    from ..model import MODEL_SIZES, gpt2_param_count
    n_layer, hidden, heads = MODEL_SIZES[model_size]
    n_params = gpt2_param_count(vocab_size, n_positions, n_layer, hidden)
    precision = precision_of(config)
    states = model_state_bytes(n_params, world_size, zero_stage_of(config), offload_of(config), precision)
    act = activation_bytes(seq_len, micro_batch_of(config, world_size), hidden, heads, n_layer, vocab_size,
                           ELEMENT_BYTES[precision], checkpointing)["total"]
    return {"params": n_params, "model_states": states["gpu"], "activations": act,
            "host": states["cpu"] / world_size + data_tokens * DATA_BYTES_PER_TOKEN,
            "device": states["gpu"] + act}


def free_bytes(device: str) -> int:
    if device == "cpu":
        import psutil
        return psutil.virtual_memory().available
    import os
    import torch
    # This rank's GPU: before the engine exists torch's current device is still GPU 0 on every rank.
    return torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[0]


def check_fits(need: dict, device: str, local_ranks: int = 1, what: str = "this run") -> None:
    """Refuse (InputError) when `need` (run_bytes) exceeds the free memory, warn when it comes within CLOSE of
    it: the GPU's for its one rank, and host RAM for this machine's ranks' host bytes (offloaded states, data),
    which on a CPU are the same RAM as the device's."""
    host = (need["host"] + (need["device"] + OVERHEAD["cpu"] if device == "cpu" else 0)) * local_ranks
    places = {"RAM": (host, free_bytes("cpu"))}
    if device != "cpu":
        places["GPU memory"] = (need["device"] + OVERHEAD[device], free_bytes(device))
    detail = (f"{need['model_states'] / GB:.2f} GB model states + {need['activations'] / GB:.2f} GB activations"
              f" + {need['host'] / GB:.2f} GB host + {OVERHEAD[device] / GB:.1f} GB overhead per rank"
              + (f", {local_ranks} ranks on this machine" if local_ranks > 1 else ""))
    for place, (total, free) in places.items():
        message = (f"{what} needs about {total / GB:.1f} GB of {place} ({detail}; {need['params']:,} parameters) and "
                   f"{free / GB:.1f} GB of {place} is free")
        if total > free:
            raise InputError(f"{message}: use a shorter sequence length, a smaller micro-batch or model size, "
                             "gradient checkpointing, or a higher ZeRO stage / offload on more ranks")
        if total > CLOSE * free:
            warnings.warn(f"{message}: close to the limit; it may swap or be killed", CostWarning, stacklevel=3)
