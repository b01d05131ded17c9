"""Inference with DeepSpeed (notebook 08): a model served two ways, each checked against the plain model.

    torchrun --nproc_per_node 2 -m helpers.programs.inference --out runs/inference
    torchrun --nproc_per_node 2 -m helpers.programs.inference --out runs/served --model gpt2 --model-size small \
        --weights runs/zero3/16bit/pytorch_model.bin --parts zero     # the GPT-2 that helpers.programs.zero3 saved

1. ZeRO-Inference: `deepspeed.initialize` with ZeRO-3, `offload_param` to the CPU and no optimizer. Each rank
   keeps 1/N of every parameter in host memory and gathers a layer's weights only while it runs, so a model
   larger than one device can generate. Greedy `generate(..., synced_gpus=True)`: under ZeRO-3 every forward
   is a collective, so a rank that is done keeps stepping until all are.
2. AutoTP: `deepspeed.init_inference(model, tensor_parallel={"tp_size": t})` cuts each linear layer into t
   pieces, one per rank, and all-reduces the partial outputs: every rank holds ~1/t of the linear weights.

Each rank also builds the plain model (same weights, same dtype, whole) and runs the same greedy generation
and probe batch, and records per rank: the generated tokens of each and whether they match, the largest logit
difference, the parameter elements (ZeRO) or bytes (AutoTP) it holds, which layers AutoTP replaced, and
tokens per second (measured, never asserted: on a CPU the gathers and all-reduces cost more than they save).
--weights loads a state dict (torch.save or DeepSpeed's save_16bit_model) instead of the seeded random weights;
--prompts data takes the prompts (and the probe batch) from the toy language helpers.programs.zero3 trains on, and
records them and every continuation as text, decoded with that data's tokenizer.
--model gpt2 serves a GPT-2 (what the other programs train) through ZeRO-Inference only: DeepSpeed's AutoTP
refuses GPT-2 ("AutoTP not supported for model. Please use kernel injection"), and kernel injection needs CUDA.
"""
import argparse
import os
import time
from pathlib import Path

import deepspeed
import torch
from transformers import set_seed

from helpers.errors import integer
from helpers.launch import save_config, write_result
from helpers.model import MODEL_SIZES, build_llama, build_model
from helpers.precision import add_precision_flag, dtype, logit_tolerance, precision_block
from helpers.programs.tensor_parallel import replaced_layers   # what AutoTP replaced, as notebook 07 showed it
from helpers.runtime import rank_process, resolve_precision


PARTS = ("zero", "autotp")   # ZeRO-Inference, AutoTP: in this order


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tp-size", type=integer(1), default=2, help="ranks that split each linear layer (AutoTP)")
    p.add_argument("--model-size", default="tiny", choices=sorted(MODEL_SIZES))
    p.add_argument("--vocab", type=integer(2), default=4096)
    p.add_argument("--prompt-len", type=integer(1), default=16)
    p.add_argument("--new-tokens", type=integer(1), default=16, help="tokens each prompt is continued by")
    p.add_argument("--batch", type=integer(1), default=2, help="prompts generated together")
    add_precision_flag(p)
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--weights", default=None, help="a state dict file (torch.save / save_16bit_model) to load")
    p.add_argument("--model", default="llama", choices=("llama", "gpt2"), help="the architecture served")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS), help="the ways it is served")
    p.add_argument("--prompts", default="random", choices=("random", "data"),
                   help="random token ids, or the starts of sentences of the data helpers.programs.zero3 trains on")
    return p.parse_args(argv)


def main(argv=None):
    # DeepSpeed's CPU all-reduce (shm_interface.cpp) sizes its shared-memory ring by LOCAL_SIZE, which only the
    # deepspeed launcher sets; under torchrun it is missing and AutoTP's all-reduce segfaults. Set before init.
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    a = parse(argv)
    with rank_process() as world:   # quiet logs, the launcher's group; at the end a barrier and the group's end
        check_options(a, world)
        set_seed(a.seed)
        precision = resolve_precision(a.precision)
        ids, probe, tokenizer = prompts(a)   # the same prompts on every rank
        device = deepspeed.get_accelerator().current_device_name()
        plain = load_model(a).to(device, dtype(precision))   # the reference: the whole model on every rank
        plain_tokens, plain_speed = timed_generate(plain, ids.to(plain.device), a.new_tokens)
        with torch.no_grad():
            plain_logits = plain(input_ids=probe.to(plain.device)).logits.float().cpu()
        _, plain_margins = teacher_forced(plain, ids.to(plain.device), plain_tokens)
        plain_bytes = parameter_bytes(plain)
        del plain
        served = {}
        if "zero" in a.parts:
            served["zero"] = zero_inference(a, precision, ids, probe, plain_tokens, plain_logits)
        if "autotp" in a.parts:
            served["autotp"] = autotp_inference(a, precision, ids, probe, plain_tokens, plain_logits, plain_margins)
        write_result(a.out, {"plain": {"tokens": plain_tokens, "tokens_per_s": plain_speed, "bytes": plain_bytes},
                             **served, "logit_tolerance": logit_tolerance(precision), "model": a.model,
                             "weights": a.weights, "prompt": ids.tolist(), "texts": texts(tokenizer, ids, plain_tokens, served),
                             "world_size": world, "tp_size": a.tp_size, "precision": precision,
                             "device": deepspeed.get_accelerator().device_name(), "model_size": a.model_size,
                             "vocab_size": a.vocab, "new_tokens": a.new_tokens, "batch": a.batch})


def check_options(a, world_size: int) -> None:
    """ValueError, before any rank starts, for what DeepSpeed would refuse or hang on inside one."""
    if a.model == "gpt2" and "autotp" in a.parts:
        raise ValueError("parts=autotp with model=gpt2: DeepSpeed's AutoTP refuses GPT-2 (it asks for kernel injection, "
                         "CUDA only); serve GPT-2 with parts=zero, or AutoTP with model=llama")
    if "autotp" in a.parts and a.tp_size != world_size:
        raise ValueError(f"tp_size={a.tp_size} is not the {world_size} ranks: init_inference makes one tensor-parallel "
                         f"group, ranks 0..tp_size-1; launch {a.tp_size} ranks or set tp_size={world_size}")
    n_head = MODEL_SIZES[a.model_size][2]
    if "autotp" in a.parts and n_head % a.tp_size:
        raise ValueError(f"tp_size={a.tp_size} does not divide the {n_head} attention heads of model size "
                         f"{a.model_size!r}: AutoTP hands out whole heads; use a divisor of {n_head}")
    if a.weights is not None and not Path(a.weights).is_file():
        raise ValueError(f"weights={a.weights!r} is not a file: give a state dict saved by torch.save or "
                         f"save_16bit_model, or leave weights out for the seeded random model")
    if a.prompts == "data" and a.vocab < prompt_data(a).vocab_size:
        raise ValueError(f"prompts=data with vocab={a.vocab}: the data has {prompt_data(a).vocab_size} tokens; "
                         f"use vocab >= {prompt_data(a).vocab_size}")
    if a.weights is not None:
        load_model(a)   # weights that do not fit the sizes given are refused here, naming them


def prompt_data(a):
    """The toy language helpers.programs.zero3 trains on (its defaults: 256 samples of 64 tokens, the same seed)."""
    from helpers.data import SyntheticTextDataset
    return SyntheticTextDataset("markov", n_samples=256, seq_len=64, seed=a.seed)


def prompts(a):
    """The prompts and the probe batch (batch x prompt_len ids each), the same on every rank, and the tokenizer
    that reads them (None for random ids)."""
    if a.prompts == "data":
        data = prompt_data(a)
        rows = torch.stack([data[i]["input_ids"][:a.prompt_len] for i in range(2 * a.batch)])   # sentences' starts
        return rows[:a.batch], rows[a.batch:], data.tokenizer
    generator = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(a.vocab, (a.batch, a.prompt_len), generator=generator)
    return ids, torch.randint(a.vocab, (a.batch, a.prompt_len), generator=generator), None


def load_model(a):
    """The model every part starts from: seeded random weights, or --weights loaded over them."""
    state = None if a.weights is None else torch.load(a.weights, map_location="cpu", weights_only=True)
    if a.model == "llama":
        model = build_llama(a.vocab, a.prompt_len + a.new_tokens, a.model_size, seed=a.seed)
    else:   # GPT-2 learns a table of positions: as many as the weights have (prompt + new tokens must fit in it)
        if state is not None and "transformer.wpe.weight" not in state:
            raise ValueError(f"weights={a.weights!r} hold no GPT-2 position table (transformer.wpe.weight): "
                             f"give a GPT-2's state dict, or model=llama for a Llama's")
        positions = a.prompt_len + a.new_tokens if state is None else len(state["transformer.wpe.weight"])
        model = build_model(a.vocab, positions, a.model_size, seed=a.seed)
    if state is not None:
        try:
            model.load_state_dict(state)   # 16-bit values cast in
        except RuntimeError as e:
            raise ValueError(f"weights={a.weights!r} do not fit model={a.model} model_size={a.model_size} vocab={a.vocab}: "
                             f"give the sizes it was trained with ({str(e).splitlines()[-1].strip()[:120]})") from None
    return model.eval()


def zero_inference_config(precision: str) -> dict:
    """ZeRO-3 with the parameters offloaded to the CPU, and nothing for training: no optimizer, no scheduler."""
    return {
        "train_micro_batch_size_per_gpu": 1,   # never used, but DeepSpeed refuses a config without a batch size
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "stage3_param_persistence_threshold": 0},   # split the norms too (default: <1e5 whole)
        "steps_per_print": 10**9,
        **precision_block(precision),   # bf16: DeepSpeed casts the module; fp32: no block
    }


@torch.no_grad()
def timed_generate(model, ids, new_tokens: int, **kwargs) -> tuple[list, float]:
    """Greedy continuation of `ids` (the prompt dropped) and the tokens per second it ran at."""
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         min_new_tokens=new_tokens, **kwargs)   # min: every run makes the same number of tokens
    seconds = time.perf_counter() - start
    return out[:, ids.shape[1]:].tolist(), ids.shape[0] * new_tokens / seconds


@torch.no_grad()
def teacher_forced(model, ids, tokens: list):
    """The greedy choice at each generated position, and its lead over the runner-up, when the model reads the
    prompt plus `tokens` (the plain model's continuation) in one forward: choices compared position by position,
    so one flipped near-tie does not make every later token differ."""
    whole = torch.cat([ids, torch.tensor(tokens, device=ids.device)], dim=1)
    logits = model(input_ids=whole).logits[:, ids.shape[1] - 1:-1].float()   # the logits that chose each token
    top2 = logits.topk(2, dim=-1).values
    return logits.argmax(-1).cpu(), (top2[..., 0] - top2[..., 1]).cpu()


def zero_elements(model) -> dict:
    """Where ZeRO-3 keeps the parameters between forwards: p.data is an empty placeholder (0 elements on the
    device), p.ds_tensor this rank's 1/N partition (on the CPU with offload_param), p.ds_numel the whole."""
    params = list(model.parameters())
    return {"device_elements": sum(p.data.numel() for p in params),
            "partition_elements": sum(p.ds_tensor.numel() for p in params),
            "full_elements": sum(p.ds_numel for p in params),
            "partition_device": sorted({p.ds_tensor.device.type for p in params})}


def zero_inference(a, precision: str, ids, probe, plain_tokens: list, plain_logits) -> dict:
    """Part 1: generate with a ZeRO-3 engine whose partitions wait in host memory."""
    # cast first, as the plain model was: ZeRO-3 casts only the parameters, and a rotary inv_freq buffer left in
    # fp32 turns positions by other angles than the plain bf16 model does (the greedy tokens then part on a near-tie)
    model = load_model(a).to(dtype(precision))
    config = zero_inference_config(precision)
    save_config(a.out, "zero_inference", config)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.module.eval()
    device_ids = ids.to(engine.device)
    # synced_gpus: each forward gathers every layer from all ranks, so all ranks must run the same forwards
    tokens, speed = timed_generate(engine.module, device_ids, a.new_tokens, synced_gpus=True)
    with torch.no_grad():   # the probe batch's logits, against the whole model's on this rank
        logits = engine.module(input_ids=probe.to(engine.device)).logits.float().cpu()
    result = {"tokens": tokens, "equal": tokens == plain_tokens, "tokens_per_s": speed,
              "max_logit_diff": (logits - plain_logits).abs().max().item(),
              **zero_elements(engine.module)}   # after generating: every gathered layer released again
    engine.destroy()
    return result


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def autotp_inference(a, precision: str, ids, probe, plain_tokens: list, plain_logits, plain_margins) -> dict:
    """Part 2: AutoTP splits a fresh copy of the same weights over tp_size ranks."""
    engine = deepspeed.init_inference(load_model(a), tensor_parallel={"tp_size": a.tp_size}, dtype=dtype(precision),
                                      replace_with_kernel_inject=False)   # AutoTP: HF's own layers, split
    model = engine.module   # the HF model, its linears replaced; generate is its own
    with torch.no_grad():
        logits = model(input_ids=probe.to(model.device)).logits.float().cpu()
    tokens, speed = timed_generate(model, ids.to(model.device), a.new_tokens)
    choices, _ = teacher_forced(model, ids.to(model.device), plain_tokens)
    # where the split sums (added in another order) pick another token: [prompt, position, the plain model's lead there]
    differs = (choices != torch.tensor(plain_tokens)).nonzero().tolist()
    differs_at = [[b, t, plain_margins[b, t].item()] for b, t in differs]
    return {"tokens": tokens, "equal": tokens == plain_tokens, "tokens_per_s": speed, "differs_at": differs_at,
            "max_logit_diff": (logits - plain_logits).abs().max().item(),
            "bytes": parameter_bytes(model), "layers": replaced_layers(model)}


def texts(tokenizer, ids, plain_tokens: list, served: dict) -> dict | None:
    """The prompts and each continuation as text, when the prompts are words of the data."""
    if tokenizer is None:
        return None
    read = lambda rows: [tokenizer.decode(row) for row in rows]
    return {"prompt": read(ids.tolist()), "plain": read(plain_tokens),
            **{part: read(result["tokens"]) for part, result in served.items()}}


if __name__ == "__main__":
    main()
