"""Pipeline parallelism on 2 ranks (notebook 06): GPT-2 as a list of DeepSpeed layer specs, cut into 2 stages
by a PipelineModule and trained by `engine.train_batch`, every instruction timed; or, with --unsplit, the
same layers trained whole on one rank by the usual forward/backward/step loop, for the loss comparison.

    torchrun --nproc_per_node 2 -m helpers.programs.pipeline --out runs/pipe --micro-batches 1 2 4 8
    torchrun --nproc_per_node 1 -m helpers.programs.pipeline --out runs/whole --micro-batches 1 2 4 8 --unsplit

One launch trains the pipeline once per number of micro-batches m (starting processes costs more than
training). Every micro-batch has the same size, so a stage's work per micro-batch stays the same and
only the bubble changes with m.
"""
import argparse
import contextlib
import hashlib
import io
import time
import warnings
from pathlib import Path

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from transformers import GPT2Config, set_seed
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from helpers.config import build_config
from helpers.data import SyntheticTextDataset
from helpers.errors import integer, number
from helpers.launch import save_config, write_result
from helpers.model import MODEL_SIZES
from helpers.topics.pipeline import STAGES, layer_param_formula, stage_param_formula
from helpers.topics.pipeline_schedule import InstructionTimer, bubble_fraction
from helpers.runtime import quiet_deepspeed

PARTITION_METHODS = ("parameters", "uniform", "type:GPT2Block")
TIED_KEY = "token_embedding"   # the input embedding and the LM head share one weight, as in GPT-2


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--micro-batches", type=integer(1), nargs="+", default=[1, 2, 4, 8], help="m values, one after another")
    p.add_argument("--steps", type=integer(2, "the first is warm-up"), default=8, help="optimizer steps per m (the first is warm-up)")
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES))
    p.add_argument("--n-layer", type=integer(1), default=None, help="override the size's number of blocks")
    p.add_argument("--seq-len", type=integer(2), default=64)
    p.add_argument("--micro-batch", type=integer(1), default=4, help="samples per micro-batch")
    p.add_argument("--lr", type=number(), default=3e-3)
    p.add_argument("--grad-clip", type=number(strict=False), default=0.0, help="0 = off; see CLIPPING below for why")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1), help="the pipeline engine allows <= 1")
    p.add_argument("--partition-method", default="parameters", choices=PARTITION_METHODS)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--unsplit", action="store_true", help="train the whole model on one rank instead")
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    quiet_deepspeed()
    # PipelineModule copies the tied weight into place with an in-place broadcast on the Parameter, and
    # from then on every backward warns that broadcast_ has no autograd kernel. The gradient reaching
    # the weight is unaffected (the loss matches the unsplit run to the bit), so keep the logs readable.
    warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")
    # Not runtime.rank_process: its init_single_process would also probe DeepSpeed's ops and hide init's stdout (the logs).
    deepspeed.init_distributed(verbose=False)   # rank and rendezvous from the launcher's environment
    check_options(a, torch.distributed.get_world_size())
    # Enough samples that no step of the largest m reuses one.
    data = SyntheticTextDataset("markov", n_samples=a.steps * max(a.micro_batches) * a.micro_batch,
                                seq_len=a.seq_len, seed=a.seed)
    set_seed(a.seed)
    train = train_unsplit if a.unsplit else train_pipeline
    runs = [train(a, m, data) for m in a.micro_batches]
    config = model_config(a, data.vocab_size)
    write_result(a.out, {
        "runs": runs, "unsplit": a.unsplit, "device": str(torch.device(deepspeed.get_accelerator().device_name())),
        "torch_threads": torch.get_num_threads(), "vocab_size": data.vocab_size,
        "model": {"n_layer": config.n_layer, "n_embd": config.n_embd, "n_positions": config.n_positions},
        "layer_param_formula": layer_param_formula(config),
        "data_sha1": hashlib.sha1(data[:]["input_ids"].numpy().tobytes()).hexdigest()})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()   # gloo's threads end before exit can abort them (SIGABRT)


def check_options(a, world_size: int) -> None:
    """ValueError, before any rank starts, for what would otherwise fail inside a rank."""
    for m in a.micro_batches:
        bubble_fraction(STAGES, m)
    if len(set(a.micro_batches)) != len(a.micro_batches):
        raise ValueError(f"micro_batches={a.micro_batches!r} repeats a value: list each m once")
    if world_size != (1 if a.unsplit else STAGES):
        raise ValueError(f"{'--unsplit' if a.unsplit else 'the pipeline'} runs on {1 if a.unsplit else STAGES} "
                         f"rank(s), not {world_size}")

# CLIPPING: DeepSpeed 0.19's fp32 pipeline engine clips with a norm over stage 0's gradients only:
# runtime/utils.py clip_grad_norm_ counts a parameter only on "model-parallel rank 0" unless it is
# marked model_parallel, and the pipeline grid makes the stages of one pipeline its model-parallel
# group (pipe/topology.py, ds_model_proc_group). Measured on this model: DeepSpeed clipped with 1.82
# where the norm over both stages was 2.04. The unsplit engine uses the full norm, so with clipping
# on the two runs part as soon as clipping acts (5.7e-4 in loss after 6 steps at grad_clip=0.5).


# ---- GPT-2 as layer specs: nothing is built until the stage that owns a layer builds it ----

def gpt2_config(vocab_size: int, n_positions: int, n_layer: int, n_embd: int, n_head: int) -> GPT2Config:
    """Dropout off (runs repeat bitwise) and torch's SDPA attention, which is causal without a mask
    (a standalone GPT2Block has no model around it to choose the attention for it)."""
    return GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_layer=n_layer, n_embd=n_embd,
                      n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")


class TokenEmbedding(nn.Embedding):
    """Token ids -> vectors; also the LM head's weight. GPT-2's init (normal, std 0.02): nn.Embedding's
    N(0, 1) would make the tied head's first logits huge."""

    def __init__(self, vocab_size: int, n_embd: int):
        super().__init__(vocab_size, n_embd)
        nn.init.normal_(self.weight, std=0.02)


class PositionEmbedding(nn.Module):
    """Adds GPT-2's learned position embedding to the token vectors."""

    def __init__(self, n_positions: int, n_embd: int):
        super().__init__()
        self.wpe = nn.Embedding(n_positions, n_embd)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.wpe(torch.arange(hidden.shape[1], device=hidden.device))


def lm_head(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """Logits from the token embedding's own weight (GPT-2's tied output layer)."""
    return nn.functional.linear(hidden, embedding.weight)


def gpt2_layer_specs(config: GPT2Config) -> list:
    """Token embedding, position embedding, n_layer blocks, final LayerNorm, LM head. The head is a
    TiedLayerSpec of the token embedding: the stage holding it keeps its own copy of the weight, which
    DeepSpeed makes equal at start and whose gradients it all-reduces each step (ReduceTiedGrads)."""
    d = config.n_embd
    return [TiedLayerSpec(TIED_KEY, TokenEmbedding, config.vocab_size, d, tied_weight_attr="weight"),
            LayerSpec(PositionEmbedding, config.n_positions, d),
            *[LayerSpec(GPT2Block, config, layer_idx=i) for i in range(config.n_layer)],
            LayerSpec(nn.LayerNorm, d, eps=config.layer_norm_epsilon),
            TiedLayerSpec(TIED_KEY, TokenEmbedding, config.vocab_size, d, forward_fn=lm_head,
                          tied_weight_attr="weight")]


def layer_names(specs: list) -> list[str]:
    """A readable name per layer spec, e.g. 'GPT2Block' or 'lm_head (tied to TokenEmbedding)'."""
    return [f"{s.forward_fn.__name__} (tied to {s.typename.__name__})" if getattr(s, "forward_fn", None)
            else s.typename.__name__ for s in specs]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: the logits at position t predict the token at t+1."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build_pipeline(specs: list, num_stages: int, partition_method: str = "parameters", seed: int = 0):
    """A PipelineModule over `specs`: this rank builds only its stage's layers. seed_layers=True seeds
    layer i with seed + i, so every layer starts the same whatever the number of stages."""
    if partition_method not in PARTITION_METHODS:
        raise ValueError(f"partition_method={partition_method!r} is not one of {PARTITION_METHODS}")
    with contextlib.redirect_stdout(io.StringIO()):   # DeepSpeed prints the seeds and the partition
        return PipelineModule(layers=specs, num_stages=num_stages, loss_fn=lm_loss, seed_layers=True,
                              seed_fn=seed_layer, base_seed=seed, partition_method=partition_method)


def seed_layer(seed) -> None:
    """DeepSpeed's own layer seeding, given a Python int: its default passes numpy integers (the stage
    boundaries), which random.seed refuses from Python 3.11 on (TypeError in PipelineModule._build)."""
    from deepspeed.runtime.utils import set_random_seed
    set_random_seed(int(seed))


class UnsplitModel(nn.Module):
    """The same layers, same seed, in one process: a one-stage PipelineModule plus the loss. A plain
    nn.Module, so a regular DeepSpeedEngine trains it: no schedule, no sends, no tied all-reduce."""

    def __init__(self, specs: list, seed: int = 0):
        super().__init__()
        self.layers = build_pipeline(specs, num_stages=1, seed=seed)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.layers(input_ids), labels)


def stage_summary(module) -> dict:
    """What this rank's stage holds: its layer range, parameters, and the tied ones."""
    parts = [int(i) for i in module.partitions()]   # DeepSpeed returns numpy integers
    tied = sum(p.numel() for m in module.tied_modules.values() for p in m.parameters())
    return {"stage": module.stage_id, "parts": parts, "layers": parts[module.stage_id:module.stage_id + 2],
            "n_params": sum(p.numel() for p in module.parameters()), "tied_params": tied}


# ---- training ----

def model_config(a, vocab_size: int) -> GPT2Config:
    n_layer, n_embd, n_head = MODEL_SIZES[a.model_size]
    return gpt2_config(vocab_size, a.seq_len, a.n_layer or n_layer, n_embd, n_head)


def step_micro_batches(data, step: int, m: int, size: int):
    """The m micro-batches of optimizer step `step` as (inputs, labels): the first stage reads the
    inputs, the last stage the labels. Every run (pipeline, unsplit, any m) reads them in this order."""
    for k in range(m):
        ids = data[(step * m + k) * size:(step * m + k + 1) * size]["input_ids"]
        yield ids, ids


def ds_config(a, m: int) -> dict:
    # One pipeline = one data-parallel replica, so the batch is micro_batch x m. torch's AdamW: the same
    # optimizer code in both runs (FusedAdam's CPU kernel rounds by memory layout, see build_config).
    return build_config(micro_batch=a.micro_batch, grad_accum=m, world_size=1, zero_stage=a.zero_stage,
                        precision="fp32", lr=a.lr, warmup_steps=2, total_steps=a.steps + 1,
                        grad_clip=a.grad_clip, torch_adam=True)


def train_pipeline(a, m: int, data) -> dict:
    """Train the 2-stage pipeline with m micro-batches per step; return this stage's measurements."""
    config = model_config(a, data.vocab_size)
    specs = gpt2_layer_specs(config)
    module = build_pipeline(specs, STAGES, a.partition_method, a.seed)
    ds = ds_config(a, m)
    save_config(a.out, f"pipeline_m{m}", ds)
    engine, *_ = deepspeed.initialize(model=module, config=ds,
                                      model_parameters=[p for p in module.parameters() if p.requires_grad])
    timer = InstructionTimer(engine)
    losses, step_s, events = [], [], []
    for step in range(a.steps):
        start = time.perf_counter()
        loss = engine.train_batch(step_micro_batches(data, step, m, a.micro_batch))
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())   # the last stage's mean over the m micro-batches, broadcast to all
        events.append(timer.take())
    summary = stage_summary(engine.module)
    state_file = save_weights(engine.module, a.out, f"stage{summary['stage']}_m{m}.pt")
    engine.destroy()
    start, stop = summary["layers"]
    formula = stage_param_formula(specs, summary["parts"], layer_param_formula(config))[summary["stage"]]
    return {"m": m, **summary, "layer_names": layer_names(specs)[start:stop], "params_formula": formula,
            "losses": losses, "step_s": step_s, "events": events, "bubble_formula": bubble_fraction(STAGES, m),
            "state_file": state_file}


def train_unsplit(a, m: int, data) -> dict:
    """Train the same layers whole on this one rank with the usual forward/backward/step loop."""
    model = UnsplitModel(gpt2_layer_specs(model_config(a, data.vocab_size)), seed=a.seed)
    ds = ds_config(a, m)
    save_config(a.out, f"unsplit_m{m}", ds)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    losses, step_s = [], []
    for step in range(a.steps):
        start = time.perf_counter()
        total = 0.0
        for inputs, labels in step_micro_batches(data, step, m, a.micro_batch):
            loss = engine(inputs.to(engine.device), labels.to(engine.device))
            engine.backward(loss)   # DeepSpeed divides by m and steps the optimizer after the m-th
            engine.step()
            total = total + loss.detach()   # summed in order, as the pipeline's last stage does
        step_s.append(time.perf_counter() - start)
        losses.append((total / m).item())
    n_params = sum(p.numel() for p in model.parameters())
    state_file = save_weights(model.layers, a.out, f"unsplit_m{m}.pt")
    engine.destroy()
    return {"m": m, "n_params": n_params, "losses": losses, "step_s": step_s, "state_file": state_file}


def save_weights(module, out_dir, name: str) -> str:
    """The trained weights, keyed as PipelineModule names them (layer index, or tied_modules.<key>):
    the same names in every stage and in the unsplit model."""
    path = Path(out_dir) / name
    torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, path)
    return str(path)


if __name__ == "__main__":
    main()
