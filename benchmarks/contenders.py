"""The contenders of benchmarks.trainer_vs_plain: one training setup, three ways to run it.

Each is built inside its own worker process (benchmarks.workers) from the same `Setup` and `TokenData`:
the same model init (build_model, same seed), the same micro-batches in the same order
(ResumableBatches, same seed), precision, and AdamW math (betas, eps, weight decay, warm-up then linear
decay, clipping at the same norm). Each offers train(k) (k optimizer steps), losses/lrs (one per step so
far), state() (the tensors it keeps between steps) and finish().
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.batches import ResumableBatches
from helpers.model import build_model
from helpers.runtime import keep_freed_memory
from helpers.config import build_config
from helpers.hf_trainer import matching_arguments
from helpers.runtime import detect
from helpers.trainer import AdvancedDeepSpeedTrainer

BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.01  # what helpers.config.build_config writes


@dataclass(frozen=True)
class Setup:
    """What every contender shares."""
    device: str
    precision: str      # "fp32" or "bf16"
    model_size: str     # a key of helpers.model.MODEL_SIZES
    micro_batch: int
    lr: float
    warmup: int         # warm-up steps of the LR schedule
    total: int          # steps the LR schedule (and the whole run) spans
    grad_clip: float
    seed: int
    threads: int        # torch intra-op threads in every worker
    out_dir: str        # where workers write logs, TensorBoard files and HF Trainer's output


class TokenData(torch.utils.data.Dataset):
    """The token ids and tokenizer of a SyntheticTextDataset, which is all a contender reads: light enough
    to send to each worker instead of rebuilding the Markov source there.

    vocab_size is the model's vocabulary; above the tokenizer's it pads the embedding (50257 gives
    GPT-2 124M its real size while the data uses a few thousand words)."""

    def __init__(self, ids: torch.Tensor, tokenizer, vocab_size: int | None = None):
        if vocab_size is not None and vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens: "
                             "raise it or leave it None")
        self.ids, self.tokenizer, self.seq_len = ids, tokenizer, ids.shape[1]
        self.vocab_size = vocab_size or len(tokenizer)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def warmup_decay(k: int, warmup: int, total: int) -> float:
    """LR factor of update k (0-based) under DeepSpeed's linear WarmupDecayLR: update 0 runs at the min lr
    set at init, update k at iteration k-1 of the schedule (so the first two updates have lr 0)."""
    if k == 0:
        return 0.0
    i, warmup = k - 1, max(2, warmup)   # DeepSpeed raises warmup_num_steps to at least 2
    return i / warmup if i < warmup else max(0.0, (total - i) / max(1.0, total - warmup))


def run_config(s: Setup, stage: int, out: Path, job_name: str, autocast: bool = False) -> dict:
    """The DeepSpeed config both DeepSpeed contenders run (the trainer and HF's Trainer), this device's defaults.
    autocast: bf16 through DeepSpeed's "torch_autocast" block (fp32 weights, torch.autocast around the forward, the
    plain loop's math; runtime/torch_autocast.py) instead of its "bf16" block (16-bit weights, fp32 masters)."""
    precision = "fp32" if autocast else s.precision
    extra = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}} if autocast and s.precision == "bf16" else None
    return build_config(zero_stage=stage, precision=precision, micro_batch=s.micro_batch, lr=s.lr,
                        warmup_steps=s.warmup, total_steps=s.total, grad_clip=s.grad_clip, device=detect().device,
                        tensorboard_dir=out / "tensorboard", job_name=job_name, extra=extra)


class Plain:
    """The loop a reader writes by hand, with torch's fused AdamW (the trainer's optimizer; see
    helpers.config.build_config(device="cpu")) and bf16 through autocast when the precision is bf16; compiled, the
    model is torch.compile'd; keep_memory: glibc's malloc keeps freed memory, as the trainer has it on a CPU."""

    def __init__(self, data: TokenData, s: Setup, compile: bool = False, keep_memory: bool = False):
        self.device, self.clip, self.losses, self.lrs = s.device, s.grad_clip, [], []
        if keep_memory:
            keep_freed_memory()
        self.model = build_model(data.vocab_size, data.seq_len, s.model_size, data.tokenizer.pad_token_id,
                                 s.seed).to(s.device).train()
        if compile:   # torch.compile in place, as DeepSpeed's engine.compile() does to its module
            self.model.compile()
        self.opt = torch.optim.AdamW(self.model.parameters(), s.lr, BETAS, EPS, WEIGHT_DECAY, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda k: warmup_decay(k, s.warmup, s.total))
        self.batches = ResumableBatches(data, s.micro_batch, s.seed)
        self.autocast = torch.autocast(s.device, torch.bfloat16, enabled=s.precision == "bf16")

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def step(self) -> dict:
        """One optimizer step; returns each phase's wall seconds (benchmarks.step_phases reads them):
        step = clipping + AdamW + LR schedule + zero_grad; rest = data and the loss's host sync."""
        t0 = time.perf_counter()
        self.lrs.append(self.opt.param_groups[0]["lr"])
        ids = self.batches.next().to(self.device)
        t1 = time.perf_counter()
        with self.autocast:
            loss = self.model(input_ids=ids, labels=ids).loss
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        self.losses.append(loss.item())   # one host sync per step, like the trainer
        t5 = time.perf_counter()
        return {"forward": t2 - t1, "backward": t3 - t2, "step": t4 - t3, "rest": (t1 - t0) + (t5 - t4),
                "total": t5 - t0}

    def state(self):
        return list(self.model.parameters()), self.opt

    def finish(self) -> None:
        pass


class DeepSpeedTrainer:
    """helpers.trainer.AdvancedDeepSpeedTrainer at one ZeRO stage, with its defaults (compiled: compile=True,
    DeepSpeed's engine.compile())."""

    def __init__(self, data: TokenData, s: Setup, stage: int, compile: bool = False, autocast: bool = False):
        name = f"ds{stage}" + (AUTOCAST if autocast else "") + (COMPILED if compile else "")
        out = Path(s.out_dir) / name
        self.trainer = AdvancedDeepSpeedTrainer(data, run_config(s, stage, out, name, autocast), seed=s.seed,
                                                model_size=s.model_size, output_dir=out, name=name, compile=compile)

    def train(self, steps: int) -> None:
        self.trainer.train(steps, progress=False)

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.trainer.history]

    @property
    def lrs(self) -> list[float]:
        return [m["lr"] for m in self.trainer.history]

    def state(self):
        return list(self.trainer.engine.module.parameters()), self.trainer.engine.optimizer

    def finish(self) -> None:
        pass


class OrderedSamples(torch.utils.data.IterableDataset):
    """Samples in ResumableBatches' order, so HF's DataLoader (which does not shuffle an iterable
    dataset) forms the same micro-batches as the other contenders."""

    def __init__(self, data: TokenData, micro_batch: int, seed: int, steps: int):
        self.data, self.micro_batch, self.seed, self.steps = data, micro_batch, seed, steps

    def __iter__(self):
        batches = ResumableBatches(self.data, self.micro_batch, self.seed)
        for _ in range(self.steps):
            for ids in batches.next():
                yield {"input_ids": ids, "labels": ids}


def pause_callback():
    """A TrainerCallback that holds HF's training loop between blocks of steps (a class made here so
    transformers is imported only in the process that runs HF Trainer)."""
    from transformers import TrainerCallback

    class PauseBetweenBlocks(TrainerCallback):
        def __init__(self):
            self.go, self.done, self.left, self.lrs = queue.Queue(), queue.Queue(), 0, []
            self.stop = False

        def on_train_begin(self, args, state, control, **kwargs):
            self.done.put("ready")        # the DeepSpeed engine exists now
            self.left = self.go.get()

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            self.lrs.append(optimizer.param_groups[0]["lr"])   # the rate this step's update uses

        def on_step_end(self, args, state, control, **kwargs):
            self.left -= 1
            if self.left == 0:
                self.done.put("block")
                self.left = self.go.get()
            control.should_training_stop = self.stop

    return PauseBetweenBlocks()


class HFTrainer:
    """transformers.Trainer with deepspeed= the config AdvancedDeepSpeedTrainer would run (run_config),
    logging every step (as the other contenders record every step's loss); compiled: torch_compile=True.

    Trainer.train() runs to the end in one call, so it runs in a thread that a callback pauses after each
    block; train(k) lets k more steps run and waits for them.
    """

    def __init__(self, data: TokenData, s: Setup, stage: int, compile: bool = False):
        from transformers import PrinterCallback, Trainer
        from helpers.runtime import init_single_process
        init_single_process()   # the 1-rank environment a launcher would set; DeepSpeed looks for MPI without it
        out = Path(s.out_dir) / f"hf{stage}"
        self.config = run_config(s, stage, out, f"hf{stage}")
        model = build_model(data.vocab_size, data.seq_len, s.model_size, data.tokenizer.pad_token_id, s.seed)
        self.pause = pause_callback()
        self.trainer = Trainer(model=model, args=hf_arguments(self.config, s, out, compile),
                               train_dataset=OrderedSamples(data, s.micro_batch, s.seed, s.total),
                               callbacks=[self.pause])
        self.trainer.remove_callback(PrinterCallback)   # prints every log line; the others print nothing
        self.thread = threading.Thread(target=self._run, args=(s.threads,), daemon=True)
        self.thread.start()
        self._wait()                                    # until the engine is built

    def _run(self, threads: int) -> None:
        torch.set_num_threads(threads)   # a new thread starts with the machine's default
        try:
            self.trainer.train()
        except BaseException as err:     # hand it to the waiting main thread
            self.pause.done.put(err)

    def _wait(self) -> None:
        signal = self.pause.done.get()
        if isinstance(signal, BaseException):
            raise signal

    def train(self, steps: int) -> None:
        self.pause.go.put(steps)
        self._wait()

    @property
    def losses(self) -> list[float]:
        return [h["loss"] for h in self.trainer.state.log_history if "loss" in h]

    @property
    def lrs(self) -> list[float]:
        return self.pause.lrs

    def state(self):
        engine = self.trainer.deepspeed
        return list(engine.module.parameters()), engine.optimizer

    def finish(self) -> None:
        """End the loop after the step it paused in (it logs that step's loss on the way out)."""
        self.pause.stop = True
        self.pause.go.put(-1)   # never counts down to 0: no more pauses
        self.thread.join()


def hf_arguments(config: dict, s: Setup, out: Path, compile: bool = False):
    """TrainingArguments that agree with the DeepSpeed config (helpers.hf_trainer.matching_arguments), plus
    the benchmark's own: this device, seed, a log line per step, no saving."""
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=str(out), deepspeed=config, **matching_arguments(config),
        use_cpu=s.device == "cpu", seed=s.seed, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_pin_memory=False, torch_compile=compile)


COMPILED = "-compiled"   # the suffix of a compiled contender's name: plain-compiled, ds2-compiled, hf0-compiled
AUTOCAST = "-autocast"   # a trainer in bf16 through torch_autocast instead of the bf16 block: ds0-autocast
PLAIN_KEPT = "plain-kept"   # the plain loop with glibc's malloc keeping freed memory (keep_freed_memory)


def make_contender(name: str, data: TokenData, setup: Setup):
    """'plain', 'plain2' (the same loop again: a control), 'plain-kept' (the loop with the trainer's CPU
    memory setting: a control), 'ds<stage>' or 'hf<stage>'; each with the suffix '-compiled' for its
    torch.compile'd twin."""
    base, compile = name.removesuffix(COMPILED), name.endswith(COMPILED)
    if base in ("plain", "plain2", PLAIN_KEPT):
        return Plain(data, setup, compile, keep_memory=base == PLAIN_KEPT)
    if base.startswith("ds") and base.endswith(AUTOCAST) and base[2:].removesuffix(AUTOCAST).isdigit():
        return DeepSpeedTrainer(data, setup, int(base[2:].removesuffix(AUTOCAST)), compile, autocast=True)
    kinds = {"ds": DeepSpeedTrainer, "hf": HFTrainer}
    if base[:2] in kinds and base[2:].isdigit():
        return kinds[base[:2]](data, setup, int(base[2:]), compile)
    raise ValueError(f"unknown contender {name!r}: use 'plain', 'plain2', {PLAIN_KEPT!r}, 'ds0'..'ds3' (or "
                     f"'ds0{AUTOCAST}'..) or 'hf0'..'hf3', each optionally with {COMPILED!r}")
