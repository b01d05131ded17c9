"""Dynamic loss scaling for fp16 training, measured step by step (notebook 06).

fp16 holds numbers up to 65504 and loses anything below about 6e-8, so small gradients vanish. The
fix: multiply the loss by a large scale S before backward (every gradient is then S times larger),
divide the gradients by S before the optimizer step. Too large an S makes a gradient overflow to
inf/NaN; then the step is skipped and S shrinks. DeepSpeed's `DynamicLossScaler` applies the rule:

- overflow: skip the step; if the hysteresis budget is used up, halve S (never below min_scale),
  otherwise spend one unit of hysteresis and keep S;
- no overflow: once `scale_window` clean steps have passed since the last overflow, double S
  (and refill the hysteresis budget); then again after every further `scale_window` clean steps.

Two ways to watch it:
- `train_fp16_on_cpu`: a CPU cannot run DeepSpeed's fp16 engine (DeepSpeed refuses fp16 there), so
  this drives DeepSpeed's own `DynamicLossScaler` and overflow check (`CheckOverflow`, the one its
  fp16 optimizer uses) from a small mixed-precision loop: a real fp16 GPT-2, fp32 master weights.
- `train_fp16_engine`: on a CUDA GPU, the real DeepSpeed fp16 engine; the scale is read from its
  optimizer and the skipped steps from the engine.
`expected_scales` replays the rule independently, so a check can assert DeepSpeed followed it.
"""
from __future__ import annotations

from itertools import pairwise

import torch

from .batches import ResumableBatches
from .data import SyntheticTextDataset
from .runtime import init_single_process, quiet_deepspeed, seed_everything
from .model import build_model

CPU_KIND = ("CPU: DeepSpeed's DynamicLossScaler and CheckOverflow driving a mixed-precision loop "
            "(fp16 model, fp32 master weights); real fp16 gradients, real overflows")
ENGINE_KIND = "GPU: DeepSpeed fp16 engine; scale read from engine.optimizer, skipped steps from the engine"


def check_scaler_args(init_scale: float, scale_window: int, min_scale: float, hysteresis: int) -> None:
    """Clear errors for settings DeepSpeed would accept and then misbehave on."""
    if not scale_window >= 1:
        raise ValueError(f"scale_window={scale_window} must be >= 1 (clean steps before the scale grows)")
    if not hysteresis >= 1:
        raise ValueError(f"hysteresis={hysteresis} must be >= 1 (1 = halve on every overflow)")
    if not 0 < min_scale <= init_scale:
        raise ValueError(f"need 0 < min_scale ({min_scale}) <= init_scale ({init_scale})")


def make_scaler(init_scale: float = 2.0**24, scale_window: int = 10, min_scale: float = 1.0,
                hysteresis: int = 2, consecutive_hysteresis: bool = False):
    """DeepSpeed's DynamicLossScaler with the fp16 config's meaning of each knob.

    hysteresis is DeepSpeed's fp16 `hysteresis` (`delayed_shift` in the scaler): how many overflows
    in a row it takes before the scale is halved.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    check_scaler_args(init_scale, scale_window, min_scale, hysteresis)
    return DynamicLossScaler(init_scale=init_scale, scale_window=scale_window, min_scale=min_scale,
                             delayed_shift=hysteresis, consecutive_hysteresis=consecutive_hysteresis)


def expected_scales(overflows: list[bool], init_scale: float, scale_window: int, min_scale: float = 1.0,
                    hysteresis: int = 1, consecutive_hysteresis: bool = False) -> list[float]:
    """The scale each step should have used, given which steps overflowed (the rule in the module doc).

    Written from the rule, not from DeepSpeed's code. Counting detail: DeepSpeed does not count the
    first clean step after an overflow (its `stable_interval` is steps since the overflow minus one),
    so the first doubling comes on the (scale_window + 1)-th clean step, later ones every window.
    """
    scale, budget, clean = float(init_scale), hysteresis, 0   # start behaves like an overflow just before
    used = []
    for overflow in overflows:
        used.append(scale)
        if overflow:
            clean = 0
            if budget > 1:
                budget -= 1            # absorb this overflow, keep the scale
            else:
                scale = max(scale / 2, min_scale)
            continue
        clean += 1
        if consecutive_hysteresis:
            budget = hysteresis        # any clean step refills the budget
        if clean > 1 and (clean - 1) % scale_window == 0:
            scale *= 2
            budget = hysteresis
    return used


def _mixed_precision_model(vocab_size: int, seq_len: int, model_size: str, seed: int, lr: float):
    """An fp16 copy of the model that runs forward/backward, and fp32 master weights the optimizer updates."""
    model = build_model(vocab_size, seq_len, model_size, seed=seed).half()
    fp16_params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in fp16_params]
    return model, fp16_params, master, torch.optim.AdamW(master, lr=lr)


def _history_row(step: int, scale: float, overflow: bool, skipped: int, loss: float, lr: float,
                 update_norm: float) -> dict:
    return {"step": step, "scale": float(scale), "overflow": bool(overflow), "skipped_steps": skipped,
            "loss": loss, "lr": lr, "update_norm": update_norm}


def _flat(params) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector([p.detach().float() for p in params])


def train_fp16_on_cpu(steps: int = 50, init_scale: float = 2.0**24, scale_window: int = 10,
                      hysteresis: int = 2, consecutive_hysteresis: bool = False, min_scale: float = 1.0,
                      micro_batch: int = 4, seq_len: int = 32, model_size: str = "tiny", lr: float = 3e-3,
                      grad_clip: float = 1.0, seed: int = 0) -> dict:
    """Train a GPT-2 in real fp16 on the CPU with DeepSpeed's DynamicLossScaler deciding every step.

    Each step: fp16 forward, backward of loss x scale into fp16 gradients, DeepSpeed's CheckOverflow
    on those gradients; on overflow the step is skipped, else gradients are unscaled into the fp32
    master weights, clipped, stepped and copied back to fp16. Then `scaler.update_scale(overflow)`.
    The initial scale is deliberately too large so that real overflows happen.
    Returns {"kind", "settings", "history": [{"step", "scale" (used this step), "overflow",
    "skipped_steps" (so far), "loss", "lr", "update_norm" (how far the fp32 weights moved)}], "final_scale"}.
    """
    from deepspeed.runtime.utils import CheckOverflow
    init_single_process()          # the scaler asks deepspeed.comm for the rank when it logs an overflow
    quiet_deepspeed()
    seed_everything(seed)
    scaler = make_scaler(init_scale, scale_window, min_scale, hysteresis, consecutive_hysteresis)
    data = SyntheticTextDataset("markov", n_samples=steps * micro_batch, seq_len=seq_len, seed=seed)
    batches = ResumableBatches(data, micro_batch, seed)
    model, fp16_params, master, optimizer = _mixed_precision_model(data.vocab_size, seq_len, model_size, seed, lr)
    checker = CheckOverflow([fp16_params])
    history, skipped = [], 0
    for step in range(steps):
        ids = batches.next()
        scale, before = scaler.loss_scale, _flat(master)
        loss = model(input_ids=ids, labels=ids).loss
        (loss.float() * scale).backward()
        overflow = checker.has_overflow(fp16_params)
        grads_dtype = str(fp16_params[0].grad.dtype)
        if overflow:
            skipped += 1
        else:
            _unscale_and_step(fp16_params, master, optimizer, scale, grad_clip)
        for p in fp16_params:
            p.grad = None
        scaler.update_scale(overflow)
        update = (_flat(master) - before).norm().item()   # measured: 0 exactly when the step was skipped
        history.append(_history_row(step + 1, scale, overflow, skipped, loss.item(), lr, update))
    settings = dict(init_scale=init_scale, scale_window=scale_window, min_scale=min_scale, hysteresis=hysteresis,
                    consecutive_hysteresis=consecutive_hysteresis, model_size=model_size,
                    micro_batch=micro_batch, seq_len=seq_len, lr=lr, params_dtype=str(fp16_params[0].dtype),
                    grads_dtype=grads_dtype, master_dtype=str(master[0].dtype))
    return {"kind": CPU_KIND, "settings": settings, "history": history, "final_scale": float(scaler.loss_scale)}


@torch.no_grad()
def _unscale_and_step(fp16_params, master, optimizer, scale: float, grad_clip: float) -> None:
    """What DeepSpeed's fp16 optimizer does on a clean step: fp32 grads / scale, clip, step, copy to fp16."""
    for p16, p32 in zip(fp16_params, master):
        p32.grad = p16.grad.float().div_(scale)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(master, grad_clip)
    optimizer.step()
    for p16, p32 in zip(fp16_params, master):
        p16.copy_(p32)


def fp16_engine_config(init_scale_power: int, scale_window: int, hysteresis: int, min_scale: float = 1,
                       consecutive_hysteresis: bool = False) -> dict:
    """The DeepSpeed `fp16` block for dynamic loss scaling (loss_scale 0 = dynamic)."""
    return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": init_scale_power,
                     "loss_scale_window": scale_window, "hysteresis": hysteresis,
                     "consecutive_hysteresis": consecutive_hysteresis, "min_loss_scale": min_scale}}


def engine_hysteresis(engine) -> int:
    """The hysteresis the engine's optimizer really applies.

    ZeRO 1-3 scale with DynamicLossScaler (hysteresis honoured). At ZeRO 0 the fp16 optimizers
    (FP16_Optimizer, FP16_UnfusedOptimizer) have their own `_update_scale`, which ignores
    `hysteresis` and halves on every overflow (deepspeed/runtime/fp16/fused_optimizer.py).
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return scaler.delayed_shift if isinstance(scaler, DynamicLossScaler) else 1


def train_fp16_engine(steps: int = 60, init_scale_power: int = 32, scale_window: int = 10, hysteresis: int = 2,
                      zero_stage: int = 1, micro_batch: int = 16, seq_len: int = 64, model_size: str = "tiny",
                      lr: float = 3e-3, seed: int = 0, output_dir=None) -> dict:
    """Train with DeepSpeed's real fp16 engine (CUDA only) and record the scale and skipped steps.

    The scale each step used is read from the engine's optimizer before the step
    (`engine.optimizer.loss_scale`: ZeRO 1-3 and both ZeRO-0 fp16 optimizers define it; ZeRO's
    `cur_scale` is the same value); skipped steps from `engine.skipped_steps`. An overflow is a step
    that raised the skipped count. "update_norm" is how far the fp16 weights moved; it is also 0 on
    the first clean steps, where DeepSpeed's WarmupDecayLR (warmup_min_lr 0) sets lr 0.
    Returns the same shape as `train_fp16_on_cpu`, plus "optimizer"
    (its class name) and "hysteresis_applied" (what `expected_scales` should be given).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("train_fp16_engine needs a CUDA GPU: DeepSpeed refuses fp16 on a CPU "
                           "('Type fp16 is not supported on your device'). On a CPU use train_fp16_on_cpu.")
    from .trainer import AdvancedDeepSpeedTrainer
    data = SyntheticTextDataset("markov", n_samples=max(steps * micro_batch, 256), seq_len=seq_len, seed=seed)
    trainer = AdvancedDeepSpeedTrainer(
        data, model_size=model_size, zero_stage=zero_stage, precision="fp16", micro_batch=micro_batch, lr=lr,
        warmup_steps=1, total_steps=steps, seed=seed, output_dir=output_dir, name="loss-scaling",
        config_extra=fp16_engine_config(init_scale_power, scale_window, hysteresis))
    engine, history = trainer.engine, []
    for _ in range(steps):
        scale, skipped_before = float(engine.optimizer.loss_scale), engine.skipped_steps
        before = _flat(engine.module.parameters())
        metrics = trainer.train_step()
        update = (_flat(engine.module.parameters()) - before).norm().item()
        history.append(_history_row(len(history) + 1, scale, engine.skipped_steps > skipped_before,
                                    engine.skipped_steps, metrics["loss"], metrics["lr"], update))
    settings = dict(init_scale=2.0**init_scale_power, scale_window=scale_window, min_scale=1.0,
                    hysteresis=hysteresis, consecutive_hysteresis=False, model_size=model_size,
                    micro_batch=micro_batch, seq_len=seq_len, lr=lr, zero_stage=zero_stage)
    result = {"kind": ENGINE_KIND, "settings": settings, "history": history,
              "final_scale": float(engine.optimizer.loss_scale), "optimizer": type(engine.optimizer).__name__,
              "hysteresis_applied": engine_hysteresis(engine)}
    engine.destroy()
    return result


def summarize(result: dict) -> dict:
    """The numbers a reader checks: overflows, skipped steps, halvings and doublings of the scale."""
    h = result["history"]
    scales = [r["scale"] for r in h] + [result["final_scale"]]
    ratios = [b / a for a, b in pairwise(scales)]
    return {"steps": len(h), "overflows": sum(r["overflow"] for r in h), "skipped_steps": h[-1]["skipped_steps"],
            "halvings": sum(r == 0.5 for r in ratios), "doublings": sum(r == 2.0 for r in ratios),
            "first_scale": scales[0], "final_scale": scales[-1],
            "first_loss": h[0]["loss"], "final_loss": h[-1]["loss"]}


def follows_rule(result: dict, hysteresis: int | None = None) -> bool:
    """True if every scale in `result` equals what `expected_scales` derives from its overflows."""
    s = result["settings"]
    hyst = hysteresis if hysteresis is not None else result.get("hysteresis_applied", s["hysteresis"])
    overflows = [r["overflow"] for r in result["history"]]
    # One extra clean step: the scale it would use is the scale the run ended with.
    expected = expected_scales(overflows + [False], s["init_scale"], s["scale_window"], s["min_scale"], hyst,
                               s["consecutive_hysteresis"])
    return expected == [r["scale"] for r in result["history"]] + [result["final_scale"]]
