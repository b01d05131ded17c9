"""Checkpoints that a crash cannot break: write every rank's files, then switch `latest`.

DeepSpeed 0.19's `save_checkpoint` lets rank 0 write `latest` as soon as its *own* files are on
disk, before the other ranks have finished theirs (engine.py: no barrier before the write), and the
write itself is not atomic. A crash during a save could leave `latest` naming an incomplete
checkpoint, or an empty `latest`. Here the ranks save with save_latest=False, wait for each other,
and rank 0 replaces `latest` atomically (write a temporary file, then os.replace). On load, the
checkpoint `latest` names is checked against the run (ZeRO stage, world size, precision, model shape)
and for every rank's files before DeepSpeed reads it, and a file DeepSpeed cannot read is reported as
such: never a silent fresh start.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

from .config import zero_stage_of
from .errors import InputError
from .precision import precision_of


# Input errors, like a bad config: the entry points show them as one line naming the fix.

class CheckpointNotFoundError(InputError):
    """Asked to resume from a place that holds no complete DeepSpeed checkpoint."""


class CheckpointCorruptError(InputError):
    """A checkpoint's files exist but DeepSpeed cannot read them."""


class CheckpointMismatchError(InputError):
    """A checkpoint written with other settings (ZeRO stage, world size, precision, model) than the run's."""


def save(engine, directory: str | Path, tag: str, client_state: dict, keep_last: int = 0) -> Path:
    """Save on every rank, then point `latest` at `tag` once all ranks' files are written; then delete all
    but the newest `keep_last` checkpoints (0: keep all)."""
    import torch.distributed as dist
    directory = Path(directory)
    # Below ZeRO 3 DeepSpeed writes rank 0's client_state only: the other ranks' own (their losses) go in it too.
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, client_state)
    engine.save_checkpoint(str(directory), tag=tag, client_state={**client_state, "every_rank": every_rank},
                           save_latest=False)
    dist.barrier()   # every rank's files are on disk before any rank may call the checkpoint complete
    if dist.get_rank() == 0:
        write_latest(directory, tag)
        if keep_last:
            prune(directory, keep_last)
    dist.barrier()
    return directory / tag


def prune(directory: Path, keep: int) -> list[Path]:
    """Delete the trainer's checkpoints (step<N>) in `directory` but the `keep` written last (`latest`'s among
    them); return what went. Written last, not highest step: a run resumed from an older tag keeps its own
    newest. Other folders (a ds_to_universal output beside them) are never touched."""
    import re
    import shutil
    latest = (directory / "latest").read_text().strip()
    tags = sorted((p for p in directory.iterdir() if p.is_dir() and re.fullmatch(r"step\d+", p.name)),
                  key=lambda p: (p.name == latest, p.stat().st_mtime_ns), reverse=True)
    for old in tags[keep:]:
        shutil.rmtree(old)
    return tags[keep:]


def write_latest(directory: Path, tag: str) -> None:
    """Replace `latest` in one step: a reader sees the old tag or the new one, never half a file."""
    tmp = directory / f".latest.{os.getpid()}.tmp"
    tmp.write_text(tag)
    os.replace(tmp, directory / "latest")


def find_checkpoint(directory: str | Path, zero_stage: int | None = None, world_size: int = 1) -> Path:
    """The checkpoint directory `latest` points to (or `directory` itself, when it is one, e.g. the output
    of ds_to_universal), checked for completeness when zero_stage is given; a clear error otherwise."""
    directory = Path(directory)
    latest = directory / "latest"
    if not latest.is_file() and any(directory.glob("*model_states.pt")):
        return directory
    if not latest.is_file():
        raise CheckpointNotFoundError(
            f"no DeepSpeed checkpoint in {directory} (no 'latest' file): pass the directory "
            "given to save_checkpoint, or resume_from=None to start fresh")
    tag = latest.read_text().strip()
    if not tag or "/" in tag:
        raise CheckpointNotFoundError(f"{latest} holds {tag!r}, not a checkpoint tag: write the tag of a complete "
                                      f"checkpoint into it (available: {available_tags(directory)})")
    tag_dir = directory / tag
    if not tag_dir.is_dir():
        raise CheckpointNotFoundError(f"{latest} names '{tag}', which is missing from {directory} "
                                      f"(available: {available_tags(directory)})")
    if zero_stage is not None:
        check_complete(tag_dir, zero_stage, world_size)
    return tag_dir


def check_complete(tag_dir: Path, zero_stage: int, world_size: int) -> None:
    """A complete DeepSpeed checkpoint (one mp rank) has the module states and, at ZeRO >= 1, one optimizer
    partition per data-parallel rank (file names prefixed `bf16_` in bf16: matched by their endings)."""
    expected = ["mp_rank_00_model_states.pt"]
    if zero_stage >= 1:
        expected += [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)]
    names = [p.name for p in tag_dir.iterdir()] if tag_dir.is_dir() else []
    missing = [f for f in expected if not any(n.endswith(f) for n in names)]
    if missing:
        raise CheckpointNotFoundError(f"checkpoint {tag_dir} is incomplete, missing {missing}: it was not fully "
                                      f"written; resume from another tag (available: {available_tags(tag_dir.parent)})")


def saved_settings(tag_dir: Path) -> dict:
    """What the checkpoint was written with, from DeepSpeed's model-states file, after checking that the
    files of that ZeRO stage and world size are all there. `universal`: ds_to_universal's output, whose
    zero/ folder holds every parameter's full optimizer state."""
    import torch
    files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    if not files:
        check_complete(tag_dir, 0, 1)   # names the missing file
    try:
        state = torch.load(files[0], map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise unreadable(tag_dir, err) from err
    config = state["ds_config"]
    saved = {"zero stage": zero_stage_of(config), "world size": state["dp_world_size"],
             "precision": precision_of(config),
             "shapes": parameter_shapes(state), "universal": (tag_dir / "zero").is_dir(),
             "batches": state.get("batches")}   # the trainer's data position (client_state)
    if not saved["universal"]:
        check_complete(tag_dir, saved["zero stage"], saved["world size"])
    return saved


def run_settings(module, config: dict, world_size: int) -> dict:
    """This run's side of check_settings (under ZeRO 3 a parameter's own shape is its partition's)."""
    return {"zero stage": zero_stage_of(config), "world size": world_size, "precision": precision_of(config),
            "universal": (config.get("checkpoint") or {}).get("load_universal", False),
            "shapes": {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}}


def parameter_shapes(state: dict) -> dict:
    """name -> shape of every parameter, as named_parameters() names them: ZeRO >= 1 saves this list; at
    ZeRO 0 the module's state dict, in which a tied weight (GPT-2's lm_head) is the first name's tensor again.
    Tied means the same first element, not the same storage: DeepSpeed's FusedAdam wrapper at ZeRO 0 (a GPU's
    16-bit path) keeps every weight as a view of one flat buffer."""
    if state.get("param_shapes"):
        return {name: tuple(shape) for group in state["param_shapes"] for name, shape in group.items()}
    shapes, seen = {}, set()
    for name, tensor in state["module"].items():
        if (tensor.data_ptr(), tensor.shape) not in seen:
            seen.add((tensor.data_ptr(), tensor.shape))
            shapes[name] = tuple(tensor.shape)
    return shapes


def check_settings(tag_dir: Path, saved: dict, run: dict) -> None:
    """Raise CheckpointMismatchError naming every setting in which `run` differs from the checkpoint, and
    how to proceed, before DeepSpeed loads anything (it would fail with a misleading error, or worse not)."""
    stages = {saved["zero stage"], run["zero stage"]}
    movable = set()   # what DeepSpeed 0.19 loads under other settings (tests/test_universal_checkpoint.py)
    if saved["universal"]:   # full per-parameter states: any world size, and another stage between ZeRO 1 and 2
        movable = {"world size", "zero stage"} if stages <= {1, 2} else {"world size"}
    elif stages == {0}:   # nothing is partitioned: the whole optimizer state is in the model-states file
        movable = {"world size"}
    differ = [f"{k}: checkpoint {saved[k]}, this run {run[k]}" for k in ("zero stage", "world size", "precision",
              "universal") if k not in movable and saved[k] != run[k]]
    shapes = [f"{n}: checkpoint {saved['shapes'].get(n)}, this run {run['shapes'].get(n)}"
              for n in {**saved["shapes"], **run["shapes"]} if saved["shapes"].get(n) != run["shapes"].get(n)]
    if shapes:
        differ.append(f"model shape: {len(shapes)} parameters differ, e.g. {shapes[0]} (build the model the "
                      "checkpoint was written with: model_size, n_positions, vocabulary)")
    if not differ:
        return
    fix = "resume with the checkpoint's settings"
    if saved["universal"] and not run["universal"]:   # DeepSpeed reads ds_to_universal's zero/ folder only when told to
        fix += ': add "checkpoint": {"load_universal": true} to the DeepSpeed config'
    if len(stages) == 2 and not stages <= {1, 2}:
        fix += ("; DeepSpeed 0.19 cannot move a checkpoint between these stages: ds_to_universal finds no optimizer "
                "partitions in a ZeRO-0 checkpoint (\"can't find *_optim_states.pt files\"), a ZeRO-0 engine reads its "
                "optimizer state from the model-states file, where ZeRO 1-3 store none ('NoneType' object has no "
                "attribute 'copy'), and ZeRO 3 names its model-states files per rank, so a universal checkpoint "
                "fails between ZeRO 1/2 and 3 on `assert len(self.ckpt_list) > 0`")
    elif any(d.startswith(("zero stage", "world size")) for d in differ):
        fix += (", or, to change the ZeRO stage (between 1 and 2) or the world size, convert it to a universal "
                f"checkpoint and resume from that: python -m deepspeed.checkpoint.ds_to_universal --input_folder "
                f"{tag_dir} --output_folder {tag_dir}_universal --inject_missing_state")
    raise CheckpointMismatchError(f"checkpoint {tag_dir} was written with other settings than this run's: "
                                  f"{'; '.join(differ)}. To proceed, {fix}")


def available_tags(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


def load(engine, tag_dir: Path) -> dict:
    """DeepSpeed's load_checkpoint, with its two quiet failures made loud: it returns (None, None) with
    only a warning when it finds nothing, and raises unpickling errors that do not say which checkpoint.
    The client_state returned is this rank's own, as it saved it."""
    import torch.distributed as dist
    try:
        path, client_state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise unreadable(tag_dir, err) from err
    if path is None:   # DeepSpeed only warns here; a fresh start would lose the run
        raise CheckpointNotFoundError(f"DeepSpeed could not load a checkpoint from {tag_dir}")
    every_rank = client_state.get("every_rank") or []   # rank 0's alone on other ranks than the save's
    return every_rank[dist.get_rank()] if len(every_rank) == dist.get_world_size() else client_state


def unreadable(tag_dir: Path, err: Exception) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"checkpoint {tag_dir} could not be read ({type(err).__name__}: {err}): a file is "
                                  f"truncated or corrupt; resume from another tag "
                                  f"(available: {available_tags(tag_dir.parent)})")
