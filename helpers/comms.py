"""Communication volume from DeepSpeed's comms logger, next to the ZeRO paper's prediction.

DeepSpeed's logger records, per collective, the size of the tensor handed to it (`msg_size`): the
whole tensor for all_reduce / reduce / reduce_scatter_tensor, this rank's shard for
all_gather_into_tensor. How many bytes a rank then *sends* depends on the algorithm; with the ring
algorithms NCCL and gloo use (the same factors as DeepSpeed's own bus-bandwidth formula):
    all_reduce of M bytes        2 M (N-1)/N     (a reduce-scatter then an all-gather)
    reduce_scatter of M bytes      M (N-1)/N
    all_gather of an m-byte shard  m (N-1)
    reduce / broadcast of M bytes  M (N-1)/N
Gloo (the CPU backend) does not always send that (`GLOO_SEND_FACTOR`): its reduce_scatter_tensor sends what
its all-reduce does, 2 M (N-1)/N, and its reduce M (N-1)/N (1 + 1/N) averaged over the roots. `written_bytes`,
the kernel's count of what a rank wrote to its sockets, measures both without any of these factors.
"""
from __future__ import annotations

SEND_FACTOR = {  # bytes sent per logged byte, as a function of the number of ranks N
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
    "reduce": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
}
# What gloo sends, by the kernel's count on 2 and 4 ranks (tests/test_comms.py): a reduce-scatter costs an
# all-reduce; a reduce, a ring reduce-scatter plus each other rank's reduced 1/N sent on to the root.
GLOO_SEND_FACTOR = SEND_FACTOR | {"reduce_scatter_tensor": SEND_FACTOR["all_reduce"],
                                  "reduce": lambda n: (n - 1) / n * (1 + 1 / n)}


def predicted_units(stage: int, accum: int, algorithm: str = "paper") -> float:
    """Bytes a rank sends per optimizer step, in units of Ψ·bytes·(N-1)/N, with `accum` micro-batches.

    Stages 0-1 reduce gradients once per step (they accumulate them locally); stages 2-3 keep only a
    gradient shard, so they reduce after every micro-batch, and stage 3 gathers parameters for every
    forward (and backward). "paper": reduce-scatter (1) + all-gather (1) per reduction, parameters
    re-gathered for backward. "deepspeed": 0.19's defaults, which all-reduce (2) gradient buckets at
    stages 1-2 and keep stage 3's gathered parameters from forward to backward (while a parameter's reuse
    is within stage3_max_reuse_distance, 1e9 elements: far above these models; notebook 08). With accum = 1 the
    paper's column reads 2, 2, 2, 3: stages 1-2 cost what plain data parallelism does, stage 3 1.5x.
    """
    reduce_cost = 1 if algorithm == "paper" else 2
    units = {0: 2,                                   # one all-reduce of the gradients
             1: reduce_cost + 1,                     # reduce the gradients, all-gather updated params
             2: accum * reduce_cost + 1,
             3: accum * (3 if algorithm == "paper" else 2)}
    if algorithm not in ("paper", "deepspeed") or stage not in units:
        raise ValueError(f"algorithm={algorithm!r} / stage={stage!r}: use 'paper' or 'deepspeed', stage 0-3")
    return float(units[stage])


# The config block that switches DeepSpeed's comms logger on when the engine is built: every collective
# recorded (op, message size, count), none printed. A program calls deepspeed.comm.comms_logger.reset_data()
# before the step it measures and reads the record with `logged()` after it.
LOGGER_BLOCK = {"enabled": True, "verbose": False, "prof_all": True}


def logged() -> dict:
    """What DeepSpeed's comms logger recorded since its last `reset_data()`, as {op: {msg_size_bytes: count}}
    (switched on by the config's `comms_logger` block, `LOGGER_BLOCK`)."""
    import deepspeed.comm as dist
    return {op: {int(size): vals[0] for size, vals in sizes.items()}
            for op, sizes in dist.comms_logger.get_raw_data().items()}


def sent_bytes(logged: dict, n_ranks: int, factors: dict = SEND_FACTOR) -> dict[str, float]:
    """Bytes this rank sent per collective type, from `logged()`: with the ring algorithms' factors, or
    `GLOO_SEND_FACTOR` for what gloo sends."""
    if n_ranks < 2:
        return {op: 0.0 for op in logged}
    unknown = set(logged) - set(factors)
    if unknown:
        raise ValueError(f"no send factor for collectives {sorted(unknown)}: add them to SEND_FACTOR")
    return {op: factors[op](n_ranks) * sum(int(size) * count for size, count in sizes.items())   # JSON keys: str
            for op, sizes in logged.items()}


def written_bytes() -> int | None:
    """Bytes this process has handed to write() and writev() so far, all threads, by the kernel's own count
    (Linux's /proc/self/io, `wchar`). Gloo sends over TCP with writev, so across a step on a CPU the difference
    is what this rank sent, plus gloo's small message headers: measured without DeepSpeed's logger or any
    algorithm's factor. None where /proc/self/io is missing; NCCL's transfers are no system calls at all."""
    try:
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))
    except OSError:
        return None


# ---- tables from the rank programs' results (helpers/programs/zero_stages.py, comm_dtype.py) ----

def stage_rows(default: dict[int, list], paper: dict[int, list], accum: int) -> list[dict]:
    """Per ZeRO stage and algorithm (DeepSpeed's defaults, the paper's): bytes rank 0 sent in one
    optimizer step, measured vs predicted. Each argument: {stage: [rank 0's result, rank 1's, ...]}."""
    from helpers.memory.formulas import bytes_per_param
    base = sum(default[0][0]["comm_sent_bytes"].values())   # stage 0 with DeepSpeed's defaults
    rows = []
    for algorithm, results in (("deepspeed", default), ("paper", paper)):
        for stage, ranks in results.items():
            r = ranks[0]
            unit = r["n_params"] * bytes_per_param(r["precision"], stage)[1] * (r["world_size"] - 1) / r["world_size"]
            measured = sum(r["comm_sent_bytes"].values())
            written = r["comm_written_bytes"]
            rows.append({"stage": stage, "algorithm": algorithm, "sent MB (logged x ring)": measured / 1e6,
                         "predicted MB": predicted_units(stage, accum, algorithm) * unit / 1e6,
                         "vs stage 0": measured / base,
                         "gloo MB (logged x gloo)": sum(sent_bytes(r["comm_logged"], r["world_size"],
                                                                   GLOO_SEND_FACTOR).values()) / 1e6,
                         "written MB (kernel)": written / 1e6 if written is not None else None,
                         "step ms": 1e3 * sum(r["step_s"]) / len(r["step_s"])})
    return rows


def global_losses(ranks: list[dict]) -> list[float]:
    """Per step, the loss of the whole global batch: the mean of the ranks' equal-sized micro-batch losses."""
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in ranks))]


def replica_losses(ranks: list[dict], stage: int, group_size: int, key: str = "losses") -> list[float]:
    """`global_losses` when groups of `group_size` consecutive ranks train one replica together (tensor or
    sequence parallelism: every rank of a group reports the group's loss): the mean over the replicas."""
    firsts = [r for r in ranks if r["rank"] % group_size == 0]
    return global_losses([{"losses": next(run for run in r["runs"] if run["stage"] == stage)[key]} for r in firsts])


def dtype_rows(results: dict[str, list]) -> list[dict]:
    """Per communication dtype ({dtype: [rank results]}): what rank 0 sent in one step (gradients and
    in all) against fp32, and the loss."""
    if "fp32" not in results:
        raise ValueError(f"results hold {sorted(results)}: include 'fp32', the reference the others are compared to")
    reference = results["fp32"][0]
    base_loss = global_losses(results["fp32"])
    table = []
    for dtype, ranks in results.items():
        r, losses = ranks[0], global_losses(ranks)
        total = sum(r["comm_sent_bytes"].values())
        table.append({
            "comm dtype": dtype, "gradient MB/step": r["gradient_sent_bytes"] / 1e6,
            "gradient vs fp32": r["gradient_sent_bytes"] / reference["gradient_sent_bytes"],
            "total MB/step": total / 1e6, "total vs fp32": total / sum(reference["comm_sent_bytes"].values()),
            "final loss": losses[-1], "max |loss - fp32 loss|": max(abs(x - y) for x, y in zip(losses, base_loss)),
            "step ms": 1e3 * sum(r["step_s"]) / len(r["step_s"])})
    return table


def norm_gap(ranks: list[dict], stage: int, reference_norms: list[float]) -> float:
    """The largest relative difference, over the steps, of DeepSpeed's gradient norm (every rank reports the
    global one) in `ranks`' run at `stage` from a reference run's norms."""
    run = next(r for r in ranks[0]["runs"] if r["stage"] == stage)
    return max(abs(a / b - 1) for a, b in zip(run["grad_norms"], reference_norms))
