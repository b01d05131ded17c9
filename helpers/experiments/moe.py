"""One rank of the expert-parallel experiment (notebook 06): train `helpers.moe.MoEGPT` with its experts
spread over the ranks (ep_size), and step by step beside it its dense twin (the same parameters per
token) on the same data.

Every rank records what it holds (its experts and the shared weights), per step the tokens its batch
sent to each expert, the auxiliary load-balancing loss, the language-model loss and the step time,
and the collectives of one step. `run()` below launches it from a notebook and returns every rank's
result; the other functions there turn those results into plot-ready arrays and tables.
"""
import argparse
import time

import numpy as np
import torch

from helpers import comms, moe
from helpers.batches import ResumableBatches
from helpers.config import build_config, validate
from helpers.data import SyntheticTextDataset
from helpers.launch import write_result
from helpers.runtime import detect, init_single_process, quiet_deepspeed, seed_everything
from helpers.model import MODEL_SIZES


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--num-experts", type=int, default=4)
    p.add_argument("--ep-size", type=int, default=2, help="ranks that share one set of experts")
    p.add_argument("--k", type=int, default=1, help="experts per token (top-k routing)")
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--zero-stage", type=int, default=1, help="0, 1 or 2: ZeRO 3 refuses DeepSpeed's MoE layers")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    p.add_argument("--skip-dense", action="store_true", help="train only the MoE model")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def check_options(a, world_size: int) -> None:
    """ValueError for settings DeepSpeed would reject mid-launch (or that leave nothing to measure)."""
    moe.check_moe_args(a.num_experts, a.ep_size, a.k, world_size=world_size)
    if a.zero_stage not in (0, 1, 2):
        # engine._validate_zero3_moe_compatibility: "Native DeepSpeed MoE is not supported with ZeRO Stage 3"
        raise ValueError(f"zero_stage={a.zero_stage}: DeepSpeed's MoE layers run with ZeRO stage 0, 1 or 2 only")
    if a.steps < 3:
        raise ValueError(f"steps={a.steps}: need at least 3 (a logged step, then timed ones)")


def make_engine(model, a, precision: str, world: int):
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
                                   torch_adam=device == "cpu"), device=device, world_size=world)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "shared"})
    described = [{"name": g["name"], "moe": g.get("moe", False), "params": sum(p.numel() for p in g["params"])}
                 for g in groups]
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
        if isinstance(out, moe.MoEOutput):
            record.update(lm_loss=out.lm_loss.item(), aux_loss=out.aux_loss.item(),
                          aux_per_layer=[ff.l_aux.item() for ff in engine.module.feed_forwards],
                          exp_counts=out.exp_counts.tolist())
        history.append(record)
    return history


def logged_step(engine, batches: ResumableBatches) -> tuple[dict, dict]:
    """One training step with DeepSpeed's comms logger on: (its metrics, {collective: {bytes: count}})."""
    comms.start_logging()
    record = train(engine, batches, 1)[0]
    return record, comms.stop_logging()


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
        engine, groups = make_engine(model, a, precision, world)
        batches = ResumableBatches(data, a.micro_batch, a.seed, engine.global_rank, world)
        first, logged = logged_step(engine, batches)
        runs[name] = (engine, batches, {"optimizer_groups": groups, "comm_logged": logged, "history": [first]})
    for _ in range(a.steps - 1):
        for engine, batches, record in runs.values():
            record["history"] += train(engine, batches, 1)
    return {name: (engine, record) for name, (engine, _, record) in runs.items()}


def main(argv=None):
    a = parse(argv)
    quiet_deepspeed()
    init_single_process()   # under a launcher: joins the launcher's group
    world = torch.distributed.get_world_size()
    check_options(a, world)
    seed_everything(a.seed)
    precision = detect().precision if a.precision == "auto" else a.precision
    data = SyntheticTextDataset("markov", n_samples=1024, seq_len=a.seq_len, seed=a.seed)
    models = {"moe": moe.MoEGPT(data.vocab_size, a.seq_len, a.model_size, a.num_experts, a.k, a.ep_size,
                                a.capacity_factor, aux_loss_coef=a.aux_loss_coef, seed=a.seed)}
    if not a.skip_dense:
        models["dense"] = moe.dense_twin(data.vocab_size, a.seq_len, a.model_size, a.k, seed=a.seed)
    runs = train_side_by_side(models, a, data, precision, world)
    engine, result = runs["moe"]
    result.update(held=moe.count_params(engine.module, a.k), **held_experts(engine.module),
                  formula=moe.moe_param_counts_for_size(data.vocab_size, a.seq_len, a.model_size, a.num_experts,
                                                        a.k, a.ep_size))
    if "dense" in runs:
        runs["dense"][1]["params"] = sum(p.numel() for p in runs["dense"][0].module.parameters())
    settings = {k: v for k, v in vars(a).items() if k != "out"}
    write_result(a.out, {"settings": {**settings, "world_size": world, "precision": precision,
                                      "vocab_size": data.vocab_size, "floor_nats": data.floor_nats,
                                      "tokens_per_rank_step": a.micro_batch * a.seq_len},
                         **{name: record for name, (_, record) in runs.items()}})
    for engine, _ in runs.values():
        engine.destroy()
    torch.distributed.barrier()


if __name__ == "__main__":
    main()


# ---- the notebook's side: launch, then turn per-rank results into arrays and tables ----

def run(n_ranks: int = 2, out_dir=None, timeout: float = 600, **options) -> list[dict]:
    """Launch the experiment on n_ranks; return each rank's result (ordered by rank).
    options: any of the rank program's flags, e.g. num_experts=4, ep_size=2, k=1, steps=30, skip_dense=True.
    out_dir: where ranks write results and logs (default: helpers.runtime.run_dir("moe"))."""
    from pathlib import Path

    from helpers.launch import launch
    from helpers.runtime import run_dir
    out_dir = Path(out_dir) if out_dir is not None else run_dir("moe")
    args = []
    for key, value in options.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            args.append(flag)
        elif value is not False:
            args.append(f"{flag}={value}")
    try:   # unknown flags and bad values fail here, before any rank starts
        a = parse(["--out", str(out_dir), *args])
    except SystemExit:   # argparse has printed what is wrong
        raise ValueError(f"bad experiment options {options} (see `python -m {__name__} --help`)") from None
    check_options(a, n_ranks)
    return launch(__name__, n_ranks, args, out_dir=out_dir, timeout=timeout)


def expert_load(results: list[dict], layer: int = 0) -> np.ndarray:
    """(steps, E): tokens routed to each expert in one MoE layer at each step, summed over the ranks
    (counted at the router, before any are dropped for lack of capacity)."""
    return np.sum([[step["exp_counts"][layer] for step in r["moe"]["history"]] for r in results], axis=0)


def load_fractions(results: list[dict], layer: int = 0) -> np.ndarray:
    """(steps, E): each expert's share of the routed tokens; 1/E each when perfectly balanced."""
    load = expert_load(results, layer)
    return load / load.sum(axis=1, keepdims=True)


def dropped_fraction(results: list[dict]) -> np.ndarray:
    """(steps, layers): fraction of all routes that went over an expert's capacity and were dropped.
    Each rank's router fills each expert up to `helpers.moe.capacity` of that rank's own tokens."""
    s = results[0]["settings"]
    tokens, k = s["tokens_per_rank_step"], s["k"]
    dropped = [[[moe.dropped_tokens(counts, tokens, k, s["capacity_factor"]) for counts in step["exp_counts"]]
                for step in r["moe"]["history"]] for r in results]
    return np.sum(dropped, axis=0) / (tokens * k * len(results))


def curves(results: list[dict]) -> dict[str, np.ndarray]:
    """Per step, averaged over ranks: the MoE model's LM loss, its summed aux loss, its total loss, and
    the dense twin's loss (absent with skip_dense)."""
    def mean(model: str, key: str) -> np.ndarray:
        return np.mean([[step[key] for step in r[model]["history"]] for r in results], axis=0)
    out = {"step": np.arange(1, len(results[0]["moe"]["history"]) + 1), "lm_loss": mean("moe", "lm_loss"),
           "aux_loss": mean("moe", "aux_loss"), "loss": mean("moe", "loss")}
    if "dense" in results[0]:
        out["dense_loss"] = mean("dense", "loss")
    return out


def tokens_per_s(results: list[dict], model: str = "moe", skip_first: int = 2) -> float:
    """Tokens per second over all ranks, from the median step. The ranks move in lockstep (every step
    has collectives), so a step lasts as long as its slowest rank; the median shrugs off the steps
    another process on the machine slowed down; the first steps (logging, warm-up) are left out."""
    s = results[0]["settings"]
    step_s = np.max([[step["step_s"] for step in r[model]["history"]] for r in results], axis=0)[skip_first:]
    return s["tokens_per_rank_step"] * s["world_size"] / float(np.median(step_s))


def throughput(results: list[dict], skip_first: int = 2) -> dict[str, float]:
    """MoE vs dense twin tokens/s, and MoE / dense. Same work per token on paper; the MoE model also
    runs the router, pads each expert's batch to its capacity and does two all-to-alls per layer in
    each direction. A measurement, not a claim: on a shared machine it moves from run to run."""
    moe_rate, dense_rate = tokens_per_s(results, "moe", skip_first), tokens_per_s(results, "dense", skip_first)
    return {"moe_tokens_per_s": moe_rate, "dense_tokens_per_s": dense_rate, "moe_over_dense": moe_rate / dense_rate}


def param_rows(results: list[dict]) -> list[dict]:
    """Per rank: parameters stored (counted from the module) beside the formula's per-rank, total and
    active counts, and the dense twin's size."""
    rows = []
    for r in results:
        m, f = r["moe"], r["moe"]["formula"]
        rows.append({"rank": r["rank"], "experts held": m["expert_ids"], "stored": m["held"]["total"],
                     "stored (formula)": f["per_rank"], "expert params stored": m["held"]["expert"],
                     "model total (formula)": f["total"], "active per token": m["held"]["active"],
                     "active (formula)": f["active"], "dense twin": r["dense"]["params"] if "dense" in r else None})
    return rows


def all_to_all_bytes(results: list[dict]) -> dict[str, int]:
    """Bytes one rank handed to all_to_all_single in the logged step, beside the prediction: 4 per MoE
    layer (dispatch and combine, forward and backward), each an (E, capacity, h) tensor."""
    s, r = results[0]["settings"], results[0]
    n_layer, n_embd, _ = MODEL_SIZES[s["model_size"]]
    cap = moe.capacity(s["tokens_per_rank_step"], s["num_experts"], s["k"], s["capacity_factor"])
    element = {"fp32": 4, "bf16": 2, "fp16": 2}[s["precision"]]
    logged = r["moe"]["comm_logged"].get("all_to_all_single", {})
    return {"logged": sum(int(size) * count for size, count in logged.items()),   # JSON made the sizes strings
            "predicted": 4 * n_layer * s["num_experts"] * cap * n_embd * element}
