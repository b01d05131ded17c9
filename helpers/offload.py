"""ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training"): keep
the optimizer's fp32 master weights and Adam moments in host RAM and run Adam on the CPU
(DeepSpeed's vectorised `DeepSpeedCPUAdam`); with ZeRO-3, park the parameter partitions there too.

Each step the accelerator sends its gradient partition down to the host and gets the updated
parameters back, so device memory drops to the parameters (and, stage 1, gradients) at the price
of host traffic and a CPU optimizer step.

Where things live is read from the engine, not assumed: `split_by_side` counts the bytes DeepSpeed
keeps in its host-side structures (the CPU optimizer's master params, their gradients and its state;
ZeRO-3's offloaded parameter partitions) apart from everything else the rank holds, and reports the
devices those tensors are really on. On a GPU that is the device/host split; on a CPU-only machine
both sides are the same RAM and only the structure (and the step's extra copies) changes.
"""
from __future__ import annotations

import time
from pathlib import Path

from .memory import _tensors, held_bytes, measurement_zero_extra, storage_bytes

def cpu_adam_load() -> dict:
    """Load DeepSpeed's CPU Adam op, JIT-compiling it on first use; how long that took and whether
    the compiled library was already in the torch extensions cache."""
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from torch.utils.cpp_extension import _get_build_directory
    builder = CPUAdamBuilder()
    cached = (Path(_get_build_directory(builder.name, verbose=False)) / f"{builder.name}.so").is_file()
    start = time.perf_counter()
    builder.load(verbose=False)
    return {"op": builder.name, "seconds": time.perf_counter() - start, "was_cached": cached}


def host_side_tensors(engine) -> list:
    """The tensors DeepSpeed keeps on the offload device (host) for this engine's config."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    host = []
    if engine.zero_cpu_offload():   # the CPU optimizer works on host fp32 partitions
        masters = [p for g in inner.param_groups for p in g["params"]]
        masters += list(getattr(opt, "fp32_partitioned_groups_flat", []))
        host += [masters, [p.grad for p in masters], list(inner.state.values()),
                 # gradients land on the offload device: ZeRO-3's flat partition buffer, ZeRO-1/2's
                 # accumulation copies (both allocated on `opt.device`, the CPU, when offloading)
                 getattr(opt, "grad_partitions_flat_buffer", None), getattr(opt, "accumulated_grads_in_cpu", None)]
    if engine.zero_offload_param():   # ZeRO-3: each parameter's own partition
        host.append([getattr(p, "ds_tensor", None) for p in engine.module.parameters()])
    return list(_tensors(host))


def split_by_side(engine) -> dict:
    """Bytes held on the accelerator side vs the host (offload) side, and the tensor devices seen on each."""
    host = host_side_tensors(engine)
    host_ids = {(str(t.device), t.untyped_storage().data_ptr()) for t in host}
    total = sum(held_bytes(engine).values())
    host_bytes = storage_bytes(host)
    return {"accelerator_bytes": total - host_bytes, "host_bytes": host_bytes,
            "host_devices": sorted({t.device.type for t in host}),
            "host_storages": len(host_ids)}


def run_config(name: str, zero_optimization: dict, data, steps: int = 6, **trainer_args) -> dict:
    """Train the tiny model briefly with this `zero_optimization` block (offload blocks as written: offload
    needs ZeRO >= 1, parameter offload ZeRO-3); where its bytes live, its step times and losses."""
    from .trainer import AdvancedDeepSpeedTrainer
    from .model import gpt2_param_count, MODEL_SIZES
    n_layer, n_embd, _ = MODEL_SIZES["tiny"]
    n_params = gpt2_param_count(data.vocab_size, data.seq_len, n_layer, n_embd)
    block = {**measurement_zero_extra(n_params), **zero_optimization}
    trainer = AdvancedDeepSpeedTrainer(
        data, name=name, model_size="tiny", micro_batch=8, warmup_steps=2, total_steps=steps + 4,
        zero_stage=block.pop("stage"), offload_optimizer="offload_optimizer" in block,
        offload_param="offload_param" in block, zero_extra=block, **trainer_args)
    trainer.train(1, progress=False)       # Adam state exists after the first step
    sides = split_by_side(trainer.engine)  # what the rank holds between steps
    history = trainer.train(steps, progress=False)
    inner = getattr(trainer.engine.optimizer, "optimizer", trainer.engine.optimizer)
    result = {"name": name, "stage": trainer.config["zero_optimization"]["stage"], "n_params": n_params,
              "precision": trainer.precision, "zero_optimization": trainer.config["zero_optimization"],
              "optimizer": type(inner).__name__, **sides,
              "step_s": [m["step_s"] for m in history], "losses": [m["loss"] for m in trainer.history],
              "device": str(trainer.engine.device)}
    trainer.engine.destroy()
    return result


def compare(data, zero_blocks: dict[str, dict], steps: int = 6, output_dir=".") -> list[dict]:
    """`run_config` for each named `zero_optimization` block, same data, model and seed."""
    return [run_config(name, block, data, steps, output_dir=Path(output_dir) / f"offload{i}")
            for i, (name, block) in enumerate(zero_blocks.items())]


def rows(results: list[dict]) -> list[dict]:
    """A table: MB on each side, the optimizer that ran, median step time and its ratio to the first row."""
    def median(xs):
        return sorted(xs)[len(xs) // 2]
    base = median(results[0]["step_s"][1:])
    return [{"config": r["name"], "accelerator MB": r["accelerator_bytes"] / 1e6, "host MB": r["host_bytes"] / 1e6,
             "host tensors on": ",".join(r["host_devices"]) or "-", "optimizer": r["optimizer"],
             "step ms": 1e3 * median(r["step_s"][1:]), "time vs first": median(r["step_s"][1:]) / base,
             "final loss": r["losses"][-1]} for r in results]
