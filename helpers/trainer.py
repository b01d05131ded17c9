"""AdvancedDeepSpeedTrainer: a GPT-2-style model trained by a DeepSpeed engine, with metrics,
exact-resume checkpoints and text generation."""
from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path

import torch
from transformers import set_seed

from . import checkpoints
from .checkpoints import find_checkpoint
from .batches import ResumableBatches
from .config import micro_batch_of, validate
from .interrupts import StopRequested, agreed_stop, holding_signals
from .masters import master_weight_pairs
from .precision import precision_of
from .memory import budget
from .memory.measured import memory_mark, peak_memory
from .model import MODEL_SIZES, auto_model_size, build_model, enable_checkpointing, generate
from .runtime import (detect, init_single_process, keep_freed_memory, local_world_size, process_rank,
                      quiet_deepspeed, run_dir, world_size)

def undo_optimizer_init_step(engine) -> None:
    """Undo the step DeepSpeed 0.19's fp16/bf16 wrappers at ZeRO 0 take on zero gradients when built
    (`initialize_optimizer_states` in fp16/unfused_optimizer.py and fused_optimizer.py). ZeRO 1-3 and BF16_Optimizer
    took it too until DeepSpeed PR 5104 removed it there (commit 18179807, 2024-02-10, in v0.13.2); it left the
    stage-0 fp16/bf16 wrappers as they were, and 0.19.8 still steps in both. It counts as Adam's step 1, so
    each update takes the next step's bias correction (the first ~0.74x torch's with betas 0.9/0.95), and AdamW's
    weight decay shrinks the fp32 masters once at the full lr. Before this, the benchmark's bf16 ZeRO 0 losses
    strayed 0.42 from the plain loop's; ZeRO 1/2 (no such step) 0.05."""
    wrapper = engine.optimizer
    pairs = master_weight_pairs(wrapper)   # empty in fp32 and at ZeRO 1-3, which take no such step
    if not pairs:
        return
    with torch.no_grad():
        for master, weight in pairs:   # the masters were copied from these weights just before the step
            master.copy_(weight)
    wrapper.optimizer.state.clear()   # torch's AdamW creates its state again, at step 0, on the first real step
    for group in wrapper.optimizer.param_groups:
        group.pop("step", None)   # DeepSpeed's FusedAdam counts steps per group


class AdvancedDeepSpeedTrainer:
    """Train a GPT-2-style model on a `SyntheticTextDataset` with a DeepSpeed engine.

    Everything the reader can get wrong is checked before `deepspeed.initialize`.
    """

    def __init__(self, train_data, config: dict, *, model_size: str = "auto", n_positions: int | None = None,
                 gradient_checkpointing: bool = False, output_dir: str | Path | None = None, name: str = "run",
                 seed: int = 0, resume_from: str | Path | None = None, compile: bool = False):
        """`config` is the DeepSpeed config dict, run as written (the literal of notebook 03, a JSON file's
        contents, or helpers.config.build_config's); the arguments are what DeepSpeed does not hold."""
        self.runtime = detect()
        self.config = validate(config, device=self.runtime.device, world_size=world_size(),
                               capability=self.runtime.capability)
        self.precision = precision_of(config)
        self.model_size = auto_model_size(self.runtime) if model_size == "auto" else model_size
        self.seq_len, self.n_positions = train_data.seq_len, n_positions or train_data.seq_len
        self._check_model(model_size)
        budget.check_fits(budget.run_bytes(self.config, self.model_size, self.n_positions, self.seq_len,
                                           train_data.vocab_size, world_size(), gradient_checkpointing),
                          self.runtime.device, local_world_size())   # before the model and engine exist
        if not isinstance(compile, bool):
            raise ValueError(f"compile={compile!r}: use True (engine.compile(), torch.compile of the model) or False")
        resume_dir = find_checkpoint(resume_from) if resume_from is not None else None
        saved = checkpoints.saved_settings(resume_dir) if resume_dir is not None else None
        self.output_dir = Path(output_dir) if output_dir is not None else run_dir("trainer")
        self.name, self.gradient_checkpointing, self.compile = name, gradient_checkpointing, compile
        self.tokenizer, self.history = train_data.tokenizer, []
        self.batches = ResumableBatches(train_data, micro_batch_of(self.config, world_size()), seed,
                                        process_rank(), world_size())
        self.engine = self._build_engine(train_data.vocab_size, seed, resume_dir, saved)   # the first expensive step
        self.grad_accum = self.engine.gradient_accumulation_steps()   # DeepSpeed's reading of the dict
        if resume_dir is not None:   # its settings were checked against this run's in _build_engine
            self.batches.load_state_dict(saved["batches"])   # before the engine loads: it may refuse the position
            self.history = list(checkpoints.load(self.engine, resume_dir)["history"])

    def _check_model(self, asked_size: str) -> None:
        if self.model_size not in MODEL_SIZES:
            raise ValueError(f"model_size={asked_size!r} is not one of {sorted(MODEL_SIZES)} or 'auto'")
        if self.seq_len > self.n_positions:
            raise ValueError(f"sequence length {self.seq_len} is longer than the model's n_positions="
                             f"{self.n_positions}: raise n_positions or build the dataset with seq_len <= "
                             f"{self.n_positions}")

    def _build_engine(self, vocab_size: int, seed: int, resume_dir: Path | None = None, saved: dict | None = None):
        import deepspeed
        quiet_deepspeed()
        init_single_process()
        memory_mark(self.runtime.device)   # peak memory from here: earlier engines in this process do not count
        set_seed(seed)   # Python, NumPy and torch, so runs repeat
        if not self.runtime.is_gpu:   # every step's activations reuse the last step's pages (no page faults)
            keep_freed_memory()
        model = build_model(vocab_size, self.n_positions, self.model_size, self.tokenizer.pad_token_id, seed)
        if self.gradient_checkpointing:
            enable_checkpointing(model)
        if resume_dir is not None:   # a checkpoint of another shape is refused before the engine exists
            checkpoints.check_settings(resume_dir, saved, checkpoints.run_settings(model, self.config, world_size()))
        engine, *_ = deepspeed.initialize(model=model, config=self.config, model_parameters=model.parameters())
        undo_optimizer_init_step(engine)
        if self.compile:   # torch.compile of engine.module in place: the first step then compiles (slow, once)
            engine.compile()
        return engine

    @property
    def n_params(self) -> int:
        # Under ZeRO-3 a rank's param tensors are empty placeholders; ds_numel is the full size.
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.engine.module.parameters())

    @property
    def step(self) -> int:
        return self.engine.global_steps

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    @property
    def tensorboard_dir(self) -> Path | None:
        """Where the config's tensorboard block writes (None without one)."""
        block = self.config.get("tensorboard") or {}
        return Path(block.get("output_path") or "runs") if block.get("enabled") else None

    @property
    def tensorboard_logdir(self) -> Path | None:
        """This run's event files: the block's output_path / job_name (DeepSpeed's default name without one)."""
        block = self.config.get("tensorboard") or {}
        return self.tensorboard_dir / block.get("job_name", "DeepSpeedJobName") if self.tensorboard_dir else None

    def train_step(self) -> dict:
        """One optimizer step (grad_accum micro-batches); returns its metrics."""
        start = time.perf_counter()
        lr = self.engine.get_lr()[0]          # the rate this step's update uses
        losses, own_norm = [], None
        for micro in range(self.grad_accum):
            ids = self._to_device(self.batches.next())
            loss = self.engine(input_ids=ids, labels=ids).loss
            with self._skip_one_rank_allreduce():
                self.engine.backward(loss)
            if micro == self.grad_accum - 1 and self._engine_drops_grad_norm():
                own_norm = torch.nn.utils.get_total_norm([p.grad for p in self.engine.module.parameters()
                                                         if p.grad is not None])
            self.engine.step()
            losses.append(loss.detach())
        loss, norm = self._read(torch.stack(losses).float().mean(),
                                own_norm if own_norm is not None else self.engine.get_global_grad_norm())
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {self.step}: lower lr "
                                     f"(now {lr:g}) or enable gradient clipping")
        seconds = time.perf_counter() - start
        tokens = ids.numel() * self.grad_accum * self.engine.world_size
        metrics = {"step": self.step, "loss": loss, "lr": lr, "skipped_steps": self.engine.skipped_steps,
                   "grad_norm": norm,
                   "tokens_per_s": tokens / seconds, "step_s": seconds,
                   "memory_mb": peak_memory(self.runtime.device) / 1e6}
        if self.precision == "fp16":   # dynamic loss scaling: the scale the next step starts from
            metrics["loss_scale"] = float(self.engine.optimizer.loss_scale)
        return metrics

    def _to_device(self, ids: torch.Tensor) -> torch.Tensor:
        """A batch on the engine's device. On a GPU it goes through pinned memory, whose copy the host only queues:
        a copy from ordinary (pageable) memory makes the host wait for every kernel queued before it."""
        if self.engine.device.type == "cuda":
            return ids.pin_memory().to(self.engine.device, non_blocking=True)
        return ids.to(self.engine.device)

    @staticmethod
    def _read(loss: torch.Tensor, norm) -> tuple[float, float]:
        """The step's loss and gradient norm as numbers, in one host read (on a GPU each read waits for the
        device). DeepSpeed gives the norm as a tensor, a float, or None where it keeps none."""
        if torch.is_tensor(norm):
            loss, norm = torch.stack([loss, norm.to(loss)]).tolist()
            return loss, norm
        return loss.item(), float("nan") if norm is None else float(norm)

    def _skip_one_rank_allreduce(self):
        """At ZeRO 0 DeepSpeed all-reduces the gradients after every backward, even on one rank, where
        averaging over 1 rank changes nothing but still costs a flatten, a gloo call and a copy back of
        every gradient. engine.no_sync() is DeepSpeed's own switch for skipping it (ZeRO 1-3 need their
        reduction: it moves the gradients into their partitions)."""
        if self.engine.world_size == 1 and self.zero_stage == 0:
            return self.engine.no_sync()
        return contextlib.nullcontext()

    def _engine_drops_grad_norm(self) -> bool:
        """At ZeRO 0 in fp32 DeepSpeed clips with torch's clip_grad_norm_ but throws the norm away
        (engine._take_model_step), so get_global_grad_norm() is None there: measure it ourselves."""
        return self.zero_stage == 0 and self.precision == "fp32"

    def train(self, steps: int, progress: bool = True) -> list[dict]:
        """Run `steps` optimizer steps; metrics go to `history` and to TensorBoard. A step's `memory_mb` is
        the peak since this trainer was built (not the engines built before it in the same process).

        Stop (SIGINT) or SIGTERM ends the run after the step it arrives in, recorded (helpers.interrupts):
        StopRequested is raised there, and train() again continues as if never stopped.

        Progress: tqdm's bar in a terminal; elsewhere (a notebook, a log file) one line at each quarter of
        the run, because a saved notebook keeps every redraw of a bar, beginning with its 0% frame."""
        from tqdm import tqdm
        self.engine.train()
        new = []
        label = f"{self.name} (ZeRO {self.zero_stage})"
        in_terminal = sys.stdout.isatty()
        bar = tqdm(range(steps), desc=label, disable=not (progress and in_terminal))
        quarters = {math.ceil(steps * q / 4) for q in (1, 2, 3, 4)} if progress and not in_terminal else set()
        try:
            with holding_signals():
                for _ in bar:
                    metrics = self.train_step()
                    new.append(metrics)
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                    if len(new) in quarters:
                        print(f"{label}: step {len(new)}/{steps}, loss {metrics['loss']:.3f}, "
                              f"{metrics['tokens_per_s']:,.0f} tokens/s", flush=True)
                    if len(new) % self.LOG_EVERY == 0:
                        self._log(new[-self.LOG_EVERY:])
                    if (stop := agreed_stop()) is not None:   # every rank stops after this same step
                        raise StopRequested(stop, self.step)
        finally:   # every step's metrics reach TensorBoard, also when a step fails or a Stop ends the run
            self._log(new[len(new) - len(new) % self.LOG_EVERY:])
            self.history += new
        return new

    # DeepSpeed's TensorBoard monitor flushes the event file on every write: batching the writes
    # keeps disk I/O out of the step loop without dropping a single scalar.
    LOG_EVERY = 50

    def _log(self, steps: list[dict]) -> None:
        events = [(f"train/{k}", v, m["step"]) for m in steps for k, v in m.items() if k != "step"]
        if events and self.engine.monitor.enabled:   # only where the config has a monitor block
            self.engine.monitor.write_events(events)

    @torch.no_grad()
    @torch.compiler.set_stance("force_eager")   # a few batches: not worth compiling an eval-mode graph for
    def evaluate(self, data, max_batches: int = 16) -> float:
        """Mean next-token loss (nats/token) on `data`, without updating anything."""
        self.engine.eval()
        # A small held-out set (a slice of your own text) may hold fewer rows than one micro-batch.
        batches = ResumableBatches(data, min(self.engine.train_micro_batch_size_per_gpu(), len(data)), seed=0)
        n = min(max_batches, batches.batches_per_epoch)
        losses = [self.engine(input_ids=(ids := batches.next().to(self.engine.device)), labels=ids).loss
                  for _ in range(n)]
        self.engine.train()
        return torch.stack(losses).float().mean().item()

    def save_checkpoint(self, directory: str | Path | None = None, keep_last: int = 0) -> Path:
        """Save engine, optimizer, LR schedule and data position; `latest` switches only once every
        rank's files are written (helpers.checkpoints), so a crash mid-save leaves the previous one.
        keep_last: then delete all but the newest this many (0: keep all)."""
        directory = Path(directory or self.output_dir / "checkpoints")
        state = {"batches": self.batches.state_dict(), "history": self.history}
        return checkpoints.save(self.engine, directory, f"step{self.step}", state, keep_last)

    @torch.compiler.set_stance("force_eager")   # every new length would compile again
    def generate(self, prompt: str, max_new_tokens: int = 40, seed: int = 0) -> str:
        self.engine.eval()
        text = generate(self.engine.module, self.tokenizer, prompt, max_new_tokens, seed)
        self.engine.train()
        return text

    def summary(self, skip_first: int = 1) -> dict:
        """Throughput and memory over the run so far (the first step, which warms caches, left out)."""
        steady = self.history[skip_first:] or self.history
        tokens = sum(m["tokens_per_s"] * m["step_s"] for m in steady)
        seconds = sum(m["step_s"] for m in steady)
        return {"steps": len(self.history), "final_loss": self.history[-1]["loss"],
                "tokens_per_s": tokens / seconds, "peak_memory_mb": max(m["memory_mb"] for m in steady),
                "params": self.n_params, "precision": self.precision, "model_size": self.model_size}
