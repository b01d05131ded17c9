"""Sequence parallelism, DeepSpeed-Ulysses (notebook 07): each rank of a sequence-parallel group holds s/p of
every sequence; around attention two all-to-alls trade the split, so that attention sees the whole
sequence for h/p of the heads. First `DistributedAttention` against full attention, then Arctic Long
Sequence Training (ALST) for an HF Llama: `UlyssesSPAttentionHF` swaps the model's attention,
`UlyssesSPDataLoaderAdapter` hands every rank its slice of each batch, and the loss is combined by hand.

    torchrun --nproc_per_node 2 -m helpers.programs.sequence_parallel --out runs/sp --sp-size 2 --stages 2 3
    torchrun --nproc_per_node 4 -m helpers.programs.sequence_parallel --out runs/sp_dp --sp-size 2 --stages 3

N ranks with p = --sp-size make N / p data-parallel replicas of p ranks each; ZeRO partitions over all N
(DeepSpeed averages gradients over the sequence-parallel ranks too: each computed them on part of the
sequences). Per ZeRO stage the program trains --steps steps from the same initial weights, logging one
step's collectives; with --lengths it also counts the activation bytes one forward saves for backward on
this rank, per sequence length.
"""
import argparse

import deepspeed
import torch
from deepspeed.comm import comms_logger
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from deepspeed.sequence.layer import DistributedAttention
from deepspeed.utils import groups
from transformers import set_seed

from helpers import comms
from helpers.batches import ResumableBatches
from helpers.config import build_config, validate
from helpers.data import SyntheticTextDataset
from helpers.errors import integer, number
from helpers.launch import save_config, write_result
from helpers.memory.measured import held_bytes, measurement_zero_extra, saved_for_backward, storage_bytes
from helpers.model import MODEL_SIZES, build_llama, llama_param_count
from helpers.precision import add_precision_flag
from helpers.runtime import detect, rank_process, resolve_precision


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--sp-size", type=integer(1), default=2, help="ranks that split each sequence (sequence_parallel_size)")
    p.add_argument("--stages", type=int, nargs="+", default=[2], choices=(0, 1, 2, 3), help="ZeRO stages, one after another")
    p.add_argument("--steps", type=integer(1), default=6)
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES))
    p.add_argument("--seq-len", type=integer(2), default=64)
    p.add_argument("--micro-batch", type=integer(1), default=1, help="sequences per replica per step")
    p.add_argument("--lengths", type=integer(2), nargs="*", default=[], help="sequence lengths to count activations at")
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
        attention = None
        # Ulysses for HF: swap the model's SDPA attention for Ulysses' (every model built from here on) and make the
        # sequence-parallel groups; the `mpu` it returns hands them to deepspeed.initialize. Once per process.
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=build_llama(data.vocab_size, a.seq_len, a.model_size), core_attn_implementation="sdpa",
            sequence_parallel_size=a.sp_size, micro_batch_size=a.micro_batch, seq_length_is_variable=True)
        if a.sp_size > 1:
            attention = attention_check(a, mpu.get_sequence_parallel_group())
        runs = [run_stage(a, stage, data, precision, mpu) for stage in a.stages]
        write_result(a.out, {"runs": runs, "attention_check": attention, "world_size": world, "sp_size": a.sp_size,
                             "device": deepspeed.get_accelerator().device_name(),
                             "precision": precision, "vocab_size": data.vocab_size, "seq_len": a.seq_len,
                             "micro_batch": a.micro_batch, "model_size": a.model_size, "lengths": a.lengths})


def check_options(a, world_size: int) -> None:
    """ValueError, before any rank starts, for what DeepSpeed would refuse inside one."""
    if world_size % a.sp_size:
        raise ValueError(f"sp_size={a.sp_size} does not divide the {world_size} ranks: each data-parallel replica "
                         f"is a group of sp_size ranks; launch a multiple of {a.sp_size} ranks")
    n_head = MODEL_SIZES[a.model_size][2]
    if n_head % a.sp_size:
        raise ValueError(f"sp_size={a.sp_size} does not divide the {n_head} attention heads of model size "
                         f"{a.model_size!r}: Ulysses gives each rank whole heads; use a divisor of {n_head}")
    if a.steps % a.sp_size:
        raise ValueError(f"steps={a.steps} is not a multiple of sp_size={a.sp_size}: each rank of a group supplies "
                         "every p-th batch to the data-loader adapter, which waits for all of them; use a multiple")
    for length in [a.seq_len, *a.lengths]:
        if length % a.sp_size:
            raise ValueError(f"sequence length {length} is not divisible by sp_size={a.sp_size}: each rank "
                             "holds an equal slice; use multiples of sp_size")


# ---- DistributedAttention: the two all-to-alls around any attention ----

def attention_check(a, group) -> dict:
    """Ulysses' DistributedAttention on this rank's slice of q, k, v against causal attention over the whole
    sequence (computed here on every rank from the same random tensors): outputs and gradients."""
    n_layer, n_embd, n_head = MODEL_SIZES[a.model_size]
    p, r, s = a.sp_size, torch.distributed.get_rank(group), a.seq_len
    device = deepspeed.get_accelerator().current_device_name()   # where the group's collectives run
    torch.manual_seed(a.seed)   # the same full q, k, v (batch, sequence, heads, head size) on every rank
    q, k, v, grad_out = (torch.randn(2, s, n_head, n_embd // n_head).to(device) for _ in range(4))

    def causal(q, k, v, *args, **kwargs):   # the attention each rank runs: whole sequence, h/p heads
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    causal(*full).backward(grad_out)
    mine = slice(r * s // p, (r + 1) * s // p)   # this rank's part of the sequence
    local = [t[:, mine].clone().requires_grad_() for t in (q, k, v)]
    ulysses = DistributedAttention(causal, group, scatter_idx=2, gather_idx=1)   # scatter heads, gather sequence
    out = ulysses(*local, batch_dim_idx=0)
    out.backward(grad_out[:, mine])
    reference = causal(q, k, v)[:, mine]
    return {"max_output_difference": (out - reference).abs().max().item(),
            "max_grad_difference": max((x.grad - f.grad[:, mine]).abs().max().item() for x, f in zip(local, full))}


# ---- ALST: Ulysses for an HF model ----

def ulysses_config(a, stage: int, precision: str, replicas: int, n_params: int) -> dict:
    config = build_config(micro_batch=a.micro_batch, world_size=replicas, zero_stage=stage, precision=precision,
                          lr=a.lr, warmup_steps=2, total_steps=2 * a.steps, torch_adam=True, device=detect().device,
                          zero_extra=measurement_zero_extra(n_params))   # buckets of the model's size, not 5e8 elements
    config["sequence_parallel_size"] = a.sp_size   # read by DeepSpeed only without an mpu; ALST's tutorial sets it
    config["comms_logger"] = comms.LOGGER_BLOCK   # DeepSpeed's comms logger: record every collective
    del config["train_batch_size"]   # DeepSpeed derives it; with an mpu it counts replicas, not ranks
    return validate(config, device=detect().device, world_size=replicas)


def sp_loader(data, a, replica: int, replicas: int, sp_rank: int):
    """What this rank hands `UlyssesSPDataLoaderAdapter`: the adapter gathers one batch from each of the p
    ranks of a group and runs them one after another, every rank taking its slice of each. So rank r supplies
    steps r, r + p, ...: the group then trains this replica's batches in step order, as one rank would."""
    batches = ResumableBatches(data, a.micro_batch, a.seed, rank=replica, world_size=replicas)
    positions = torch.arange(a.seq_len).expand(a.micro_batch, -1)   # Ulysses masks by position, not by a mask
    for step in range(sp_rank, a.steps, a.sp_size):
        batches.position = step
        ids = batches.next()
        yield {"input_ids": ids, "position_ids": positions, "labels": ids}


def sequence_loss(engine, batch: dict, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(what this rank backpropagates, the loss of the whole sequences). Each rank's loss is a mean over its own
    tokens; weighted by its share of the tokens, the shares add up to the mean over every token. Each rank
    backpropagates its share, times what DeepSpeed divides the group's summed gradients by beyond the
    data-parallel size: nothing at ZeRO 1-2 (stage_1_and_2.py divides by dp only), p at ZeRO-3, whose
    reduce-scatter (reduce_scatter_coalesced) divides by every rank. (DeepSpeed's tutorial backpropagates the
    whole loss on every rank, through a differentiable all_gather: right at ZeRO-3, p times the gradient at 1-2.)"""
    out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    # The adapter shifted the labels before slicing (no token is lost at a cut); its slice of a batch of several
    # sequences is a strided view, which transformers' loss .view()s: made contiguous.
    shift_labels = batch["shift_labels"].contiguous()
    loss = engine.module.loss_function(logits=out.logits, labels=None, shift_labels=shift_labels,
                                       vocab_size=engine.module.config.vocab_size)
    tokens = (shift_labels != -100).sum()
    all_tokens = tokens.clone()
    torch.distributed.all_reduce(all_tokens, group=group)
    share = loss * tokens / all_tokens   # this rank's part of the mean over every token
    averaged_over_group = engine.zero_optimization_stage() == 3 and engine.zero_reduce_scatter()
    backward = share * torch.distributed.get_world_size(group) if averaged_over_group else share
    whole = share.detach().clone()
    torch.distributed.all_reduce(whole, group=group)
    return backward, whole


def activation_bytes(engine, data, a, length: int, sp_rank: int) -> int:
    """Bytes one forward on this rank's slice of `length`-token sequences saves for backward, weights left out."""
    ids = data[:a.micro_batch]["input_ids"].repeat(1, -(-length // a.seq_len))[:, :length]
    mine = slice(sp_rank * length // a.sp_size, (sp_rank + 1) * length // a.sp_size)
    positions = torch.arange(length).expand(a.micro_batch, -1)
    weights = {(str(t.device), t.untyped_storage().data_ptr()) for t in engine.module.parameters()}
    with saved_for_backward() as saved:
        engine(input_ids=ids[:, mine].contiguous().to(engine.device), position_ids=positions[:, mine].to(engine.device))
    return storage_bytes(saved, seen=weights)


def train(engine, loader, steps: int, group) -> tuple[list[float], list[float], dict]:
    """The training loop: the losses and gradient norms (before clipping) of the whole sequences, and the
    collectives of its last step, from DeepSpeed's comms logger."""
    losses, norms = [], []
    for step, batch in enumerate(loader):
        if step == steps - 1:
            comms_logger.reset_data()
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        if group is not None:
            loss, whole = sequence_loss(engine, batch, group)
        else:
            loss = whole = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(whole.item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms, comms.logged()


def run_stage(a, stage: int, data, precision: str, mpu) -> dict:
    """Train a fresh Llama (same seed: same initial weights) at ZeRO `stage`, split over the group's ranks."""
    rank, replicas = torch.distributed.get_rank(), torch.distributed.get_world_size() // a.sp_size
    n_params = llama_param_count(data.vocab_size, *MODEL_SIZES[a.model_size][:2])["total"]
    config = ulysses_config(a, stage, precision, replicas, n_params)
    save_config(a.out, f"stage{stage}", config)
    model = build_llama(data.vocab_size, max([a.seq_len, *a.lengths]), a.model_size, seed=a.seed)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters(), mpu=mpu)
    replica, sp_rank = divmod(rank, a.sp_size)   # DeepSpeed's groups: ranks r*p .. r*p+p-1 split replica r's sequences
    batches = sp_loader(data, a, replica, replicas, sp_rank)
    if a.sp_size > 1:
        group = groups._get_sequence_parallel_group()
        batches = UlyssesSPDataLoaderAdapter(batches, sp_rank=sp_rank, sp_group=group, sp_world_size=a.sp_size,
                                             device=engine.device)
    else:   # one rank holds whole sequences: the plain loop, its labels shifted by the model
        group = None
    losses, norms, logged = train(engine, batches, a.steps, group)
    result = {"stage": stage, "losses": losses, "grad_norms": norms, "comm_logged": logged, "held_bytes": held_bytes(engine),
              "activation_bytes": {length: activation_bytes(engine, data, a, length, sp_rank) for length in a.lengths},
              "groups": {"sequence_parallel": list(range(replica * a.sp_size, (replica + 1) * a.sp_size)),
                         "zero_partition": torch.distributed.get_process_group_ranks(
                             groups._get_sequence_data_parallel_group())},
              "config": config}
    engine.destroy()
    return result


if __name__ == "__main__":
    main()
