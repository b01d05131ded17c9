"""Pipeline parallelism, the notebook's side: launch helpers/programs/pipeline.py (the 2-stage run and the
unsplit reference), count each stage's parameters from the shapes, and compare the two runs. The schedule
side (the bubble, DeepSpeed's 1F1B schedule, timing what an engine runs) is helpers.topics.pipeline_schedule.
"""
from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import torch

from helpers.launch import per_run, run_program
from helpers.model import gpt2_block_param_count

STAGES = 2   # helpers/programs/pipeline.py cuts the model in two (one stage per rank)


def layer_param_formula(config) -> list[int]:
    """Parameters of each layer of the program's `gpt2_layer_specs`, from a GPT2Config's shapes alone:
    token embedding V d, position embedding n_pos d, the blocks (helpers.model.gpt2_block_param_count),
    final LayerNorm 2d, LM head V d (the copy of the token embedding a stage holds when it owns the
    head but not the embedding)."""
    d, vocab = config.n_embd, config.vocab_size
    return [vocab * d, config.n_positions * d, *[gpt2_block_param_count(d)] * config.n_layer, 2 * d, vocab * d]


def stage_param_formula(specs: list, parts: list[int], per_layer: list[int]) -> list[int]:
    """Parameters each stage holds, given DeepSpeed's partition boundaries `parts` (stage s owns layers
    parts[s]..parts[s+1]-1): a tied module is held once per stage that uses it."""
    counts = []
    for start, stop in pairwise(parts):
        seen, total = set(), 0
        for i in range(start, stop):
            key = getattr(specs[i], "key", i)   # TiedLayerSpec: the shared module's key
            if key not in seen:
                seen.add(key)
                total += per_layer[i]
        counts.append(total)
    return counts


def run(micro_batches=(1, 2, 4, 8), out_dir=".", timeout: float = 600, **options) -> dict:
    """Train the 2-stage pipeline for each m (one launch), and the whole model on one rank for each m.

    options: the program's flags, e.g. steps=8, micro_batch=4, grad_clip=1.0, zero_stage=1.
    Returns {"pipeline": {m: [stage 0 result, stage 1 result]}, "unsplit": {m: result},
    "ranks": each pipeline rank's whole result, "unsplit_rank": the unsplit rank's}.
    """
    options["micro_batches"] = tuple(micro_batches)
    ranks = run_program("pipeline", STAGES, out_dir=Path(out_dir) / "pipeline", timeout=timeout, **options)
    # the unsplit run placed as the 2 ranks are (device, threads): neither can explain a loss difference
    [whole] = run_program("pipeline", 1, out_dir=Path(out_dir) / "unsplit", timeout=timeout, like_ranks=STAGES,
                          unsplit=True, **options)
    if whole["data_sha1"] != ranks[0]["data_sha1"]:
        raise RuntimeError("the unsplit run read different token ids than the pipeline: compare the seeds")
    return {"pipeline": per_run(ranks, "runs", "m"), "ranks": ranks, "unsplit_rank": whole,
            "unsplit": {m: whole["runs"][i] for i, m in enumerate(micro_batches)}}


def partition_rows(results: dict) -> list[dict]:
    """Per stage (from the first m): its layers, parameters measured and from the shapes."""
    stages = results["pipeline"][next(iter(results["pipeline"]))]
    return [{"stage": r["stage"], "layers": f"{r['layers'][0]}..{r['layers'][1] - 1}",
             "layer names": ", ".join(r["layer_names"]), "params measured": r["n_params"],
             "params formula": r["params_formula"], "of which tied copy": r["tied_params"]} for r in stages]


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
