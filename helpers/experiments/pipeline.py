"""One rank of the pipeline-parallel experiment (notebook 06): GPT-2 cut into 2 stages on 2 ranks,
trained by DeepSpeed's PipelineEngine, every instruction timed; or, with --unsplit, the same model
trained whole on one rank by a plain DeepSpeedEngine, for the loss comparison.

Run from a notebook by `run(micro_batches=(1, 2, 4, 8))` below: one launch trains the pipeline once per
number of micro-batches m (starting processes costs more than training), a second launch (one rank)
trains the unsplit model on the same data. Every micro-batch has the same size, so a stage's work per
micro-batch stays the same and only the bubble changes with m.
"""
import argparse
import hashlib
import time
import warnings

import torch

from helpers.data import SyntheticTextDataset
from helpers.launch import write_result
from helpers.pipeline import (PARTITION_METHODS, UnsplitModel, build_pipeline, gpt2_config, gpt2_layer_specs,
                              layer_names, layer_param_formula, stage_param_formula, stage_summary)
from helpers.pipeline_schedule import InstructionTimer, bubble_fraction
from helpers.model import MODEL_SIZES

STAGES = 2


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="m values, trained one after another")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per m (the first is warm-up)")
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES))
    p.add_argument("--n-layer", type=int, default=None, help="override the size's number of blocks")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--grad-clip", type=float, default=0.0,
                   help="0 = off; see CLIPPING below for why it is off by default")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1), help="the pipeline engine allows <= 1")
    p.add_argument("--partition-method", default="parameters", choices=PARTITION_METHODS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--unsplit", action="store_true", help="train the whole model on one rank instead")
    return p.parse_args(argv)


# CLIPPING: DeepSpeed 0.19's fp32 pipeline engine clips with a norm over stage 0's gradients only:
# runtime/utils.py clip_grad_norm_ counts a parameter only on "model-parallel rank 0" unless it is
# marked model_parallel, and the pipeline grid makes the stages of one pipeline its model-parallel
# group (pipe/topology.py, ds_model_proc_group). Measured on this model: DeepSpeed clipped with 1.82
# where the norm over both stages was 2.04. The unsplit engine uses the full norm, so with clipping
# on the two runs part as soon as clipping acts (5.7e-4 in loss after 6 steps at grad_clip=0.5).


def model_config(a, vocab_size: int):
    n_layer, n_embd, n_head = MODEL_SIZES[a.model_size]
    return gpt2_config(vocab_size, a.seq_len, a.n_layer or n_layer, n_embd, n_head)


def make_data(a) -> SyntheticTextDataset:
    """Enough samples that no step of the largest m reuses one."""
    return SyntheticTextDataset("markov", n_samples=a.steps * max(a.micro_batches) * a.micro_batch,
                                seq_len=a.seq_len, seed=a.seed)


def step_micro_batches(data, step: int, m: int, size: int):
    """The m micro-batches of optimizer step `step`, as (inputs, labels): the first stage reads the
    inputs, the last stage the labels. Every run (pipeline, unsplit, any m) reads them in this order."""
    for k in range(m):
        start = (step * m + k) * size
        ids = data[slice(start, start + size)]["input_ids"]
        yield ids, ids


def ds_config(a, m: int) -> dict:
    from helpers.config import build_config
    # One pipeline = one data-parallel replica, so the batch is micro_batch x m. torch's AdamW: the same
    # optimizer code in both runs (FusedAdam's CPU kernel rounds by memory layout, see build_config).
    return build_config(micro_batch=a.micro_batch, grad_accum=m, world_size=1, zero_stage=a.zero_stage,
                        precision="fp32", lr=a.lr, warmup_steps=2, total_steps=a.steps + 1,
                        grad_clip=a.grad_clip, torch_adam=True)


def train_pipeline(a, m: int, data) -> dict:
    """Train the 2-stage pipeline with m micro-batches per step; return this stage's measurements."""
    import deepspeed
    config = model_config(a, data.vocab_size)
    specs = gpt2_layer_specs(config)
    module = build_pipeline(specs, STAGES, a.partition_method, a.seed)
    engine, *_ = deepspeed.initialize(model=module, config=ds_config(a, m),
                                      model_parameters=[p for p in module.parameters() if p.requires_grad])
    timer = InstructionTimer(engine)
    losses, step_s, events = [], [], []
    for step in range(a.steps):
        start = time.perf_counter()
        loss = engine.train_batch(step_micro_batches(data, step, m, a.micro_batch))
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())   # the last stage's mean over the m micro-batches, broadcast to all
        events.append(timer.take())
    summary = stage_summary(engine.module)
    state_file = save_weights(engine.module, a.out, f"stage{summary['stage']}_m{m}.pt")
    engine.destroy()
    start, stop = summary["layers"]
    formula = stage_param_formula(specs, summary["parts"], layer_param_formula(config))[summary["stage"]]
    return {"m": m, **summary, "layer_names": layer_names(specs)[start:stop], "params_formula": formula,
            "losses": losses, "step_s": step_s, "events": events, "bubble_formula": bubble_fraction(STAGES, m),
            "state_file": state_file}


def train_unsplit(a, m: int, data) -> dict:
    """Train the same layers whole on this one rank with the usual forward/backward/step loop."""
    import deepspeed
    config = model_config(a, data.vocab_size)
    model = UnsplitModel(gpt2_layer_specs(config), seed=a.seed)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(a, m), model_parameters=model.parameters())
    losses, step_s = [], []
    for step in range(a.steps):
        start = time.perf_counter()
        total = 0.0
        for inputs, labels in step_micro_batches(data, step, m, a.micro_batch):
            loss = engine(inputs.to(engine.device), labels.to(engine.device))
            engine.backward(loss)   # DeepSpeed divides by m and steps the optimizer after the m-th
            engine.step()
            total = total + loss.detach()   # summed in order, as the pipeline's last stage does
        step_s.append(time.perf_counter() - start)
        losses.append((total / m).item())
    n_params = sum(p.numel() for p in model.parameters())
    state_file = save_weights(model.layers, a.out, f"unsplit_m{m}.pt")
    engine.destroy()
    return {"m": m, "n_params": n_params, "losses": losses, "step_s": step_s, "state_file": state_file}


def save_weights(module, out_dir, name: str) -> str:
    """The trained weights, keyed as PipelineModule names them (layer index, or tied_modules.<key>),
    which are the same names in every stage and in the unsplit model."""
    from pathlib import Path
    path = Path(out_dir) / name
    torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, path)
    return str(path)


def main(argv=None):
    import deepspeed

    from helpers.runtime import quiet_deepspeed, seed_everything
    a = parse(argv)
    if a.steps < 2:
        raise SystemExit(f"--steps={a.steps}: need at least 2 (the first is a warm-up)")
    quiet_deepspeed()
    # PipelineModule copies the tied weight into place with an in-place broadcast on the Parameter, and
    # from then on every backward warns that broadcast_ has no autograd kernel. The gradient reaching
    # the weight is unaffected (the loss matches the unsplit run to the bit), so keep the logs readable.
    warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")
    deepspeed.init_distributed(verbose=False)   # rank and rendezvous from the launcher's environment
    world = torch.distributed.get_world_size()
    expected = 1 if a.unsplit else STAGES
    if world != expected:
        raise SystemExit(f"{'--unsplit' if a.unsplit else 'the pipeline'} runs on {expected} rank(s), got {world}")
    data = make_data(a)
    seed_everything(a.seed)
    train = train_unsplit if a.unsplit else train_pipeline
    runs = [train(a, m, data) for m in a.micro_batches]
    config = model_config(a, data.vocab_size)
    write_result(a.out, {
        "runs": runs, "unsplit": a.unsplit, "device": str(torch.device(deepspeed.get_accelerator().device_name())),
        "torch_threads": torch.get_num_threads(), "vocab_size": data.vocab_size,
        "model": {"n_layer": config.n_layer, "n_embd": config.n_embd, "n_positions": config.n_positions},
        "layer_param_formula": layer_param_formula(config),
        "data_sha1": hashlib.sha1(data[:]["input_ids"].numpy().tobytes()).hexdigest()})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()


# ---- the notebook's side: launch, then turn per-rank results into tables ----

def run(micro_batches=(1, 2, 4, 8), out_dir=".", unsplit: bool = True, timeout: float = 600, **options) -> dict:
    """Train the 2-stage pipeline for each m (one launch) and, if unsplit, the whole model on one rank.

    options: the rank program's flags, e.g. steps=8, micro_batch=4, grad_clip=1.0, zero_stage=1.
    Returns {"pipeline": {m: [stage 0 result, stage 1 result]}, "unsplit": {m: result} or None,
    "ranks": each pipeline rank's whole result, "unsplit_rank": the unsplit rank's}. Feed it to
    partition_rows, bubble_rows and parity_rows.
    """
    from pathlib import Path

    from helpers.launch import launch
    for m in micro_batches:
        bubble_fraction(STAGES, m)   # a clear error here rather than in a rank's log
    if len(set(micro_batches)) != len(micro_batches):
        raise ValueError(f"micro_batches={micro_batches!r} repeats a value: list each m once")
    args = ["--micro-batches", *map(str, micro_batches)]
    args += [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    ranks = launch(__name__, STAGES, args, out_dir=Path(out_dir) / "pipeline", timeout=timeout)
    results = {"pipeline": {m: [r["runs"][i] for r in ranks] for i, m in enumerate(micro_batches)},
               "ranks": ranks, "unsplit": None}
    if unsplit:
        with _same_device_as_pipeline():
            [whole] = launch(__name__, 1, args + ["--unsplit"], out_dir=Path(out_dir) / "unsplit", timeout=timeout)
        if whole["data_sha1"] != ranks[0]["data_sha1"]:
            raise RuntimeError("the unsplit run read different token ids than the pipeline: compare the seeds")
        results["unsplit"] = {m: whole["runs"][i] for i, m in enumerate(micro_batches)}
        results["unsplit_rank"] = whole
    return results


def _same_device_as_pipeline():
    """Two ranks need two GPUs, else launch() runs them on the CPU with one thread share each. Run the
    one-rank reference the same way, so device or thread count cannot explain a loss difference."""
    import os

    from helpers.launch import gpu_count
    from helpers.runtime import environment
    if gpu_count() >= STAGES:
        return environment()
    threads = str(max(1, (os.cpu_count() or 1) // STAGES))
    return environment(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu",
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads))


def partition_rows(results: dict) -> list[dict]:
    """Per stage (from the first m): its layers, parameters measured and from the shapes."""
    stages = results["pipeline"][next(iter(results["pipeline"]))]
    return [{"stage": r["stage"], "layers": f"{r['layers'][0]}..{r['layers'][1] - 1}",
             "layer names": ", ".join(r["layer_names"]), "params measured": r["n_params"],
             "params formula": r["params_formula"], "of which tied copy": r["tied_params"]} for r in stages]


def bubble_rows(results: dict, warmup: int = 1) -> list[dict]:
    """Per m and stage: the bubble formula, DeepSpeed's schedule, this run replayed, and the measured idle share.

    The replays run DeepSpeed's schedule on paper with the work each stage really did in this run, as
    if each stage had a processor of its own: "idle replayed" with instant hand-offs between stages
    (it differs from the formula only where the stages' work differs), "+ hand-offs" with this run's
    median hand-off time. "idle measured" is the wall clock. Each is the median over the steps after
    `warmup`, so one preempted step does not move it.
    """
    from statistics import median

    from helpers.pipeline_schedule import (handoff_delays, measured_bubble, replay_schedule, scheduled_bubble,
                                           work_per_micro_batch)
    threads = results["ranks"][0]["torch_threads"]
    rows = []
    for m, stages in results["pipeline"].items():
        stages = sorted(stages, key=lambda r: r["stage"])
        steps = [[s["events"][i] for s in stages] for i in range(warmup, len(stages[0]["events"]))]
        measured = [measured_bubble(step) for step in steps]
        handoff = [median(handoff_delays(step) or [0.0]) for step in steps]
        work = [work_per_micro_batch(step, threads) for step in steps]
        replayed = [measured_bubble(replay_schedule(*w)) for w in work]
        with_handoffs = [measured_bubble(replay_schedule(*w, handoff_s=h)) for w, h in zip(work, handoff)]
        for stage, scheduled in enumerate(scheduled_bubble(len(stages), m)):
            mine = [step[stage] for step in measured]
            rows.append({
                "m": m, "stage": stage, "bubble formula": bubble_fraction(len(stages), m),
                "schedule idle slots": scheduled,
                "idle replayed": median(step[stage]["idle_fraction"] for step in replayed),
                "idle replayed + hand-offs": median(step[stage]["idle_fraction"] for step in with_handoffs),
                "idle measured": median(r["idle_fraction"] for r in mine),
                "hand-off ms": 1e3 * median(handoff),
                "p2p wait share": median(r["p2p_s"] / r["span_s"] for r in mine),
                "cpu share": median(r["compute_cpu_share"] for r in mine),
                "forward ms": 1e3 * median(r["forward_s"] for r in mine),
                "backward ms": 1e3 * median(r["backward_s"] for r in mine),
                "span ms": 1e3 * median(r["span_s"] for r in mine),
                "train_batch ms": 1e3 * median(stages[stage]["step_s"][warmup:])})
    return rows


def parity_rows(results: dict) -> list[dict]:
    """Per m: the losses of the pipeline and of the unsplit model, and how far apart losses and final
    weights are. "tied copies" compares the embedding weight held by stage 0 with stage 1's copy."""
    rows = []
    for m, stages in results["pipeline"].items():
        whole = results["unsplit"][m]
        piped = stages[0]["losses"]
        rows.append({"m": m, "first loss": piped[0], "last loss pipeline": piped[-1],
                     "last loss unsplit": whole["losses"][-1],
                     "max |loss difference|": max(abs(p - w) for p, w in zip(piped, whole["losses"])),
                     **weight_differences([s["state_file"] for s in stages], whole["state_file"]),
                     "params pipeline (sum of stages)": sum(s["n_params"] for s in stages),
                     "params unsplit": whole["n_params"]})
    return rows


def weight_differences(stage_files: list[str], unsplit_file: str) -> dict:
    """Largest |difference| between every stage's trained weights and the unsplit model's, and between
    the copies of a tied weight held by different stages."""
    whole = torch.load(unsplit_file)
    stages = [torch.load(f) for f in stage_files]
    vs_unsplit = max((t - whole[k]).abs().max().item() for stage in stages for k, t in stage.items())
    shared = set(stages[0]).intersection(*stages[1:])
    tied = max(((stages[0][k] - s[k]).abs().max().item() for k in shared for s in stages[1:]), default=0.0)
    return {"max |weight difference|": vs_unsplit, "tied copies max |difference|": tied}
