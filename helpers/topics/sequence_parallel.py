"""Sequence parallelism (DeepSpeed-Ulysses), the notebook's side (07): what the all-to-alls should move and
what a rank should hold, from the shapes alone, and the tables from helpers/programs/sequence_parallel.py.

Ulysses (Jacobs et al. 2023): each of p ranks holds s/p tokens of every sequence for everything but
attention. Before attention one all-to-all per projection (q, k, v) trades "my tokens, all heads" for "all
tokens, my h/p heads"; after it one all-to-all trades back. Each moves one rank's b x (s/p) x h numbers
(k and v: x kv_heads/heads), four per layer forward and four in backward. Everything a rank stores for
backward is 1/p of the whole: its tokens' activations, and inside attention its heads of the whole sequence.
"""
from __future__ import annotations

ALL_TO_ALLS_PER_LAYER = 8   # q, k, v in and the output back, forward; their four transposes in backward


def all_to_all_formula(micro_batch: int, seq_len: int, n_embd: int, sp: int, n_layer: int, element: int) -> dict:
    """Bytes each all-to-all is handed (one rank's slice: b x s/p x h elements) and how many a step runs."""
    return {"bytes": micro_batch * seq_len // sp * n_embd * element, "count": ALL_TO_ALLS_PER_LAYER * n_layer}


def comm_rows(results: dict[str, list]) -> list[dict]:
    """Per layout and stage: rank 0's logged all-to-alls of one step beside the formula."""
    from helpers.model import MODEL_SIZES
    from helpers.precision import ELEMENT_BYTES
    rows = []
    for name, ranks in results.items():
        r = ranks[0]
        n_layer, n_embd, _ = MODEL_SIZES[r["model_size"]]
        want = all_to_all_formula(r["micro_batch"], r["seq_len"], n_embd, r["sp_size"], n_layer, ELEMENT_BYTES[r["precision"]])
        for run in r["runs"]:
            logged = run["comm_logged"].get("all_to_all_single", {})
            rows.append({"layout": name, "stage": run["stage"], "all-to-all bytes (formula)": want["bytes"],
                         "count formula": want["count"], "count logged at that size": logged.get(str(want["bytes"]), 0),
                         "all-to-alls logged in all": sum(logged.values())})
    return rows


def activation_rows(single: dict, split: dict) -> list[dict]:
    """Per sequence length: the activation bytes one rank saves for backward with p = 1 and with p ranks (rank 0's
    first run of each), their ratio against the formula's 1/p, and the formula with what Ulysses adds: per layer,
    the attention output comes back from the all-to-all sequence-major, and the copy that lays it out for o_proj
    is saved (one b x s/p x h tensor; on one rank o_proj's input shares the storage SDPA saved)."""
    from helpers.model import MODEL_SIZES
    from helpers.precision import ELEMENT_BYTES
    one, many = single["runs"][0]["activation_bytes"], split["runs"][0]["activation_bytes"]
    p, b = split["sp_size"], split["micro_batch"]
    n_layer, n_embd, _ = MODEL_SIZES[split["model_size"]]
    copies = {length: n_layer * b * int(length) // p * n_embd * ELEMENT_BYTES[split["precision"]] for length in one}
    return [{"sequence length": int(length), "bytes, 1 rank": one[length], f"bytes per rank, {p} ranks": many[length],
             "ratio": many[length] / one[length], "formula": 1 / p,
             "1 rank / p + Ulysses' copies": one[length] / p + copies[length]} for length in one]


def bytes_per_token(rows: list[dict]) -> float:
    """Activation bytes per token of one rank with p = 1: the slope through the measured lengths (all of them,
    least squares through 0, since a forward of no tokens saves nothing)."""
    xs, ys = [r["sequence length"] for r in rows], [r["bytes, 1 rank"] for r in rows]
    return sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)


def longest_sequence(budget_bytes: float, per_token: float, sp: int) -> int:
    """The longest sequence whose activations fit `budget_bytes` on each rank when p = sp ranks split it."""
    return int(budget_bytes * sp / per_token) // sp * sp


def held_rows(results: dict[str, list]) -> list[dict]:
    """Per layout and ZeRO stage, rank 0's model-state bytes beside the formula: sequence parallelism splits no
    weight, so ZeRO partitions the whole model over all N ranks (DeepSpeed's sequence-data-parallel group)."""
    from helpers.memory.formulas import bytes_per_param, zero_model_states
    from helpers.model import MODEL_SIZES, llama_param_count
    rows = []
    for name, ranks in results.items():
        r = ranks[0]
        total = llama_param_count(r["vocab_size"], *MODEL_SIZES[r["model_size"]][:2])["total"]
        for run in r["runs"]:
            want = zero_model_states(total, r["world_size"], run["stage"], *bytes_per_param(r["precision"], run["stage"]))
            rows.append({"layout": name, "stage": run["stage"], "param bytes": run["held_bytes"]["params"],
                         "param bytes (formula)": want["params"], "optimizer bytes": run["held_bytes"]["optimizer"],
                         "optimizer bytes (formula)": want["optimizer"]})
    return rows
