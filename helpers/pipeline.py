"""Pipeline parallelism: GPT-2 as a list of DeepSpeed layer specs, the bubble formula, DeepSpeed's own
1F1B training schedule as a table, a timer for the instructions a pipeline engine really runs, and a
replay of the schedule that says where a measured step's idle time went.

A `PipelineModule` cuts a list of layers into stages, one per rank. Each batch is split into m
micro-batches that flow through the stages; while the pipeline fills and drains some stages wait.
With p equal stages that idle share (the "bubble") is (p - 1) / (m + p - 1) (GPipe, Huang et al. 2019,
section 2.3; PipeDream-Flush/1F1B, Narayanan et al. 2021, has the same bubble).

Events (measured or replayed) are dicts {"name": instruction, "mb": micro-batch, "start", "end",
"cpu_s"}; a step is one list of them per stage.
"""
from __future__ import annotations

import contextlib
import io
import time
from itertools import islice, pairwise

import torch
from torch import nn
from transformers import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

# Instruction types of deepspeed.runtime.pipe.schedule, grouped by what the stage is doing.
COMPUTE = ("ForwardPass", "BackwardPass")
P2P = ("RecvActivation", "SendActivation", "RecvGrad", "SendGrad")
RECEIVES = {"RecvActivation": ("SendActivation", -1), "RecvGrad": ("SendGrad", +1)}   # the send, from stage +-1
PARTITION_METHODS = ("parameters", "uniform", "type:GPT2Block")
TIED_KEY = "token_embedding"   # the input embedding and the LM head share one weight, as in GPT-2


# ---- the bubble ----

def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Share of a training step each stage idles while the pipeline fills and drains: (p-1)/(m+p-1).

    Assumes every stage takes the same time per micro-batch. p=1 has no bubble; more micro-batches
    shrink it. stages = p (pipeline stages), micro_batches = m (micro-batches per optimizer step).
    """
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {name}={value!r}")
    return (stages - 1) / (micro_batches + stages - 1)


# ---- the model as layer specs ----

def gpt2_config(vocab_size: int, n_positions: int, n_layer: int, n_embd: int, n_head: int) -> GPT2Config:
    """A GPT-2 config with dropout off (runs repeat bitwise) and torch's SDPA attention, which is causal
    without a mask. A standalone GPT2Block has no model around it to choose the attention for it."""
    return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_layer=n_layer, n_embd=n_embd,
                      n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")


class TokenEmbedding(nn.Embedding):
    """Token ids -> vectors; also the LM head's weight (see `lm_head`). Initialised like GPT-2
    (normal, std 0.02): nn.Embedding's N(0, 1) would make the tied head's first logits huge."""

    def __init__(self, vocab_size: int, n_embd: int, std: float = 0.02):
        super().__init__(vocab_size, n_embd)
        nn.init.normal_(self.weight, std=std)


class PositionEmbedding(nn.Module):
    """Adds GPT-2's learned position embedding to the token vectors."""

    def __init__(self, n_positions: int, n_embd: int, std: float = 0.02):
        super().__init__()
        self.wpe = nn.Embedding(n_positions, n_embd)
        nn.init.normal_(self.wpe.weight, std=std)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        return hidden + self.wpe(positions)


def lm_head(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """Logits from the token embedding's own weight (GPT-2's tied output layer)."""
    return nn.functional.linear(hidden, embedding.weight)


def gpt2_layer_specs(config: GPT2Config) -> list:
    """GPT-2 as the flat list of layers a PipelineModule partitions: token embedding, position
    embedding, n_layer transformer blocks, final LayerNorm, LM head.

    Nothing is built here: a LayerSpec is built only on the stage that owns it. The LM head is a
    TiedLayerSpec of the token embedding: the stage holding the head keeps its own copy of the
    embedding weight, DeepSpeed makes the copies equal at start and all-reduces their gradients
    each step (the ReduceTiedGrads instruction), so the model is exactly GPT-2 with tied weights.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    d = config.n_embd
    return [TiedLayerSpec(TIED_KEY, TokenEmbedding, config.vocab_size, d, tied_weight_attr="weight"),
            LayerSpec(PositionEmbedding, config.n_positions, d),
            *[LayerSpec(GPT2Block, config, layer_idx=i) for i in range(config.n_layer)],
            LayerSpec(nn.LayerNorm, d, eps=config.layer_norm_epsilon),
            TiedLayerSpec(TIED_KEY, TokenEmbedding, config.vocab_size, d, forward_fn=lm_head,
                          tied_weight_attr="weight")]


def layer_names(specs: list) -> list[str]:
    """A readable name per layer spec, e.g. 'GPT2Block' or 'lm_head (tied to TokenEmbedding)'."""
    names = []
    for spec in specs:
        forward_fn = getattr(spec, "forward_fn", None)
        names.append(f"{forward_fn.__name__} (tied to {spec.typename.__name__})" if forward_fn
                     else spec.typename.__name__)
    return names


def layer_param_formula(config: GPT2Config) -> list[int]:
    """Parameters of each layer of `gpt2_layer_specs`, from the shapes alone (nothing built).

    Token embedding V d, position embedding n_pos d, block 12 d^2 + 13 d (qkv 3d^2+3d, attention out
    d^2+d, MLP 4d^2+4d and 4d^2+d, two LayerNorms 4d), final LayerNorm 2d, LM head V d (the copy of
    the token embedding a stage holds when it owns the head but not the embedding).
    """
    d, vocab = config.n_embd, config.vocab_size
    return [vocab * d, config.n_positions * d, *[12 * d * d + 13 * d] * config.n_layer, 2 * d, vocab * d]


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


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: the logits at position t predict the token at t+1."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build_pipeline(specs: list, num_stages: int, partition_method: str = "parameters", seed: int = 0):
    """A PipelineModule over `specs`: this rank builds only its stage's layers.

    seed_layers=True seeds layer i with seed + i before building it, so every layer starts with the
    same weights whatever the number of stages: the unsplit model (num_stages=1) is the same model.
    partition_method: "parameters" balances parameter counts, "uniform" layer counts,
    "type:GPT2Block" the number of blocks.
    Needs a process group (a launcher, or helpers.runtime.init_single_process for one stage).
    """
    from deepspeed.pipe import PipelineModule
    if partition_method not in PARTITION_METHODS:
        raise ValueError(f"partition_method={partition_method!r} is not one of {PARTITION_METHODS}")
    with contextlib.redirect_stdout(io.StringIO()):   # DeepSpeed prints the seeds and the partition
        return PipelineModule(layers=specs, num_stages=num_stages, loss_fn=lm_loss, seed_layers=True,
                              seed_fn=seed_layer, base_seed=seed, partition_method=partition_method)


def seed_layer(seed) -> None:
    """DeepSpeed's own layer seeding, given a Python int. partition_balanced returns numpy integers as
    stage boundaries, so DeepSpeed's default seeds with numpy.int64, which random.seed refuses from
    Python 3.11 on (TypeError in PipelineModule._build)."""
    from deepspeed.runtime.utils import set_random_seed
    set_random_seed(int(seed))


class UnsplitModel(nn.Module):
    """The same layers, same seed, in one process: a one-stage PipelineModule plus the loss.

    Being a plain nn.Module (not a PipelineModule), a regular DeepSpeedEngine trains it with the
    usual forward/backward/step loop: no schedule, no point-to-point sends, no tied-weight all-reduce.
    """

    def __init__(self, specs: list, seed: int = 0):
        super().__init__()
        self.layers = build_pipeline(specs, num_stages=1, seed=seed)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.layers(input_ids), labels)


def stage_summary(module) -> dict:
    """What this rank's stage of a PipelineModule holds: its layer range, parameters, and the tied ones."""
    parts = [int(i) for i in module.partitions()]   # DeepSpeed returns numpy integers
    tied = sum(p.numel() for m in module.tied_modules.values() for p in m.parameters())
    return {"stage": module.stage_id, "parts": parts, "layers": parts[module.stage_id:module.stage_id + 2],
            "n_params": sum(p.numel() for p in module.parameters()), "tied_params": tied}


# ---- DeepSpeed's training schedule ----

def micro_batch_ids(names: list[str]) -> list[int | None]:
    """The micro-batch each instruction works on, from their order alone.

    1F1B runs the forwards in micro-batch order and the backwards too, so the k-th ForwardPass is
    micro-batch k; a receive belongs to the pass after it, a send to the pass before it.
    """
    forwards = backwards = 0
    ids = []
    for name in names:
        if name in ("RecvActivation", "LoadMicroBatch"):
            ids.append(forwards)
        elif name == "ForwardPass":
            ids.append(forwards)
            forwards += 1
        elif name == "SendActivation":
            ids.append(forwards - 1)
        elif name == "RecvGrad":
            ids.append(backwards)
        elif name == "BackwardPass":
            ids.append(backwards)
            backwards += 1
        elif name == "SendGrad":
            ids.append(backwards - 1)
        else:   # ReduceTiedGrads, ReduceGrads, OptimizerStep: the whole batch
            ids.append(None)
    return ids


def train_schedule(stages: int, micro_batches: int) -> list[list[list[str]]]:
    """DeepSpeed's own TrainSchedule: for each stage, the instruction names of each time slot.

    A slot is one step of the schedule generator; the engine runs a stage's slots in order, and
    slot t of one stage pairs its sends with the receives in slot t of its neighbours.
    """
    from deepspeed.runtime.pipe.schedule import TrainSchedule
    bubble_fraction(stages, micro_batches)   # validates both
    return [[[type(cmd).__name__ for cmd in slot] for slot in TrainSchedule(micro_batches, stages, stage)]
            for stage in range(stages)]


def schedule_table(stages: int, micro_batches: int) -> list[list[str]]:
    """Per stage, per time slot: "F3" (forward of micro-batch 3), "B3" (backward) or "" (idle)."""
    rows = []
    for slots in train_schedule(stages, micro_batches):
        program = iter(_program(slots))
        rows.append(["".join(f"{name[0]}{mb}" for name, mb in islice(program, len(slot)) if name in COMPUTE)
                     for slot in slots])
    return rows


def scheduled_bubble(stages: int, micro_batches: int) -> list[float]:
    """Per stage, the share of TrainSchedule's slots with no forward or backward in them."""
    return [row.count("") / len(row) for row in schedule_table(stages, micro_batches)]


# ---- measuring what the engine really does ----

class InstructionTimer:
    """Records start and end of every instruction one PipelineEngine executes.

    The engine runs its schedule by looking each instruction's type up in `_INSTRUCTION_MAP`
    (deepspeed/runtime/pipe/engine.py, PipelineEngine._exec_schedule). This gives the engine its own
    map whose entries time the original methods; other engines are untouched. Times come from
    time.perf_counter (CLOCK_MONOTONIC on Linux: one clock for every process on the machine, so the
    ranks of a local launch can be put on one time axis).
    """

    def __init__(self, engine):
        from deepspeed.accelerator import get_accelerator
        self._sync = get_accelerator().synchronize   # GPU work is asynchronous; a no-op on the CPU
        self.events: list[dict] = []
        engine._INSTRUCTION_MAP = {kind: self._timed(kind.__name__, method)
                                   for kind, method in type(engine)._INSTRUCTION_MAP.items()}

    def _timed(self, name: str, method):
        def run(engine, **kwargs):
            self._sync()
            start, cpu = time.perf_counter(), time.process_time()
            method(engine, **kwargs)
            self._sync()
            self.events.append({"name": name, "start": start, "end": time.perf_counter(),
                                "cpu_s": time.process_time() - cpu})
        return run

    def take(self) -> list[dict]:
        """The events since the last call, each with its micro-batch id ("mb"); then forget them."""
        events, self.events = self.events, []
        for event, mb in zip(events, micro_batch_ids([e["name"] for e in events])):
            event["mb"] = mb
        return events


def measured_bubble(stage_events: list[list[dict]]) -> list[dict]:
    """Per stage, for one training step: how long the pipeline ran, how much of it this stage computed.

    stage_events[s] is stage s's `InstructionTimer.take()` for the step. The span runs from the first
    forward on any stage to the last backward on any stage (the optimizer step after it is not
    pipeline time); a stage is idle whenever it is not inside a ForwardPass or BackwardPass.
    Also reported: time blocked in point-to-point sends and receives, one place the idle time goes.
    """
    compute = [[e for e in events if e["name"] in COMPUTE] for events in stage_events]
    if not all(compute):
        raise ValueError("every stage needs at least one ForwardPass/BackwardPass event for the step")
    start = min(e["start"] for events in compute for e in events)
    span = max(e["end"] for events in compute for e in events) - start
    rows = []
    for stage, (events, busy_events) in enumerate(zip(stage_events, compute)):
        busy = sum(e["end"] - e["start"] for e in busy_events)
        p2p = [e for e in events if e["name"] in P2P]
        rows.append({"stage": stage, "span_s": span, "busy_s": busy, "idle_s": span - busy,
                     "idle_fraction": (span - busy) / span,
                     "p2p_s": sum(e["end"] - e["start"] for e in p2p),
                     # one-thread rank below 1: the OS kept it off the CPU while it computed (a busy machine)
                     "compute_cpu_share": sum(e["cpu_s"] for e in busy_events) / busy,
                     "forward_s": _mean_duration(events, "ForwardPass"),
                     "backward_s": _mean_duration(events, "BackwardPass")})
    return rows


def _mean_duration(events: list[dict], name: str) -> float:
    times = [e["end"] - e["start"] for e in events if e["name"] == name]
    return sum(times) / len(times)


def replay_schedule(forward_s: list[list[float]], backward_s: list[list[float]],
                    handoff_s: float = 0.0) -> list[list[dict]]:
    """Run DeepSpeed's TrainSchedule on paper: each stage on a processor of its own, forward/backward of
    micro-batch k on stage s taking forward_s[s][k] / backward_s[s][k] seconds, every hand-off between
    stages `handoff_s`, everything else free.

    A stage runs its instructions in TrainSchedule's order; a receive completes `handoff_s` after the
    neighbour's send. Returns events shaped like `InstructionTimer.take()`, so `measured_bubble` and
    `helpers.plots.pipeline_timeline` apply. With equal times and no hand-off cost it reproduces (p-1)/(m+p-1); with a
    run's own measured work and hand-off time it shows where that run's idle time came from.
    """
    stages, m = len(forward_s), len(forward_s[0])
    work = {"ForwardPass": forward_s, "BackwardPass": backward_s}
    programs = [_program(slots) for slots in train_schedule(stages, m)]
    sent = [{} for _ in range(stages)]   # per stage: (send instruction, micro-batch) -> when
    events: list[list[dict]] = [[] for _ in range(stages)]
    while any(len(done) < len(program) for done, program in zip(events, programs)):
        progressed = [_run_until_blocked(s, programs[s], events[s], sent, work, handoff_s) for s in range(stages)]
        if not any(progressed):
            raise RuntimeError("the schedule deadlocked: every stage waits for a send that never comes")
    return events


def _run_until_blocked(stage: int, program: list, events: list, sent: list, work: dict, handoff_s: float) -> bool:
    """Run `stage`'s next instructions until one receives what its neighbour has not sent yet.
    Appends to `events` and `sent`; returns whether anything ran."""
    ran = False
    while len(events) < len(program):
        name, mb = program[len(events)]
        start = events[-1]["end"] if events else 0.0
        if name in RECEIVES:
            send, offset = RECEIVES[name]
            if (send, mb) not in sent[stage + offset]:
                return ran
            cpu, end = 0.0, max(start, sent[stage + offset][(send, mb)] + handoff_s)   # waits inside the receive
        else:
            cpu = work[name][stage][mb] if name in work else 0.0
            end = start + cpu
        events.append({"name": name, "mb": mb, "start": start, "end": end, "cpu_s": cpu})
        if name.startswith("Send"):
            sent[stage][(name, mb)] = end
        ran = True
    return ran


def _program(slots: list[list[str]]) -> list[tuple[str, int | None]]:
    """One stage's schedule as a flat list of (instruction, micro-batch)."""
    names = [name for slot in slots for name in slot]
    return list(zip(names, micro_batch_ids(names)))


def handoff_delays(stage_events: list[list[dict]]) -> list[float]:
    """What one hand-off between processes cost in a measured step: for every receive that was already
    waiting when the neighbour began the matching send, seconds from that send's start to the receive's
    end (the transfer, plus the waiting process waking up: a lot on a busy machine)."""
    sends = {(stage, e["name"], e["mb"]): e for stage, events in enumerate(stage_events) for e in events
             if e["name"] in ("SendActivation", "SendGrad")}
    delays = []
    for stage, events in enumerate(stage_events):
        for e in (e for e in events if e["name"] in RECEIVES):
            send_name, offset = RECEIVES[e["name"]]
            send = sends.get((stage + offset, send_name, e["mb"]))
            if send is not None and e["start"] <= send["start"]:
                delays.append(e["end"] - send["start"])
    return delays


def work_per_micro_batch(stage_events: list[list[dict]], threads: int) -> tuple[list, list]:
    """(forward, backward) seconds per stage and micro-batch of one measured step, for `replay_schedule`.

    On a one-thread rank, CPU time: what the stage computed, however long the OS kept it off the CPU on
    a busy machine. With more threads CPU time adds up over threads, so the wall time is used.
    """
    def seconds(event):
        return event["cpu_s"] if threads == 1 else event["end"] - event["start"]
    return tuple([[seconds(e) for e in events if e["name"] == name] for events in stage_events]
                 for name in COMPUTE)
