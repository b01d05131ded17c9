"""Pipeline parallelism, the schedule side: the bubble formula, DeepSpeed's own 1F1B training schedule as a
table, a timer for the instructions a pipeline engine really runs, and a replay of the schedule that says
where a measured step's idle time went. (The model is helpers/programs/pipeline.py; launching it and
comparing with the unsplit run is helpers.topics.pipeline.)

Events (measured or replayed) are dicts {"name": instruction, "mb": micro-batch, "start", "end",
"cpu_s"}; a step is one list of them per stage.
"""
from __future__ import annotations

import time
from itertools import islice
from statistics import median

from helpers.errors import require_positive_int

# Instruction types of deepspeed.runtime.pipe.schedule, grouped by what the stage is doing.
COMPUTE = ("ForwardPass", "BackwardPass")
RECEIVES = {"RecvActivation": ("SendActivation", -1), "RecvGrad": ("SendGrad", +1)}   # the send, from stage +-1


# ---- the bubble ----

def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Share of a training step each stage idles while the pipeline fills and drains: (p-1)/(m+p-1)
    (GPipe, Huang et al. 2019, section 2.3; PipeDream-Flush/1F1B, Narayanan et al. 2021, has the same).

    Assumes every stage takes the same time per micro-batch. p=1 has no bubble; more micro-batches
    shrink it. stages = p (pipeline stages), micro_batches = m (micro-batches per optimizer step).
    """
    require_positive_int("stages", stages)
    require_positive_int("micro_batches", micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


# ---- DeepSpeed's training schedule ----

PASS_OF = {"LoadMicroBatch": "ForwardPass", "RecvActivation": "ForwardPass", "ForwardPass": "ForwardPass",
           "SendActivation": "ForwardPass", "RecvGrad": "BackwardPass", "BackwardPass": "BackwardPass",
           "SendGrad": "BackwardPass"}   # the pass each instruction serves; the rest serve the whole batch


def micro_batch_ids(names: list[str]) -> list[int | None]:
    """The micro-batch each instruction works on, from their order alone.

    1F1B runs the forwards in micro-batch order and the backwards too, so the k-th ForwardPass is
    micro-batch k; a load or receive belongs to the pass after it, a send to the pass before it.
    """
    passes_done = {"ForwardPass": 0, "BackwardPass": 0}
    ids = []
    for name in names:
        kind = PASS_OF.get(name)   # None: ReduceTiedGrads, ReduceGrads, OptimizerStep
        ids.append(None if kind is None else passes_done[kind] - name.startswith("Send"))
        if name in passes_done:
            passes_done[name] += 1
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
    """Per stage, for one step (stage_events[s]: stage s's `InstructionTimer.take()`): the span from the first
    forward to the last backward on any stage (the optimizer step is not pipeline time), and the share of it
    the stage was idle, outside a ForwardPass or BackwardPass."""
    compute = [[e for e in events if e["name"] in COMPUTE] for events in stage_events]
    if not all(compute):
        raise ValueError("every stage needs at least one ForwardPass/BackwardPass event for the step")
    start = min(e["start"] for events in compute for e in events)
    span = max(e["end"] for events in compute for e in events) - start
    rows = []
    for stage, (events, busy_events) in enumerate(zip(stage_events, compute)):
        busy = sum(e["end"] - e["start"] for e in busy_events)
        rows.append({"stage": stage, "span_s": span, "idle_fraction": (span - busy) / span,
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


def bubble_rows(results: dict, warmup: int = 1) -> list[dict]:
    """Per m and stage of `helpers.topics.pipeline.run`'s results: the bubble formula, DeepSpeed's schedule, this
    run's work replayed on that schedule (with instant hand-offs, and with this run's median hand-off), and
    the measured idle share; each the median over the steps after `warmup`."""
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
                "forward ms": 1e3 * median(r["forward_s"] for r in mine),
                "backward ms": 1e3 * median(r["backward_s"] for r in mine)})
    return rows
