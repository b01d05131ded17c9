"""A plain PyTorch loop vs AdvancedDeepSpeedTrainer, in one process, on identical work.

    python -m benchmarks.trainer_vs_plain [--steps 30 --rounds 3 --stages 0 1 ...]

Same model init (build_model, same seed), data order (ResumableBatches, same seed), batch, fp32, and
optimizer math: torch AdamW with the config's hyperparameters, a LambdaLR reproducing DeepSpeed's
WarmupDecayLR update for update, clip_grad_norm_ at the same clip.
Timing: one warm-up block each, then contenders alternate in rounds of one --steps block each (plain,
ds0 | ds0, plain | ...), so machine noise hits all alike; we report the median tokens/s over rounds and
the median of the per-round speed ratios to plain. A block's wall clock covers all a contender does per
step (data, forward, backward, clip, update, loss sync, the trainer's logging).
MFU = achieved / peak fp32 matmul FLOP/s (best of measurements between rounds), with
    FLOPs per token = 6*N + 12*n_layer*n_embd*seq_len
(forward + backward; the second term is attention; N = parameters except the position embeddings,
which do no matmul; the tied token embedding counts once, as the LM-head matmul).
Memory: peak RSS is one number shared by every contender in the process, so per contender we count the
bytes of the tensors it has allocated and keeps between steps (parameters, optimizer state, buffers;
on a CPU, pages never touched are not resident).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
import warnings
from pathlib import Path

import torch

from helpers.batches import ResumableBatches
from helpers.data import SyntheticTextDataset
from helpers.memory import storage_bytes
from helpers.runtime import detect
from helpers.trainer import MODEL_SIZES, AdvancedDeepSpeedTrainer, build_model

BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.01  # what helpers.config.build_config writes


def warmup_decay(k: int, warmup: int, total: int) -> float:
    """LR factor of update k (0-based) under DeepSpeed's linear WarmupDecayLR: update 0 runs at the min lr
    set at init, update k at iteration k-1 of the schedule (so the first two updates have lr 0)."""
    if k == 0:
        return 0.0
    i, warmup = k - 1, max(2, warmup)   # DeepSpeed raises warmup_num_steps to at least 2
    return i / warmup if i < warmup else max(0.0, (total - i) / max(1.0, total - warmup))


class Plain:
    """The baseline: the loop a reader would write by hand."""

    def __init__(self, data, a, device: str):
        self.name, self.device, self.clip, self.losses, self.lrs = "plain", device, a.grad_clip, [], []
        self.model = build_model(data.vocab_size, data.seq_len, a.model_size, data.tokenizer.pad_token_id,
                                 a.seed).to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), a.lr, BETAS, EPS, WEIGHT_DECAY)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda k: warmup_decay(k, a.warmup, a.total))
        self.batches = ResumableBatches(data, a.micro_batch, a.seed)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.lrs.append(self.opt.param_groups[0]["lr"])
            ids = self.batches.next().to(self.device)
            loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.losses.append(loss.item())   # one host sync per step, like the trainer

    def state(self):
        return list(self.model.parameters()), self.opt


class DeepSpeed:
    """AdvancedDeepSpeedTrainer at one ZeRO stage."""

    def __init__(self, data, a, stage: int):
        self.name, self.losses, self.lrs, self.in_step_s = f"ds{stage}", [], [], 0.0
        self.trainer = AdvancedDeepSpeedTrainer(
            data, zero_stage=stage, precision="fp32", micro_batch=a.micro_batch, grad_accum=1, lr=a.lr,
            warmup_steps=a.warmup, total_steps=a.total, grad_clip=a.grad_clip, seed=a.seed,
            model_size=a.model_size, output_dir=Path(a.out).parent / "trainer_vs_plain" / self.name)

    def train(self, steps: int) -> None:
        metrics = self.trainer.train(steps, progress=False)
        self.losses += [m["loss"] for m in metrics]
        self.lrs += [m["lr"] for m in metrics]
        self.in_step_s += sum(m["step_s"] for m in metrics)   # the trainer's own clock: train_step only

    def state(self):
        return list(self.trainer.engine.module.parameters()), self.trainer.engine.optimizer


def tensor_bytes(*roots) -> int:
    """Bytes of the distinct tensor storages reachable from roots through containers and the
    attributes of torch.optim / DeepSpeed objects (where ZeRO keeps its flat buffers)."""
    seen, tensors, todo = set(), [], list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            todo += [obj.grad] if obj.grad is not None else []
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set)):
            todo += obj
        elif type(obj).__module__.startswith(("torch.optim", "deepspeed")) and hasattr(obj, "__dict__"):
            todo += vars(obj).values()
    return storage_bytes(tensors)   # each storage once: views and tied weights share one


def matmul_flops(n: int, device: str, repeats: int = 5) -> float:
    """Peak fp32 FLOP/s of an n x n matmul here: the best of a few, as noise only slows it down."""
    a, b, best = torch.randn(n, n, device=device), torch.randn(n, n, device=device), float("inf")
    for _ in range(repeats + 1):   # the first also warms up the BLAS
        start = time.perf_counter()
        (a @ b)[0, 0].item()       # .item() waits for a GPU to finish
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in [("--steps", 30), ("--rounds", 3), ("--seq-len", 64), ("--micro-batch", 16),
                          ("--n-samples", 2048), ("--seed", 0), ("--threads", torch.get_num_threads()),
                          ("--matmul-size", 2048)]:
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES))
    p.add_argument("--stages", type=int, nargs="+", default=[0], help="ZeRO stages to run")
    p.add_argument("--out", default="runs/benchmarks/trainer_vs_plain.json")
    a = p.parse_args(argv)
    a.total = a.steps * (a.rounds + 1)   # the LR schedule spans the warm-up block and every round
    a.warmup = max(1, a.total // 10)
    return a


def main(argv=None) -> dict:
    a, start = parse(argv), time.perf_counter()
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # ZeRO's collectives
    runtime = detect()
    if runtime.precision != "fp32":   # the plain loop does fp32 math only; DeepSpeed's bf16 differs
        print(f"note: the trainer would pick {runtime.precision} here; both contenders run fp32")
    data = SyntheticTextDataset(n_samples=a.n_samples, seq_len=a.seq_len, seed=a.seed)
    contenders = [Plain(data, a, runtime.device)] + [DeepSpeed(data, a, s) for s in a.stages]
    torch.set_num_threads(a.threads)   # after engine setup, which could change it: all run alike
    peaks = [matmul_flops(a.matmul_size, runtime.device)]
    for c in contenders:               # warm-up block: allocator, kernels, optimizer state
        c.train(a.steps)
        c.in_step_s = 0.0
    walls = {c.name: [] for c in contenders}
    for r in range(a.rounds):   # reversed every other round (ABBA), so no one always runs first
        for c in contenders if r % 2 == 0 else contenders[::-1]:
            t = time.perf_counter()
            c.train(a.steps)
            walls[c.name].append(time.perf_counter() - t)
        peaks.append(matmul_flops(a.matmul_size, runtime.device))   # a busy box only lowers it: keep the max
    return report(a, contenders, walls, max(peaks), time.perf_counter() - start)


def report(a, contenders, walls, peak, seconds, k=5, tol=1e-3) -> dict:
    plain, tokens = contenders[0], a.steps * a.micro_batch * a.seq_len
    n_layer, n_embd, _ = MODEL_SIZES[a.model_size]
    n = sum(p.numel() for p in plain.model.parameters()) - plain.model.transformer.wpe.weight.numel()
    fpt = 6 * n + 12 * n_layer * n_embd * a.seq_len
    rows = {}
    for c in contenders:
        rate = statistics.median(tokens / w for w in walls[c.name])
        rows[c.name] = {
            "tokens_per_s": rate, "tokens_per_s_rounds": [tokens / w for w in walls[c.name]],
            # Median of per-round ratios: blocks of one round ran back to back, under the same noise.
            "vs_plain": statistics.median(p / w for p, w in zip(walls["plain"], walls[c.name])),
            "mfu": rate * fpt / peak,
            "state_mib": tensor_bytes(*c.state()) / 2**20, "final_loss": c.losses[-1], "losses": c.losses,
            "max_loss_diff_first_steps": max(abs(x - y) for x, y in zip(c.losses[:k], plain.losses[:k])),
            "max_loss_diff_all_steps": max(abs(x - y) for x, y in zip(c.losses, plain.losses)),
            "max_lr_diff": max(abs(x - y) for x, y in zip(c.lrs, plain.lrs)),
            # Share of the timed blocks inside the trainer's train_step; the rest is its per-step logging.
            "train_step_share": c.in_step_s / sum(walls[c.name]) if c is not plain else None}
    result = {"config": vars(a), "matmul_flops": peak, "flops_per_token": fpt, "n_params_matmul": n,
              "flops_formula": "6*N + 12*n_layer*n_embd*seq_len", "threads": torch.get_num_threads(),
              "process_peak_rss_mib_shared": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
              "first_losses_agree": all(r["max_loss_diff_first_steps"] <= tol for r in rows.values()),
              "wall_s": seconds, "contenders": rows}
    print_table(result, min(k, len(plain.losses)), tol)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def print_table(r: dict, k: int, tol: float) -> None:
    c, rows = r["config"], r["contenders"]
    print(f"\n{c['model_size']} GPT-2, seq {c['seq_len']}, micro-batch {c['micro_batch']}, fp32, {r['threads']} "
          f"threads; median of {c['rounds']} alternating rounds x {c['steps']} steps. Matmul peak "
          f"{r['matmul_flops'] / 1e9:.1f} GFLOP/s; FLOPs/token = {r['flops_formula']} = "
          f"{r['flops_per_token'] / 1e6:.2f} M (N = {r['n_params_matmul']:,}).\n")
    print(f"| contender | tokens/s | vs plain | MFU | train state MiB | max Δloss first {k} | "
          f"final loss (step {len(rows['plain']['losses'])}) |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['tokens_per_s']:,.0f} | {row['vs_plain']:.2f}x | {row['mfu']:.1%} | "
              f"{row['state_mib']:.1f} | {row['max_loss_diff_first_steps']:.1e} | {row['final_loss']:.4f} |")
    worst = max(row["max_loss_diff_all_steps"] for row in rows.values())
    print(f"\nLargest loss difference from plain over all {len(rows['plain']['losses'])} steps: {worst:.1e}.")
    print(f"First {k} losses agree with plain within {tol:g}: {'yes' if r['first_losses_agree'] else 'NO'}. "
          f"Process peak RSS {r['process_peak_rss_mib_shared']:.0f} MiB (one number shared by all contenders).")
    for name, row in rows.items():
        if row["train_step_share"] is not None:
            print(f"{name}: {row['train_step_share']:.0%} of its timed blocks inside train_step, rest logging.")
    print(f"Total {r['wall_s']:.0f} s; results in {c['out']}")


if __name__ == "__main__":
    main()
