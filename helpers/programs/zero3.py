"""ZeRO-3 in practice (notebook 08): build a model already partitioned, reach a partitioned weight, save one
whole 16-bit model, and see which of ZeRO-3's knobs moves what.

    torchrun --nproc_per_node 2 -m helpers.programs.zero3 --out runs/zero3 --knobs defaults persist_none few_live

Each rank builds the model inside `deepspeed.zero.Init`: every module's weights are cut into N partitions as
soon as the module is built, so no rank ever holds the whole model. `GatheredParameters` brings a weight back
whole for a moment (to read it, or to change it on one rank and partition the change). Then, once per knob
setting (`KNOBS` below: only the zero_optimization keys change), the program trains --steps steps from the same
weights and records what stayed whole, what was gathered and sent, and the losses; after the first, it saves
the model twice: a 16-bit copy gathered into one file (`save_16bit_model`) and a ZeRO checkpoint (for
`zero_to_fp32`). It also records the tensor bytes each rank allocated building the model inside zero.Init, and
building it whole the ordinary way, for contrast (`allocated_peak`: the most at once, and what is still held at the end).
"""
import argparse
import shutil
import time
from pathlib import Path

import torch._dynamo  # noqa: F401  before zero.Init patches torch.Tensor.__new__: dynamo's first import checks it
import deepspeed
import torch
from deepspeed.comm import comms_logger
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers.initialization import no_init_weights
from transformers.integrations.deepspeed import initialize_weights_zero3

from helpers import comms
from helpers.batches import ResumableBatches
from helpers.config import build_config, validate
from helpers.data import SyntheticTextDataset
from helpers.errors import integer, number
from helpers.launch import save_config, write_result
from helpers.memory.measured import allocated_peak
from helpers.model import MODEL_SIZES, build_model
from helpers.precision import add_precision_flag
from helpers.runtime import detect, rank_process, resolve_precision

# ZeRO-3's knobs, one setting per run. DeepSpeed's defaults are sized for billions of parameters: a weight under
# 1e5 elements stays whole on every rank, and up to 1e9 gathered elements stay alive between uses, so a small
# model is never released once gathered. The other settings scale them to this model.
KNOBS = {
    "defaults": {},
    "persist_none": {"stage3_param_persistence_threshold": 0},        # partition every weight, small ones too
    "few_live": {"stage3_param_persistence_threshold": 0,             # ... and release each weight after use:
                 "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0},   # gather it again for backward
    "no_prefetch": {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0},
    "small_buckets": {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 50_000},
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--knobs", nargs="+", default=["defaults"], choices=list(KNOBS), help="settings, one run each")
    p.add_argument("--steps", type=integer(1), default=4)
    p.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
    p.add_argument("--vocab", type=integer(2), default=4096, help="the model's vocabulary (>= the data's)")
    p.add_argument("--seq-len", type=integer(2), default=64)
    p.add_argument("--micro-batch", type=integer(1), default=2)
    p.add_argument("--lr", type=number(), default=1e-3)
    add_precision_flag(p)
    p.add_argument("--seed", type=integer(0), default=0)
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    with rank_process() as world:   # quiet logs, the launcher's group; at the end a barrier and the group's end
        precision = resolve_precision(a.precision)
        data = SyntheticTextDataset("markov", n_samples=256, seq_len=a.seq_len, seed=a.seed)
        if a.vocab < data.vocab_size:
            raise ValueError(f"--vocab {a.vocab} is smaller than the data's {data.vocab_size} tokens: "
                             f"use --vocab >= {data.vocab_size}")
        runs = []
        for name in a.knobs:
            config = zero3_config(a, precision, world, KNOBS[name])
            save_config(a.out, name, config)
            model, built = build_partitioned(a, config)
            run = {"knobs": name, "config": config, **built, "held": partition_elements(model)}
            if not runs:
                run["gathered"] = gather_and_change(model)
            engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
            live = live_elements(engine.module)
            batches = ResumableBatches(data, a.micro_batch, a.seed, rank=torch.distributed.get_rank(), world_size=world)
            run.update(train(engine, batches, a.steps, live), held_after=partition_elements(engine.module))
            if not runs:
                run["saved"] = save_both(engine, Path(a.out))
            runs.append(run)
            engine.destroy()
        plain = plain_build(a)
        write_result(a.out, {"runs": runs, "plain_build_bytes": plain, "world_size": world, "precision": precision,
                             "vocab_size": a.vocab, "data_vocab_size": data.vocab_size, "seq_len": a.seq_len,
                             "model_size": a.model_size, "micro_batch": a.micro_batch})


def zero3_config(a, precision: str, world: int, knobs: dict) -> dict:
    config = build_config(micro_batch=a.micro_batch, world_size=world, zero_stage=3, precision=precision, lr=a.lr,
                          warmup_steps=1, total_steps=2 * a.steps, torch_adam=True, device=detect().device,
                          zero_extra={**knobs,
                                      # save_16bit_model writes nothing at ZeRO-3 unless told to gather the weights
                                      "stage3_gather_16bit_weights_on_model_save": True})
    config["comms_logger"] = comms.LOGGER_BLOCK   # DeepSpeed's comms logger: record every collective
    return validate(config, device=detect().device, world_size=world)


def build_partitioned(a, config: dict):
    """The model built inside zero.Init, its weights initialised as HF initialises GPT-2 (the embedding's
    standard deviation recorded, to check it), and the tensor bytes the build inside zero.Init allocated."""
    # HF's weight init would run on empty partitions inside zero.Init and set nothing: skip it here, then run
    # transformers' ZeRO-3 variant, which gathers one module at a time and keeps rank 0's values. (This is what
    # transformers' from_config does by itself while an HfDeepSpeedConfig of a ZeRO-3 config is alive.)
    with allocated_peak(detect().device) as build, no_init_weights(), deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model(a.vocab, a.seq_len, a.model_size, seed=a.seed)   # each module partitioned once built
    torch.manual_seed(a.seed)
    initialize_weights_zero3(model)
    model.tie_weights()   # GPT-2's LM head is its embedding: no_init_weights left them untied
    return model, {"wte_std": gathered_std(model.transformer.wte.weight), "init_std": model.config.initializer_range,
                   "build_bytes": build}   # tensor bytes allocated inside zero.Init: the most at once, and held at its end


def plain_build(a) -> dict:
    """Bytes allocated building the same model the ordinary way, whole, on this rank's device: for contrast."""
    with torch.device(detect().device), allocated_peak(detect().device) as build:   # zero.Init builds there too
        model = build_model(a.vocab, a.seq_len, a.model_size, seed=a.seed)
    del model
    return build


def gathered_std(weight) -> float:
    with deepspeed.zero.GatheredParameters(weight):   # whole on every rank inside, partitioned again after
        return weight.float().std().item()


def partition_elements(model) -> dict:
    """What this rank holds of the model now: its partitions (ds_tensor), the weights whole on every rank
    (`persistent`: under the persistence threshold), and the whole model's size, in elements."""
    params = list(model.parameters())
    return {"partition": sum(p.ds_tensor.numel() for p in params),
            "persistent": sum(p.ds_numel for p in params if p.ds_persist),
            "whole": sum(p.ds_numel for p in params),
            "largest_weight": max(p.ds_numel for p in params),
            "element_bytes": params[0].ds_tensor.element_size()}


def by_hand(weight) -> torch.Tensor:
    """The whole weight from the ranks' partitions, without GatheredParameters: every rank's ds_tensor (padded
    to one length), concatenated in rank order, cut to the weight's size."""
    parts = [torch.empty_like(weight.ds_tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, weight.ds_tensor.data)
    return torch.cat(parts)[:weight.ds_numel].view(weight.ds_shape)


def gather_and_change(model) -> dict:
    """GatheredParameters, to read a weight and to change it: rank 0 sets token 0's embedding to 0.5 and
    DeepSpeed partitions the change out (modifier_rank=0) when the block ends; then it is put back."""
    wte = model.transformer.wte.weight
    with deepspeed.zero.GatheredParameters(wte):
        whole = wte.detach().clone()
    read_equal = torch.equal(whole, by_hand(wte))
    with deepspeed.zero.GatheredParameters(wte, modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            wte.data[0] = 0.5
    changed = by_hand(wte)
    with deepspeed.zero.GatheredParameters(wte, modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            wte.data.copy_(whole)   # the original weights back: every knob setting trains the same model
    return {"shape": list(whole.shape), "read_equal_to_partitions": read_equal,
            "changed_row_is_half": bool((changed[0] == 0.5).all()), "other_rows_kept": torch.equal(changed[1:], whole[1:]),
            "restored": torch.equal(by_hand(wte), whole)}


def live_elements(model) -> dict:
    """Count, at every module's forward (hooks after DeepSpeed's own, which gather the module's weights), the
    elements whole on this rank: the peak is what ZeRO-3's knobs bound."""
    params, seen = list(model.parameters()), {"peak": 0}

    def sample(*_):
        seen["peak"] = max(seen["peak"], sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.AVAILABLE))

    for module in model.modules():
        module.register_forward_pre_hook(sample)
        module.register_forward_hook(sample)
    return seen


def train(engine, batches, steps: int, live: dict) -> dict:
    """`steps` steps; per step the loss, the seconds, the peak of whole elements (forward and after backward)
    and the collectives logged."""
    history = {"losses": [], "seconds": [], "live_peak": [], "comm": []}
    for _ in range(steps):
        live["peak"] = 0
        comms_logger.reset_data()
        start = time.perf_counter()
        ids = batches.next().to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        live_after_backward = sum(p.ds_numel for p in engine.module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE)
        engine.step()
        history["seconds"].append(time.perf_counter() - start)
        history["losses"].append(loss.item())
        history["live_peak"].append(max(live["peak"], live_after_backward))
        history["comm"].append(comms.logged())
    return history


def save_both(engine, out: Path) -> dict:
    """One whole 16-bit model file (gathered from every rank's partitions) and the ZeRO checkpoint (each rank
    its own partitions: zero_to_fp32 consolidates them later, offline)."""
    if torch.distributed.get_rank() == 0:   # an earlier run's files must not pass for this run's
        for folder in ("16bit", "checkpoint"):
            shutil.rmtree(out / folder, ignore_errors=True)
    torch.distributed.barrier()
    engine.save_16bit_model(out / "16bit")   # every rank must call it: they all send their partitions
    engine.save_checkpoint(out / "checkpoint", tag="final")
    return {"16bit": str(out / "16bit" / "pytorch_model.bin"), "checkpoint": str(out / "checkpoint")}


if __name__ == "__main__":
    main()
