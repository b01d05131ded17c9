"""A DeepSpeed checkpoint as a Hugging Face model directory (DeepSpeed's own `zero_to_fp32` merges the ranks'
fp32 partitions), and the TensorBoard logs. From a shell, for a checkpoint of `python -m helpers.programs.train`:
    python -m helpers.export runs/train/zero3/checkpoints runs/train/zero3/hf
"""
from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import torch

from helpers.config import zero_stage_of
from helpers.checkpoints import find_checkpoint


def fp32_state_dict(checkpoint_dir: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The whole model's weights, as fp32 CPU tensors, from the directory given to save_checkpoint (tag None:
    the one `latest` names). ZeRO 1-3: DeepSpeed's zero_to_fp32 merges the ranks' fp32 partitions; ZeRO-0,
    which it does not read, keeps the module's weights whole in mp_rank_00_model_states.pt."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    tag_dir = find_checkpoint(checkpoint_dir) if tag is None else Path(checkpoint_dir) / tag
    model_files = list(tag_dir.glob("*model_states.pt"))
    if not model_files:
        raise FileNotFoundError(f"{tag_dir} holds no *model_states.pt file: is it a DeepSpeed checkpoint?")
    # Route by the stage the newest save recorded, not by which files lie around: a re-run at another
    # stage into the same directory and step leaves the other stage's files beside the new ones.
    newest = max(model_files, key=lambda p: p.stat().st_mtime_ns)
    state = torch.load(newest, map_location="cpu", weights_only=False)
    if zero_stage_of(state["ds_config"]) > 0:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):   # progress lines, a tqdm bar
            return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    return {name: t.float() if t.is_floating_point() else t for name, t in state["module"].items()}


def export_hf(checkpoint_dir: str | Path, out_dir: str | Path, tokenizer=None, model_config=None,
              tag: str | None = None) -> Path:
    """Write a DeepSpeed checkpoint (any ZeRO stage, any number of ranks) as a HF model directory, for
    `from_pretrained` and `pipeline("text-generation")`. tokenizer, model_config: the run's (None: read from
    checkpoint_dir, where helpers/programs/train.py saves both)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if model_config is None:
        model_config = AutoConfig.from_pretrained(_saved_by_train(checkpoint_dir, "config.json"))
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(_saved_by_train(checkpoint_dir, "tokenizer.json"))
    model = AutoModelForCausalLM.from_config(model_config)
    load_strict(model, fp32_state_dict(checkpoint_dir, tag))
    model.config.use_cache = True   # training may have turned the KV cache off; generation wants it
    with _quiet_transformers():
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _saved_by_train(checkpoint_dir: Path, name: str) -> Path:
    if not (checkpoint_dir / name).is_file():
        raise FileNotFoundError(f"no {name} in {checkpoint_dir}: pass tokenizer= and model_config= "
                                "(trainer.tokenizer, trainer.engine.module.config), or export a checkpoint "
                                "directory written by `python -m helpers.programs.train`, which saves both there")
    return checkpoint_dir


def load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `state` into `model`; every weight must be found, except copies of a tied weight
    (GPT-2's output layer is its token embedding, which checkpoints may store once)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = [params[k] for k in params if k not in missing]
    untied = [k for k in missing if not any(params.get(k) is p for p in loaded)]
    if untied or unexpected:
        raise ValueError(f"checkpoint does not fit the model config: missing {untied}, unexpected {unexpected}; "
                         "pass the model_config of the model that was trained")


@torch.no_grad()
def max_logit_difference(hf_dir: str | Path, engine, input_ids: torch.Tensor) -> float:
    """max |logits| difference between the exported model and the live engine on `input_ids`, the HF model
    loaded in the engine's dtype and device so both run the same kernels (0.0: identical). Under ZeRO-3 on
    several ranks every rank must call it: the engine's forward is collective."""
    from transformers import AutoModelForCausalLM
    dtype = next(engine.module.parameters()).dtype
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(engine.device).eval()
    ids = input_ids.to(engine.device)
    was_training = engine.training
    engine.eval()
    ours = engine(input_ids=ids).logits.float()
    engine.train(was_training)
    theirs = model(input_ids=ids).logits.float()
    return (ours - theirs).abs().max().item()


def read_tensorboard(logdir: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar in the event files under `logdir`: {tag: (steps, values)}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logdir = Path(logdir)
    if not any(logdir.rglob("events.out.tfevents.*")):
        raise FileNotFoundError(f"no TensorBoard event files under {logdir}: was the tensorboard monitor enabled?")
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0 = keep every point
    acc.Reload()
    return {tag: ([e.step for e in acc.Scalars(tag)], [e.value for e in acc.Scalars(tag)])
            for tag in acc.Tags()["scalars"]}


@contextlib.contextmanager
def _quiet_transformers():
    """No "Loading weights" / "Writing model shards" progress bars for a model this small."""
    from transformers.utils import logging
    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Export a DeepSpeed checkpoint written by helpers.programs.train "
                                            "as a Hugging Face model directory.")
    p.add_argument("checkpoint_dir", help="the run's checkpoints directory (holds 'latest')")
    p.add_argument("out_dir")
    p.add_argument("--tag", default=None, help="a checkpoint other than the latest, e.g. step100")
    a = p.parse_args(argv)
    print(export_hf(a.checkpoint_dir, a.out_dir, tag=a.tag))


if __name__ == "__main__":
    main()
