"""A GPU step waits for the device at every host read of a tensor's value. The plain PyTorch loop reads one
(its loss) plus what transformers reads in every forward; the trainer must not read more than DeepSpeed itself
does. Counted on the CPU, where the same Python runs (tests/host_reads.py), per step after two warm-up steps."""
import tempfile
from pathlib import Path

import pytest
import torch

from helpers.config import build_config
from helpers.data import SyntheticTextDataset
from helpers.model import build_model
from helpers.trainer import AdvancedDeepSpeedTrainer
from tests.host_reads import counted_reads

STEPS = 3


@pytest.fixture(scope="module")
def data():
    return SyntheticTextDataset("markov", n_samples=256, seq_len=32, seed=0)


def per_step(train) -> tuple[float, dict]:
    train(2)   # warm-up: lazy state (Adam's moments, DeepSpeed's buffers) is built here
    with counted_reads() as seen:
        train(STEPS)
    return sum(seen.values()) / STEPS, dict(seen)


@pytest.fixture(scope="module")
def plain(data):
    """The loop a reader writes by hand: forward, backward, clip, fused AdamW, and the loss read to print it."""
    model = build_model(data.vocab_size, 32, "tiny", data.tokenizer.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), 1e-3, fused=True)
    ids = torch.stack([data[i]["input_ids"] for i in range(8)])

    def train(steps):
        for _ in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
    return per_step(train)


def trainer(data, config) -> AdvancedDeepSpeedTrainer:
    return AdvancedDeepSpeedTrainer(data, config, model_size="tiny", output_dir=Path(tempfile.mkdtemp()))


def config(stage, precision="fp32", **extra):
    return build_config(micro_batch=8, zero_stage=stage, precision=precision, device="cpu", warmup_steps=2,
                        total_steps=40, extra=extra or None)


AUTOCAST = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
# DeepSpeed's own reads beyond the loop's, per step: ZeRO 1-2 check the gradient norm and (in 16 bits) an
# overflow flag (stage_1_and_2.py, runtime/utils.py is_invalid_grad_norm); ZeRO 0 with fp32 weights reads none.
CASES = {"ZeRO 0 fp32": (config(0), 0), "ZeRO 0 torch_autocast bf16": (config(0, **AUTOCAST), 0),
         "ZeRO 1 fp32": (config(1), 2), "ZeRO 2 fp32": (config(2), 2),
         "ZeRO 1 bf16": (config(1, "bf16"), 3), "ZeRO 2 bf16": (config(2, "bf16"), 3)}


@pytest.mark.parametrize("case", CASES)
def test_the_trainer_reads_no_more_than_the_plain_loop_and_deepspeed_itself(data, plain, case):
    cfg, deepspeeds = CASES[case]
    t = trainer(data, cfg)
    reads, where = per_step(lambda n: t.train(n, progress=False))
    t.engine.destroy()
    assert reads == plain[0] + deepspeeds, (reads, where, plain)
    assert not any("timer" in w for w in where), where   # the throughput timer is off: no device waits


def test_the_16_bit_wrapper_at_zero_0_reads_a_flag_per_parameter(data, plain):
    """Why the trainer's bf16 runs on a GPU may prefer torch_autocast at ZeRO 0: DeepSpeed's FP16_UnfusedOptimizer
    checks each parameter's gradient for overflow with its own host read (runtime/utils.py has_overflow_serial)."""
    t = trainer(data, config(0, "bf16"))
    reads, where = per_step(lambda n: t.train(n, progress=False))
    n_params = sum(1 for _ in t.engine.module.parameters())
    t.engine.destroy()
    per_parameter = sum(c for w, c in where.items() if w.startswith("deepspeed/runtime/utils.py:293")) / STEPS
    assert per_parameter == n_params and reads > plain[0] + n_params, (where, n_params)


def test_deepspeeds_throughput_timer_waits_twice_a_step_unless_turned_off(data):
    cfg = config(0) | {"timers": {"throughput": {"enabled": True}}}   # DeepSpeed's default
    t = trainer(data, cfg)
    _, where = per_step(lambda n: t.train(n, progress=False))
    t.engine.destroy()
    waits = sum(c for w, c in where.items() if w.startswith("deepspeed/utils/timer.py"))
    assert waits == 2 * STEPS, where   # forward start and step end (ThroughputTimer.start / stop)
