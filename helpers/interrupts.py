"""Stop between optimizer steps, never inside one: Colab's and Jupyter's Stop button (SIGINT), Ctrl-C, and
the SIGTERM a scheduler or a spot VM sends before it takes the machine away.

Python's default SIGINT handler raises KeyboardInterrupt wherever the main thread is: inside backward, between
two accumulated micro-batches, or after `engine.step()` but before the trainer has recorded the step. The
engine, the LR schedule, the data position and the history then disagree, and running the cell again does
not continue the run. While `holding_signals()` is active, SIGINT and SIGTERM are only noted; the training
loop asks `agreed_stop()` at each step boundary and stops there, on every rank at the same step.

Every further signal is held too, until the step and the save after it are done: launchers deliver two
(Ctrl-C under torchrun reaches each rank as SIGINT from the terminal and again as torchrun's SIGTERM; the
deepspeed launcher sends SIGTERM to ranks that got the group's signal already). What ends a step that hangs
is SIGKILL, which torchrun and the deepspeed launcher send 30 s after their SIGTERM; a checkpoint that was
being written then is never named by `latest` (helpers.checkpoints.save).
"""
from __future__ import annotations

import contextlib
import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_held: list[int] | None = None   # the signals noted so far; None while no one holds them
_acted = False   # a step boundary stopped for them: later ones (a launcher's second delivery) change nothing


class StopRequested(KeyboardInterrupt):
    """Raised at the step boundary after a SIGINT or SIGTERM, with history, engine step, LR schedule and data
    position in agreement (a KeyboardInterrupt, so `except Exception` does not swallow a Stop)."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        self.checkpoint = None   # where the script saved the run before exiting (helpers/programs/train.py)
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}, the step it was in finished "
                         "and recorded: train() again continues exactly where it stopped")


@contextlib.contextmanager
def holding_signals():
    """Within: SIGINT and SIGTERM are noted, not acted on. A nested use shares the outer one. On leaving, a
    signal no step boundary acted on is raised again, with the handlers of before. Signal handlers belong to
    the main thread: in another one this holds nothing."""
    global _held, _acted
    if _held is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    _held, _acted = [], False
    previous = {s: signal.signal(s, lambda signum, frame: _held.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        pending, _held = _held, None
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending and not _acted:
            signal.raise_signal(pending[0])


def agreed_stop() -> int | None:
    """At a step boundary: the signal to stop for, the same on every rank (the largest number any rank
    noted; one all-reduce of one number when there are several ranks), or None to go on."""
    global _acted
    import torch
    import torch.distributed as dist
    from helpers.runtime import collective_device
    mine = _held[0] if _held else 0
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([mine], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        mine = int(flag.item())
    _acted = _acted or bool(mine)
    return mine or None
