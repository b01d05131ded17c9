"""Mixture of experts with expert parallelism (notebook 06): a GPT-2 whose MLPs are DeepSpeed MoE layers,
its experts spread over the ranks (ep_size), trained step by step beside its dense twin (the same
parameters per token) on the same data.

    torchrun --nproc_per_node 2 -m helpers.programs.moe --out runs/moe --num-experts 4 --ep-size 2 --k 1


Every rank records what it holds (its experts and the shared weights), per step the tokens its batch
sent to each expert, the auxiliary load-balancing loss, the language-model loss and the step time,
and the collectives of one step; helpers.topics.moe turns those results into tables and curves.
"""
import argparse
import time
from dataclasses import dataclass

import torch
from deepspeed.moe.layer import MoE
from torch import nn
from transformers import set_seed

from helpers import comms
from helpers.batches import ResumableBatches
from helpers.config import build_config, validate
from helpers.data import SyntheticTextDataset
from helpers.errors import integer, number
from helpers.launch import save_config, write_result
from helpers.precision import add_precision_flag
from helpers.runtime import detect, rank_process, resolve_precision
from helpers.model import MODEL_SIZES, build_model
from helpers.topics import moe


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--num-experts", type=integer(1), default=4)
    p.add_argument("--ep-size", type=integer(1), default=2, help="ranks that share one set of experts")
    p.add_argument("--k", type=integer(1), default=1, help="experts per token (top-k routing)")
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES))
    p.add_argument("--zero-stage", type=int, default=1, help="0, 1 or 2: ZeRO 3 refuses DeepSpeed's MoE layers")
    p.add_argument("--steps", type=integer(1), default=30)
    p.add_argument("--seq-len", type=integer(2), default=64)
    p.add_argument("--micro-batch", type=integer(1), default=8)
    p.add_argument("--lr", type=number(), default=3e-3)
    p.add_argument("--aux-loss-coef", type=number(strict=False), default=0.01)
    p.add_argument("--capacity-factor", type=number(), default=1.0)
    add_precision_flag(p)
    p.add_argument("--seed", type=integer(0), default=0)
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    with rank_process() as world:   # quiet logs, the launcher's group; at the end a barrier and the group's end
        check_options(a, world)
        set_seed(a.seed)
        precision = resolve_precision(a.precision)
        data = SyntheticTextDataset("markov", n_samples=1024, seq_len=a.seq_len, seed=a.seed)
        models = {"moe": MoEGPT(data.vocab_size, a.seq_len, a.model_size, a.num_experts, a.k, a.ep_size,
                                a.capacity_factor, aux_loss_coef=a.aux_loss_coef, seed=a.seed),
                  "dense": dense_twin(data.vocab_size, a.seq_len, a.model_size, a.k, seed=a.seed)}
        runs = train_side_by_side(models, a, data, precision, world)
        engine, result = runs["moe"]
        result.update(held=moe.count_params(engine.module, a.k), **held_experts(engine.module),
                      formula=moe.moe_param_counts(data.vocab_size, a.seq_len, *MODEL_SIZES[a.model_size][:2],
                                                   a.num_experts, a.k, a.ep_size))
        runs["dense"][1]["params"] = sum(p.numel() for p in runs["dense"][0].module.parameters())
        settings = {k: v for k, v in vars(a).items() if k != "out"}
        write_result(a.out, {"settings": {**settings, "world_size": world, "precision": precision,
                                          "vocab_size": data.vocab_size, "floor_nats": data.floor_nats,
                                          "tokens_per_rank_step": a.micro_batch * a.seq_len},
                             **{name: record for name, (_, record) in runs.items()}})
        for engine, _ in runs.values():
            engine.destroy()


# ---- the model ----

class ContiguousExpert(nn.Module):
    """A GPT-2 MLP as a DeepSpeed expert. With more than one expert per rank, DeepSpeed hands each expert
    a strided slice of its token buffer (deepspeed/moe/experts.py, `inputs.chunk(..., dim=1)`), and
    transformers' Conv1D reshapes its input with .view, which a strided slice refuses."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden_states.contiguous())


class MoEFeedForward(nn.Module):
    """Stands in for a GPT-2 block's MLP. The block expects a tensor back; DeepSpeed's MoE returns
    (output, aux loss, expert counts), so this keeps the last two for the model to collect."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe
        self.l_aux = self.exp_counts = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output, self.l_aux, self.exp_counts = self.moe(hidden_states)
        return output


@dataclass
class MoEOutput:
    loss: torch.Tensor | None   # lm_loss + aux_loss_coef x aux_loss: what to backpropagate
    lm_loss: torch.Tensor | None
    aux_loss: torch.Tensor      # load-balancing loss summed over the MoE layers (1 per layer when balanced)
    logits: torch.Tensor
    exp_counts: torch.Tensor    # (layers, E): tokens this process routed to each expert (before dropping)


class MoEGPT(nn.Module):
    """`build_model`'s GPT-2 with every block's MLP replaced by a DeepSpeed MoE layer of `num_experts`
    experts, each starting as a copy of that MLP (DeepSpeed deep-copies the expert it is given).

    forward(input_ids, labels) returns an `MoEOutput`. The auxiliary loss is Switch/GShard's
    load-balancing loss E x sum_e (mean gate probability of e) x (fraction of tokens sent to e):
    1 when tokens spread evenly, up to E when one expert takes them all. Adding aux_loss_coef times
    it to the loss keeps the router from collapsing onto a few experts. Each expert takes at most
    `helpers.topics.moe.capacity(tokens, E, k, capacity_factor, min_capacity)` tokens per forward; the rest are dropped.
    With ep_size > 1 the model must run under DeepSpeed (deepspeed.initialize sets up the expert groups).
    """

    def __init__(self, vocab_size: int, n_positions: int, size: str = "tiny", num_experts: int = 4, k: int = 1,
                 ep_size: int = 1, capacity_factor: float = 1.0, min_capacity: int = 4,
                 aux_loss_coef: float = 0.01, pad_token_id: int | None = None, seed: int = 0):
        moe.check_moe_args(num_experts, ep_size, k)
        super().__init__()
        self.gpt = build_model(vocab_size, n_positions, size, pad_token_id, seed)
        self.num_experts, self.k, self.ep_size, self.aux_loss_coef = num_experts, k, ep_size, aux_loss_coef
        for block in self.gpt.transformer.h:
            layer = MoE(self.gpt.config.n_embd, expert=ContiguousExpert(block.mlp), num_experts=num_experts,
                        ep_size=ep_size, k=k, capacity_factor=capacity_factor, min_capacity=min_capacity)
            block.mlp = MoEFeedForward(layer)

    @property
    def feed_forwards(self) -> list[MoEFeedForward]:
        return [block.mlp for block in self.gpt.transformer.h]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> MoEOutput:
        out = self.gpt(input_ids=input_ids, labels=labels)
        aux = torch.stack([ff.l_aux for ff in self.feed_forwards]).sum()
        counts = torch.stack([ff.exp_counts for ff in self.feed_forwards])
        loss = None if labels is None else out.loss + self.aux_loss_coef * aux
        return MoEOutput(loss, out.loss, aux, out.logits, counts)


def dense_twin(vocab_size: int, n_positions: int, size: str = "tiny", k: int = 1, pad_token_id: int | None = None,
               seed: int = 0) -> nn.Module:
    """The dense GPT-2 that runs as many parameters per token as `MoEGPT` with top-k routing: the same
    model (same seed, same embeddings and attention) with MLPs k x 4h wide. For k=1 it is exactly
    `build_model`'s GPT-2; the MoE model has only its gates (h x E per layer) more per token."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be a positive integer")
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    model = build_model(vocab_size, n_positions, size, pad_token_id, seed)
    if k > 1:
        torch.manual_seed(seed)
        for block in model.transformer.h:
            block.mlp = GPT2MLP(k * moe.GPT2_MLP_RATIO * model.config.n_embd, model.config)
            block.mlp.apply(model._init_weights)   # GPT-2's init, incl. the 1/sqrt(2 n_layer) output scaling
    return model


# ---- training ----

def check_options(a, world_size: int) -> None:
    """ValueError for settings DeepSpeed would reject mid-launch (or that leave nothing to measure)."""
    moe.check_moe_args(a.num_experts, a.ep_size, a.k, world_size=world_size)
    if a.zero_stage not in (0, 1, 2):
        # engine._validate_zero3_moe_compatibility: "Native DeepSpeed MoE is not supported with ZeRO Stage 3"
        raise ValueError(f"zero_stage={a.zero_stage}: DeepSpeed's MoE layers run with ZeRO stage 0, 1 or 2 only")
    if a.steps < 3:
        raise ValueError(f"steps={a.steps}: need at least 3 (a logged step, then timed ones)")


def make_engine(model, a, precision: str, world: int, label: str = "moe"):
    """A DeepSpeed engine for `model`. DeepSpeed wants expert parameters in optimizer groups of their
    own (marked 'moe'): their gradients are averaged only over the ranks holding the *same* experts
    (the expert-data-parallel group, world_size / ep_size ranks), not over every rank like the shared
    ones. DeepSpeed 0.19 makes these groups itself when it builds the optimizer from the config
    (engine._configure_optimizer); we make them here to record them, and an optimizer of your own must
    be built on them. The learning rate warms up for 2 steps, then decays linearly (to lr/2 at the end)."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    device = detect().device
    config = validate(build_config(micro_batch=a.micro_batch, world_size=world, zero_stage=a.zero_stage,
                                   precision=precision, lr=a.lr, warmup_steps=2, total_steps=2 * a.steps,
                                   extra={"comms_logger": comms.LOGGER_BLOCK}),
                    device=device, world_size=world)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "shared"})
    described = [{"name": g["name"], "moe": g.get("moe", False), "params": sum(p.numel() for p in g["params"])}
                 for g in groups]
    save_config(a.out, label, config)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=groups)
    # ZeRO 1-2 swap each group's parameters for this rank's fp32 partition of them: the shared group is
    # split over all ranks, an expert group only over the ranks holding the same experts.
    for group, held in zip(described, engine.optimizer.param_groups):
        group["optimizer_partition"] = sum(p.numel() for p in held["params"])
    return engine, described


def train(engine, batches: ResumableBatches, steps: int) -> list[dict]:
    """`steps` optimizer steps; per step the loss, its time and, for an MoE model, the routing."""
    engine.train()
    history = []
    for _ in range(steps):
        start = time.perf_counter()
        ids = batches.next().to(engine.device)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        record = {"loss": out.loss.item(), "step_s": time.perf_counter() - start}   # item(): waits for the step
        if isinstance(out, MoEOutput):
            record.update(lm_loss=out.lm_loss.item(), aux_loss=out.aux_loss.item(),
                          aux_per_layer=[ff.l_aux.item() for ff in engine.module.feed_forwards],
                          exp_counts=out.exp_counts.tolist())
        history.append(record)
    return history


def logged_step(engine, batches: ResumableBatches) -> tuple[dict, dict]:
    """One training step: (its metrics, what DeepSpeed's comms logger (the config's block) recorded in it,
    {collective: {bytes: count}})."""
    from deepspeed.comm import comms_logger
    comms_logger.reset_data()
    record = train(engine, batches, 1)[0]
    return record, comms.logged()


def held_experts(model) -> dict:
    """Which experts this rank stores, and a checksum of its weights to compare across ranks. Global
    expert ids follow DeepSpeed's all-to-all, which sends block r of the (E, capacity, h) token buffer
    to expert-parallel rank r: rank r holds experts r x E/ep_size to (r + 1) x E/ep_size - 1."""
    from deepspeed.moe.utils import is_moe_param
    layers = moe.moe_layers(model)
    ep_rank = torch.distributed.get_rank(group=layers[0].deepspeed_moe.ep_group)
    n_local = layers[0].num_local_experts
    experts = [[checksum(e.parameters()) for e in layer.deepspeed_moe.experts.deepspeed_experts] for layer in layers]
    shared = checksum(p for p in model.parameters() if not is_moe_param(p))
    return {"ep_rank": ep_rank, "expert_ids": list(range(ep_rank * n_local, (ep_rank + 1) * n_local)),
            "expert_checksums": experts, "shared_checksum": shared}


def checksum(params) -> float:
    return float(sum(p.detach().double().sum() for p in params))


def train_side_by_side(models: dict, a, data, precision: str, world: int) -> dict:
    """Train each model for a.steps on this rank's shard of the data (the same batches for each), one
    step of each in turn, so that load from other processes on the machine slows them alike. The
    first step of each runs with the comms logger on. Returns {name: (engine, what was recorded)}."""
    runs = {}
    for name, model in models.items():
        engine, groups = make_engine(model, a, precision, world, name)
        batches = ResumableBatches(data, a.micro_batch, a.seed, engine.global_rank, world)
        first, logged = logged_step(engine, batches)
        runs[name] = (engine, batches, {"optimizer_groups": groups, "comm_logged": logged, "history": [first]})
    for _ in range(a.steps - 1):
        for engine, batches, record in runs.values():
            record["history"] += train(engine, batches, 1)
    return {name: (engine, record) for name, (engine, _, record) in runs.items()}


if __name__ == "__main__":
    main()
