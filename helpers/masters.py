"""Where DeepSpeed 0.19 keeps the fp32 master copy of a 16-bit weight: the tensor its optimizer really steps.

Mixed precision trains a 16-bit model but updates fp32 copies of its weights (Micikevicius et al. 2018).
Which object holds them depends on the wrapper `deepspeed.initialize` put around the optimizer:

| wrapper (engine.optimizer)  | when                                  | fp32 masters                                  |
|-----------------------------|---------------------------------------|-----------------------------------------------|
| DeepSpeedZeroOptimizer(_Stage3) | ZeRO 1-3                          | partitioned: `safe_get_full_fp32_param` gathers one |
| BF16_Optimizer              | bf16 under the pipeline engine, or at ZeRO 1 with `grad_accum_dtype` fp32 | linked to each weight: `safe_get_full_fp32_param` |
| FP16_Optimizer              | fp16/bf16 at ZeRO 0 with FusedAdam (a GPU's default) | one flat fp32 tensor per param group, `fp32_groups_flat` |
| FP16_UnfusedOptimizer       | fp16/bf16 at ZeRO 0 with another optimizer (torch's AdamW) | one fp32 tensor per weight, `fp32_groups` |
| the torch optimizer itself  | fp32                                  | none: the weight is stepped in place          |
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
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.utils import safe_get_full_fp32_param
    master = safe_get_full_fp32_param(param)   # ZeRO 1-3 and BF16_Optimizer link each weight to its master
    if master is not None:
        return master
    if isinstance(optimizer, FP16_UnfusedOptimizer):
        for masters, weights in zip(optimizer.fp32_groups, optimizer.fp16_groups):
            for m, w in zip(masters, weights):
                if w is param:
                    return m
    if isinstance(optimizer, FP16_Optimizer):
        for flat, weights in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups):
            offset = 0
            for w in weights:   # the group's weights lie back to back in the flat buffer, in this order
                if w is param:
                    return flat[offset:offset + w.numel()].view_as(w)
                offset += w.numel()
    if param.dtype == torch.float32:
        return param
    raise LookupError(f"no fp32 master for a {param.dtype} parameter of shape {tuple(param.shape)} in "
                      f"{type(optimizer).__name__}: is it a parameter of this engine's model, and trainable?")
