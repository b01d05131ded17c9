"""Where DeepSpeed 0.19 keeps the fp32 master copy of a 16-bit weight, the tensor its optimizer really
steps: which object holds it depends on the wrapper `deepspeed.initialize` put around the optimizer
(notebook 01's table: ZeRO 1-3 partitions, BF16_Optimizer, FP16_Optimizer, FP16_UnfusedOptimizer, none in fp32).
"""
from __future__ import annotations

import torch


def master_weight_pairs(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fp32 master, 16-bit weight) pairs of DeepSpeed's ZeRO-0 mixed-precision wrappers; FP16_Optimizer's
    are its flat group buffers (the weights are views into the 16-bit one). Empty for any other optimizer."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    if isinstance(optimizer, FP16_UnfusedOptimizer):
        return [(m, w) for ms, ws in zip(optimizer.fp32_groups, optimizer.fp16_groups) for m, w in zip(ms, ws)]
    if isinstance(optimizer, FP16_Optimizer):
        return list(zip(optimizer.fp32_groups_flat, optimizer.fp16_groups_flat))
    return []


def fp32_master(optimizer, param: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 tensor DeepSpeed's `optimizer` (engine.optimizer) steps for `param`, shaped like it.

    fp32 training has no master: the weight itself is returned. A 16-bit weight whose master cannot be
    found raises (returning the weight would pass a rounded value off as the master)."""
    from deepspeed.utils import safe_get_full_fp32_param
    master = safe_get_full_fp32_param(param)   # ZeRO 1-3 and BF16_Optimizer link each weight to its master
    if master is not None:
        return master
    for master, weight in master_weight_pairs(optimizer):
        if weight is param:
            return master
        # FP16_Optimizer: the weight is a view into its group's flat 16-bit buffer, the master the same slice
        offset = (param.data_ptr() - weight.data_ptr()) // param.element_size()
        if param.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() and 0 <= offset < weight.numel():
            return master[offset:offset + param.numel()].view_as(param)
    if param.dtype == torch.float32:
        return param
    raise LookupError(f"no fp32 master for a {param.dtype} parameter of shape {tuple(param.shape)} in "
                      f"{type(optimizer).__name__}: is it a parameter of this engine's model, and trainable?")
