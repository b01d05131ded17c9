"""TEMPORARY: moves into helpers/memory/ at merge."""
from helpers import memory


def memory_rows(results: dict[int, list]) -> list[dict]:
    """Per stage and rank: measured bytes per component beside the formula at this N and precision.
    ZeRO-2's gradients are shown without the boundary overhang (whole gradients of parameters a
    partition boundary cuts through), which is reported in its own column."""
    rows = []
    for stage, ranks in results.items():
        for r in ranks:
            sizes = memory.bytes_per_param(r["precision"], stage)
            formula = memory.zero_model_states(r["n_params"], r["world_size"], stage, *sizes)
            held = dict(r["held_bytes"], grads=r["held_bytes"]["grads"] - r["zero2_overhang_bytes"])
            rows.append({"stage": stage, "rank": r["rank"], **{f"{k} measured": held[k] for k in
                         ("params", "grads", "optimizer")}, **{f"{k} formula": formula[k] for k in
                         ("params", "grads", "optimizer")}, "boundary grads": r["zero2_overhang_bytes"],
                         "buffers": held["buffers"], "device peak MiB": r["peak_memory_mib"]})
    return rows


def stacked_parts(rows: list[dict], rank: int = 0) -> tuple[dict, dict]:
    """(measured, formula) per stage for one rank, as {stage: {part: bytes}}, for plots.stacked_memory."""
    mine = {row["stage"]: row for row in rows if row["rank"] == rank}
    measured = {s: {"params": r["params measured"], "grads": r["grads measured"] + r["boundary grads"],
                    "optimizer": r["optimizer measured"], "buffers": r["buffers"]} for s, r in mine.items()}
    formula = {s: {k: r[f"{k} formula"] for k in ("params", "grads", "optimizer")} for s, r in mine.items()}
    return measured, formula
