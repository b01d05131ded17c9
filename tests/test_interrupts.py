"""Stop at any moment loses nothing (issue 29), in this process on one rank: a SIGINT (what Colab's and
Jupyter's Stop button sends) lands inside a forward, a backward, between two accumulated micro-batches, or
right after `engine.step()` before the trainer recorded the step; `train()` again must then give the losses
of a run that was never stopped, bitwise on a CPU. The 2-rank script under torchrun and the deepspeed
launcher, SIGTERM and exit: tests/test_preemption.py."""
import os
import random
import signal
import threading

import pytest

from helpers.checkpoints import find_checkpoint
from helpers.data import SyntheticTextDataset
from helpers.interrupts import StopRequested, agreed_stop, holding_signals
from tests.trainers import make_trainer

STEPS, ACCUM = 6, 2


@pytest.fixture(autouse=True)
def python_handlers():
    """Python's own SIGINT/SIGTERM handlers for each test: what ran before in this process may have left others."""
    own = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    previous = {s: signal.signal(s, handler) for s, handler in own.items()}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


@pytest.fixture(scope="module")
def data():
    return SyntheticTextDataset("markov", n_samples=128, seq_len=16, seed=0)


@pytest.fixture(scope="module")
def straight(data):
    """Losses of runs never stopped, per ZeRO stage."""
    return {stage: [m["loss"] for m in make_trainer(data, zero_stage=stage, grad_accum=ACCUM).train(STEPS, progress=False)]
            for stage in (0, 3)}


@pytest.fixture
def late_signals():
    """A SIGINT that lands after train() returned reaches this handler, not the test as a KeyboardInterrupt."""
    late = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: late.append(signum))
    yield late
    signal.signal(signal.SIGINT, previous)


def train_through_stops(trainer) -> list[int]:
    """Train to STEPS, calling train() again after every Stop, as a reader re-running the cell; the steps stopped at."""
    stops = []
    while trainer.step < STEPS:
        try:
            trainer.train(STEPS - trainer.step, progress=False)
        except StopRequested as stop:
            stops.append(stop.step)
    return stops


def interrupt_at_call(obj, method: str, call: int, before: bool) -> None:
    """SIGINT to this process at the `call`-th call of obj.method (0-based), before or after it runs."""
    original, calls = getattr(obj, method), [0]

    def wrapped(*args, **kwargs):
        hit, calls[0] = calls[0] == call, calls[0] + 1
        if hit and before:
            os.kill(os.getpid(), signal.SIGINT)
        out = original(*args, **kwargs)
        if hit and not before:
            os.kill(os.getpid(), signal.SIGINT)
        return out
    setattr(obj, method, wrapped)


_draw = random.Random(29)   # seeded: the same moments on every machine, any of the run's 12 micro-batches
MOMENTS = [   # (stage, method of the engine, SIGINT before or after it runs, at its call number)
    (0, "backward", True, _draw.randrange(STEPS * ACCUM)),      # the loss computed, its backward not yet run
    (0, "step", False, 2 * _draw.randrange(STEPS) + 1),         # right after a step's last engine.step(), before
                                                                # the trainer recorded it (the 8-vs-7 case)
    (3, "backward", False, 2 * _draw.randrange(STEPS)),         # mid-accumulation: the first micro-batch's
                                                                # gradients partitioned, not yet applied
    (3, "forward", True, _draw.randrange(STEPS * ACCUM)),       # ZeRO-3 gathers parameters for the forward
]


@pytest.mark.parametrize("stage, where, before, call", MOMENTS,
                         ids=[f"zero{s}-{w}-{'before' if b else 'after'}-call{c}" for s, w, b, c in MOMENTS])
def test_a_stop_at_any_moment_continues_exactly(data, straight, late_signals, stage, where, before, call):
    trainer = make_trainer(data, zero_stage=stage, grad_accum=ACCUM)
    target = (trainer.engine, where)
    interrupt_at_call(*target, call=call, before=before)
    stops = train_through_stops(trainer)
    assert stops == [call // ACCUM + 1]   # the step it landed in finished, then the run stopped
    assert [m["step"] for m in trainer.history] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in trainer.history] == straight[stage]   # bitwise: as if never stopped
    assert trainer.batches.position == STEPS * ACCUM and not late_signals


def test_a_stop_from_a_timer_at_a_random_moment_continues_exactly(data):
    """A SIGINT from another thread, as the kernel's Stop arrives, with Python's own handler outside train(): had
    it landed outside the hold, it would raise here; inside, the losses must be those of the straight run."""
    steps = 30   # the timer's 0-0.1 s fall inside them on any machine
    expected = [m["loss"] for m in make_trainer(data, zero_stage=0, grad_accum=ACCUM).train(steps, progress=False)]
    trainer = make_trainer(data, zero_stage=0, grad_accum=ACCUM)
    timer = threading.Timer(random.Random(29).uniform(0, 0.1), os.kill, (os.getpid(), signal.SIGINT))
    stops = []
    timer.start()
    while trainer.step < steps:
        try:
            trainer.train(steps - trainer.step, progress=False)
        except StopRequested as stop:
            stops.append(stop.step)
    timer.join()
    assert len(stops) == 1 and [m["loss"] for m in trainer.history] == expected


def test_a_signal_outside_any_step_is_raised_again_on_leaving():
    with pytest.raises(KeyboardInterrupt):
        with holding_signals():
            os.kill(os.getpid(), signal.SIGINT)   # noted, and no step boundary acted on it
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_stop_acted_on_is_not_raised_again():
    with holding_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)   # a launcher's second delivery
        assert agreed_stop() == signal.SIGTERM
    assert agreed_stop() is None   # nothing held any more


def test_a_trainer_in_another_thread_trains_without_holding(data):
    """Only the main thread may set signal handlers: elsewhere train() runs, holding nothing."""
    trainer, done = make_trainer(data, zero_stage=0), []
    thread = threading.Thread(target=lambda: done.append(len(trainer.train(2, progress=False))))
    thread.start()
    thread.join()
    assert done == [2] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_that_ends_a_save_leaves_the_previous_checkpoint_latest(data, tmp_path):
    """Outside train() Python's own handler raises; in the middle of a save (DeepSpeed's files written, `latest`
    not yet switched) `latest` must still name the previous, complete checkpoint."""
    trainer = make_trainer(data, zero_stage=1)
    trainer.train(1, progress=False)
    first = trainer.save_checkpoint(tmp_path)
    trainer.train(1, progress=False)
    interrupt_at_call(trainer.engine, "save_checkpoint", call=0, before=False)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(tmp_path)
    assert (tmp_path / "step2").is_dir() and find_checkpoint(tmp_path, zero_stage=1) == first


def test_keep_last_deletes_the_oldest_of_the_trainers_checkpoints_only(data, tmp_path):
    trainer = make_trainer(data, zero_stage=0)
    (tmp_path / "step1_universal").mkdir(parents=True)   # e.g. a ds_to_universal output beside them: not ours
    for _ in range(4):
        trainer.train(1, progress=False)
        trainer.save_checkpoint(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step1_universal", "step3", "step4"]
    assert find_checkpoint(tmp_path).name == "step4"
