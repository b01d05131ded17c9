"""Checkpoints that a crash cannot break: write every rank's files, then switch `latest`.

DeepSpeed 0.19's `save_checkpoint` lets rank 0 write `latest` as soon as its *own* files are on
disk, before the other ranks have finished theirs (engine.py: no barrier before the write), and the
write itself is not atomic. A crash during a save could leave `latest` naming an incomplete
checkpoint, or an empty `latest`. Here the ranks save with save_latest=False, wait for each other,
and rank 0 replaces `latest` atomically (write a temporary file, then os.replace). On load, the
checkpoint `latest` names is checked for every rank's files before DeepSpeed reads it, and a file
DeepSpeed cannot read is reported as such: never a silent fresh start.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path


class CheckpointNotFoundError(FileNotFoundError):
    """Asked to resume from a place that holds no complete DeepSpeed checkpoint."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint's files exist but DeepSpeed cannot read them."""


def save(engine, directory: str | Path, tag: str, client_state: dict) -> Path:
    """Save on every rank, then point `latest` at `tag` once all ranks' files are written."""
    import torch.distributed as dist
    directory = Path(directory)
    engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()   # every rank's files are on disk before any rank may call the checkpoint complete
    if dist.get_rank() == 0:
        write_latest(directory, tag)
    dist.barrier()
    return directory / tag


def write_latest(directory: Path, tag: str) -> None:
    """Replace `latest` in one step: a reader sees the old tag or the new one, never half a file."""
    tmp = directory / f".latest.{os.getpid()}.tmp"
    tmp.write_text(tag)
    os.replace(tmp, directory / "latest")


def expected_files(zero_stage: int, world_size: int) -> list[str]:
    """File-name endings a complete DeepSpeed checkpoint has (one mp rank): the module states, and at
    ZeRO >= 1 one optimizer partition per data-parallel rank (prefixed `bf16_` in bf16)."""
    files = ["mp_rank_00_model_states.pt"]
    if zero_stage >= 1:
        files += [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)]
    return files


def missing_files(tag_dir: Path, zero_stage: int, world_size: int) -> list[str]:
    names = [p.name for p in tag_dir.iterdir()] if tag_dir.is_dir() else []
    return [f for f in expected_files(zero_stage, world_size) if not any(n.endswith(f) for n in names)]


def find_checkpoint(directory: str | Path, zero_stage: int | None = None, world_size: int = 1) -> Path:
    """The checkpoint directory `latest` points to, checked for completeness when zero_stage is given;
    a clear error naming what is wrong otherwise."""
    directory = Path(directory)
    latest = directory / "latest"
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
    missing = missing_files(tag_dir, zero_stage, world_size) if zero_stage is not None else []
    if missing:
        raise CheckpointNotFoundError(f"checkpoint {tag_dir} is incomplete, missing {missing}: it was not fully "
                                      f"written; resume from another tag (available: {available_tags(directory)})")
    return tag_dir


def available_tags(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


def load(engine, tag_dir: Path) -> dict:
    """DeepSpeed's load_checkpoint, with its two quiet failures made loud: it returns (None, None) with
    only a warning when it finds nothing, and raises unpickling errors that do not say which checkpoint."""
    try:
        path, client_state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise CheckpointCorruptError(f"checkpoint {tag_dir} could not be read ({type(err).__name__}: {err}): a file "
                                     f"is truncated or corrupt; resume from another tag "
                                     f"(available: {available_tags(tag_dir.parent)})") from err
    if path is None:   # DeepSpeed only warns here; a fresh start would lose the run
        raise CheckpointNotFoundError(f"DeepSpeed could not load a checkpoint from {tag_dir}")
    return client_state
