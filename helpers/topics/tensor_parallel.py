"""Tensor parallelism, the notebook's side (07): what a rank of AutoTP should hold and send, from the model's
shapes and Megatron's split alone, and the tables that put helpers/programs/tensor_parallel.py's results
beside those formulas.

Megatron-LM (Shoeybi et al. 2019) splits a transformer block's linears in two kinds. A *column-parallel*
linear cuts its weight by output features: each rank computes its slice of the output from the whole input,
and its backward must all-reduce the gradient of that input. A *row-parallel* linear cuts by input features:
each rank computes a partial sum of the whole output from its slice of the input, and its forward must
all-reduce them. A Llama block's q, k, v, gate and up take the block's input (column-parallel); o and down
end a branch (row-parallel). So each all-reduce moves b x s x h numbers, two per block in the forward and,
with q/k/v and gate/up fused as Megatron does, two in the backward.
"""
from __future__ import annotations

from helpers.memory.formulas import bytes_per_param, zero_model_states
from helpers.model import llama_param_count

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # take the block's (whole) input
ROW_PARALLEL = ("o_proj", "down_proj")                                     # give the block's output


def held_formula(vocab: int, n_layer: int, n_embd: int, tp: int, replicas: int, stage: int, precision: str) -> dict:
    """Bytes of model states per rank: the tensor-parallel shard (split linears / tp + what stays whole), then
    ZeRO over the replicas on that shard (the paper's Fig. 1 with DeepSpeed's bytes per parameter)."""
    counts = llama_param_count(vocab, n_layer, n_embd)
    shard = counts["split"] // tp + counts["whole"]
    param, grad, optimizer = bytes_per_param(precision, stage)
    states = zero_model_states(shard, replicas, stage, param, grad, optimizer)
    return {"params per rank": shard, **{k: states[k] for k in ("params", "optimizer")}}


def activation_all_reduces(n_layer: int, fused: bool) -> dict:
    """All-reduces of b x s x h activations per step: one per row-parallel linear forward, one per
    column-parallel linear backward (with `fused`, one per fused group: q/k/v and gate/up, as Megatron),
    plus the column-parallel LM head's backward. fused=False is what AutoTP does: it keeps HF's separate linears."""
    column = 2 if fused else len(COLUMN_PARALLEL)
    return {"forward": len(ROW_PARALLEL) * n_layer, "backward": column * n_layer + 1}


def comm_rows(result: dict) -> list[dict]:
    """One logged step of one rank: the activation all-reduces (counted by their size, b x s x h elements)
    and the LM head's all-gather beside the formulas; the bytes of all the other collectives logged (the
    data-parallel group's gradients and parameters, the head's gather, scalars)."""
    from helpers.precision import ELEMENT_BYTES
    n_layer, n_embd = model_shape(result)
    element = ELEMENT_BYTES[result["precision"]]
    activation = result["micro_batch"] * result["seq_len"] * n_embd * element
    head = result["micro_batch"] * result["seq_len"] * (result["vocab_size"] // result["tp_size"]) * element
    rows = []
    for run in result["runs"]:
        logged = run["comm_logged"]
        autotp, megatron = (sum(activation_all_reduces(n_layer, fused).values()) for fused in (False, True))
        count = logged.get("all_reduce", {}).get(str(activation), 0)
        everything = sum(int(size) * n for sizes in logged.values() for size, n in sizes.items())
        rows.append({"stage": run["stage"], "activation all-reduce bytes": activation, "count logged": count,
                     "count formula (AutoTP)": autotp, "count formula (Megatron, fused)": megatron,
                     "LM head all-gather bytes (formula)": head,
                     "LM head all-gathers logged at that size": logged.get("all_gather_into_tensor", {}).get(str(head), 0),
                     "other collectives, bytes": everything - count * activation})
    return rows


def model_shape(result: dict) -> tuple[int, int]:
    from helpers.model import MODEL_SIZES
    n_layer, n_embd, _ = MODEL_SIZES[result["model_size"]]
    return n_layer, n_embd


def held_rows(results: dict[str, list]) -> list[dict]:
    """Per layout ({name: [rank results]}) and ZeRO stage, rank 0's model-state bytes beside the formula."""
    rows = []
    for name, ranks in results.items():
        r = ranks[0]
        replicas = r["world_size"] // r["tp_size"]
        for run in r["runs"]:
            want = held_formula(r["vocab_size"], *model_shape(r), r["tp_size"], replicas, run["stage"], r["precision"])
            rows.append({"layout": name, "stage": run["stage"], "params per rank (formula)": want["params per rank"],
                         "param bytes": run["held_bytes"]["params"], "param bytes (formula)": want["params"],
                         "optimizer bytes": run["held_bytes"]["optimizer"], "optimizer bytes (formula)": want["optimizer"]})
    return rows
