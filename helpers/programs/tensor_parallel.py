"""Tensor parallelism with DeepSpeed's AutoTP (notebook 07): one key in the config,
`"tensor_parallel": {"autotp_size": t}`, and `deepspeed.initialize` cuts the linear layers of an HF Llama
into t pieces, one per rank of a tensor-parallel group. The training loop does not change.

    torchrun --nproc_per_node 2 -m helpers.programs.tensor_parallel --out runs/tp --tp-size 2 --stages 1 2 3
    torchrun --nproc_per_node 4 -m helpers.programs.tensor_parallel --out runs/tp_dp --tp-size 2 --stages 1 2

N ranks with t = --tp-size make N / t data-parallel replicas of t ranks each. The t ranks of a replica must
see the same batch (AutoTP checks it on the first forward); replicas see different ones, as in plain data
parallelism, and ZeRO partitions over the replicas. For each ZeRO stage the program trains --steps steps
from the same initial weights, logging one step's collectives, saves a checkpoint halfway, and finally
loads that checkpoint into a fresh engine and trains the second half again. It records per rank: the
losses, which layers AutoTP replaced and their shapes here, the bytes of model states held, DeepSpeed's
process groups, and the logits of a probe batch beside the whole 16-bit model it exported.

The lesson is notebook 07's `autotp_minimal.py` (config, `deepspeed.initialize`, the loop); this program is that
loop with measurement attached: the comms logger, the checkpoint and resume, the export, the probes.
"""
import argparse
from pathlib import Path

import deepspeed
import torch
from deepspeed.comm import comms_logger
from deepspeed.module_inject.layers import GatherReplacedLayerParams
from deepspeed.utils import groups
from transformers import set_seed

from helpers import comms
from helpers.batches import ResumableBatches
from helpers.config import build_config, validate
from helpers.data import SyntheticTextDataset
from helpers.errors import integer, number
from helpers.launch import save_config, write_result
from helpers.memory.measured import held_bytes, measurement_zero_extra
from helpers.model import MODEL_SIZES, build_llama, llama_param_count
from helpers.precision import add_precision_flag
from helpers.runtime import detect, rank_process, resolve_precision


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tp-size", type=integer(1), default=2, help="ranks that split each linear layer (autotp_size)")
    p.add_argument("--stages", type=int, nargs="+", default=[1], choices=(0, 1, 2, 3), help="ZeRO stages, one after another")
    p.add_argument("--steps", type=integer(2, "a checkpoint is saved halfway"), default=8)
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES))
    p.add_argument("--seq-len", type=integer(2), default=32)
    p.add_argument("--micro-batch", type=integer(1), default=4, help="samples per replica per step")
    p.add_argument("--lr", type=number(), default=3e-3)
    add_precision_flag(p)
    p.add_argument("--seed", type=integer(0), default=0)
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    with rank_process() as world:   # quiet logs, the launcher's group; at the end a barrier and the group's end
        check_options(a, world)
        set_seed(a.seed)
        precision = resolve_precision(a.precision)
        data = SyntheticTextDataset("markov", n_samples=256, seq_len=a.seq_len, seed=a.seed)
        runs = [run_stage(a, stage, data, precision, world // a.tp_size) for stage in a.stages]
        write_result(a.out, {"runs": runs, "world_size": world, "tp_size": a.tp_size, "precision": precision,
                             "device": deepspeed.get_accelerator().device_name(),
                             "vocab_size": data.vocab_size, "seq_len": a.seq_len, "micro_batch": a.micro_batch,
                             "model_size": a.model_size})


def check_options(a, world_size: int) -> None:
    """ValueError, before any rank starts, for what DeepSpeed would refuse inside one."""
    if world_size % a.tp_size:
        raise ValueError(f"tp_size={a.tp_size} does not divide the {world_size} ranks: each data-parallel replica "
                         f"is a group of tp_size ranks; launch a multiple of {a.tp_size} ranks")
    n_head = MODEL_SIZES[a.model_size][2]
    if a.tp_size > n_head:
        raise ValueError(f"tp_size={a.tp_size} is more than the {n_head} attention heads of model size "
                         f"{a.model_size!r}: AutoTP hands out whole heads; use tp_size <= {n_head}")


def autotp_config(a, stage: int, precision: str, replicas: int, n_params: int) -> dict:
    """The run's DeepSpeed config: the tutorial's usual one plus the two keys of this lesson."""
    config = build_config(micro_batch=a.micro_batch, world_size=replicas, zero_stage=stage, precision=precision,
                          lr=a.lr, warmup_steps=2, total_steps=2 * a.steps, torch_adam=True, device=detect().device,
                          zero_extra=measurement_zero_extra(n_params))   # buckets of the model's size, not 5e8 elements
    config["tensor_parallel"] = {"autotp_size": a.tp_size}   # AutoTP: split the linears over tp_size ranks
    config["comms_logger"] = comms.LOGGER_BLOCK   # DeepSpeed's comms logger: record every collective
    # DeepSpeed 0.19 checks train_batch_size against every rank, tensor-parallel ones too (runtime/config.py
    # counts the whole world when given no mpu), though a group shares one batch: let it derive the number.
    del config["train_batch_size"]
    if stage == 3:   # ZeRO-3 writes a whole 16-bit model only when asked to gather it (save_16bit_model)
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return validate(config, device=detect().device, world_size=replicas)


def make_engine(a, config: dict, vocab_size: int):
    """A fresh Llama (same seed: same initial weights) and the engine AutoTP builds around it."""
    model = build_llama(vocab_size, a.seq_len, a.model_size, seed=a.seed)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def train(engine, batches: ResumableBatches, steps: int, history: dict) -> dict:
    """`steps` optimizer steps, each one's loss and gradient norm (DeepSpeed's, before clipping) added to `history`."""
    for _ in range(steps):
        ids = batches.next().to(engine.device)   # the same ids on every rank of a tensor-parallel group
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        history["losses"].append(loss.item())
        history["grad_norms"].append(float(engine.get_global_grad_norm()))
    return history


def replaced_layers(model) -> dict:
    """What AutoTP did to the model: each module it replaced, by name, with DeepSpeed's class for it and
    the weight shape this rank holds."""
    return {name: {"class": type(m).__name__, "shape": list(m.weight.shape)} for name, m in model.named_modules()
            if type(m).__module__ == "deepspeed.module_inject.layers"}


def process_groups(tp_size: int) -> dict:
    """This rank's groups, as DeepSpeed made them: the ranks that split its layers, and those it averages
    gradients with (with tp_size 1 DeepSpeed makes no tensor-parallel groups: every rank is a replica)."""
    rank, ranks = torch.distributed.get_rank(), torch.distributed.get_process_group_ranks
    if tp_size == 1:
        return {"tensor_parallel": [rank], "data_parallel": list(range(torch.distributed.get_world_size()))}
    return {"tensor_parallel": ranks(groups.get_tensor_model_parallel_group()),
            "data_parallel": ranks(groups.get_data_parallel_group())}


def export_whole(engine, folder: Path) -> dict:
    """The trained model as one whole 16-bit state dict, by DeepSpeed 0.19.8's public routes. At ZeRO-3,
    `save_16bit_model` gathers ZeRO's and AutoTP's partitions (engine.py `_zero3_consolidated_16bit_state_dict`,
    with `GatherReplacedLayerParams`). Below ZeRO-3 it saves `module_state_dict()`: this rank's shards of the split
    layers (their shapes are recorded to show it). So there each layer is gathered with
    `deepspeed.module_inject.layers.GatherReplacedLayerParams`, the loop the engine's private
    `_consolidated_16bit_state_dict` (`_replace_module_consolidated_state_dict`) runs. Every rank takes part."""
    engine.save_16bit_model(folder, "save_16bit_model.bin")
    written = folder / "save_16bit_model.bin"
    if not engine.zero_optimization_partition_weights():
        whole = {}
        for name, module in engine.module.named_modules():   # the same order on every rank: the gathers pair up
            params = list(module.parameters(recurse=False))
            with GatherReplacedLayerParams(params, module, enabled=engine.autotp_size() > 1):   # whole, inside the block
                whole.update({f"{name}.{key}".lstrip("."): p.detach().cpu().clone()
                              for key, p in module.named_parameters(recurse=False)})
        if torch.distributed.get_rank() == 0:
            torch.save(whole, folder / "whole.bin")
    torch.distributed.barrier()   # the files exist before any rank reads them
    saved = torch.load(written, map_location="cpu")   # what save_16bit_model wrote
    export = written if engine.zero_optimization_partition_weights() else folder / "whole.bin"
    return {"export": str(export), "save_16bit_model_head": list(saved["lm_head.weight"].shape)}


def run_stage(a, stage: int, data, precision: str, replicas: int) -> dict:
    n_params = llama_param_count(data.vocab_size, *MODEL_SIZES[a.model_size][:2])["total"]
    config = autotp_config(a, stage, precision, replicas, n_params)
    save_config(a.out, f"stage{stage}", config)
    engine = make_engine(a, config, data.vocab_size)
    my_groups = process_groups(a.tp_size)
    replica = my_groups["data_parallel"].index(torch.distributed.get_rank())   # which batches this rank draws
    batches = ResumableBatches(data, a.micro_batch, a.seed, rank=replica, world_size=replicas)
    checkpoints, half = Path(a.out) / f"stage{stage}-checkpoints", a.steps // 2
    history = train(engine, batches, half - 1, {"losses": [], "grad_norms": []})
    comms_logger.reset_data()   # one step's collectives, once the optimizer state exists
    train(engine, batches, 1, history)
    logged = comms.logged()
    engine.save_checkpoint(checkpoints, client_state={"batches": batches.state_dict()})
    train(engine, batches, a.steps - half, history)
    result = {"stage": stage, **history, "layers": replaced_layers(engine.module),
              "held_bytes": held_bytes(engine), "groups": my_groups, "comm_logged": logged, "config": config}
    probe = data[:2]["input_ids"].to(engine.device)   # for the exported model's check
    with torch.no_grad():
        probe_logits = engine(input_ids=probe).logits.float()
    result.update(probe_ids=probe.tolist(), probe_logits=probe_logits.tolist(),
                  **export_whole(engine, Path(a.out) / f"stage{stage}-16bit"))
    engine.destroy()
    resumed = make_engine(a, config, data.vocab_size)   # new model, new engine: only the checkpoint carries over
    _, client_state = resumed.load_checkpoint(checkpoints)
    batches = ResumableBatches(data, a.micro_batch, a.seed, rank=replica, world_size=replicas)
    batches.load_state_dict(client_state["batches"])
    result["resumed_losses"] = train(resumed, batches, a.steps - half, {"losses": [], "grad_norms": []})["losses"]
    resumed.destroy()
    return result


if __name__ == "__main__":
    main()
