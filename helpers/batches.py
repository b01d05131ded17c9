"""Micro-batches in an order that depends only on (seed, position), so a checkpoint can resume it.

A PyTorch DataLoader's shuffle order lives in an iterator nobody saves; after a resume it starts
over and the model sees different data than a straight run would. Here the order is a pure
function of the seed and the number of micro-batches already served, and that number goes into
the checkpoint.
"""
from __future__ import annotations

import hashlib

import torch

from helpers.checkpoints import CheckpointMismatchError
from helpers.errors import require_positive_int


class ResumableBatches:
    def __init__(self, dataset, micro_batch: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        require_positive_int("micro_batch", micro_batch)
        # Materialise once: the tutorial's datasets are small and indexing one tensor is fast.
        self.tokens = torch.stack([dataset[i]["input_ids"] for i in range(len(dataset))])
        self.batches_per_epoch = len(self.tokens) // (micro_batch * world_size)
        if self.batches_per_epoch == 0:
            raise ValueError(f"dataset has {len(self.tokens)} samples, fewer than one global micro-batch "
                             f"({micro_batch} x {world_size} ranks): make the dataset larger or the batch smaller")
        self.micro_batch, self.seed, self.rank, self.world_size = micro_batch, seed, rank, world_size
        self.position = 0   # micro-batches this rank has consumed
        self._order = (None, None)  # (epoch, permutation) cache

    def permutation(self, epoch: int) -> torch.Tensor:
        if self._order[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.tokens), generator=gen))
        return self._order[1]

    def next(self) -> torch.Tensor:
        """The next micro-batch of token ids for this rank, shape (micro_batch, seq_len)."""
        epoch, k = divmod(self.position, self.batches_per_epoch)
        start = (k * self.world_size + self.rank) * self.micro_batch
        self.position += 1
        return self.tokens[self.permutation(epoch)[start:start + self.micro_batch]]

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "micro_batch": self.micro_batch,
                "world_size": self.world_size, "n_samples": len(self.tokens), "tokens_sha256": self.fingerprint()}

    def fingerprint(self) -> str:
        """Which token ids these are: a resume on other text (or the same text tokenised otherwise) of
        the same size would otherwise continue at the right position in the wrong data."""
        return hashlib.sha256(self.tokens.numpy().tobytes()).hexdigest()

    def load_state_dict(self, state: dict) -> None:
        """Continue after the last sample the checkpoint's ranks drew: position p of W ranks x micro_batch mb
        is p*W*mb samples into the order, the same on any (W', mb') that divides it with the same epoch."""
        mine, saved = {"seed": self.seed, "n_samples": len(self.tokens)}, {k: state[k] for k in ("seed", "n_samples")}
        if saved != mine:
            raise CheckpointMismatchError(f"checkpoint's data order {saved} differs from this run's {mine}: "
                                          "resume with the same seed and dataset size")
        if "tokens_sha256" in state and state["tokens_sha256"] != self.fingerprint():   # checkpoints before it lack it
            raise CheckpointMismatchError("the checkpoint was trained on other token ids than this run's data "
                                          f"(both {len(self.tokens)} rows): resume with the same data, seq_len and tokenizer")
        step, saved_step = self.micro_batch * self.world_size, state["micro_batch"] * state["world_size"]
        consumed, epoch = state["position"] * saved_step, len(self.tokens) // saved_step * saved_step
        if consumed % step or epoch != self.batches_per_epoch * step:
            raise CheckpointMismatchError(
                f"the checkpoint's {state['world_size']} ranks x micro_batch {state['micro_batch']} drew {consumed} "
                f"samples, in epochs of {epoch}: {self.world_size} ranks x micro_batch {self.micro_batch} cannot "
                f"continue there (epochs of {self.batches_per_epoch * step}); choose a micro_batch x ranks that divides both")
        self.position = consumed // step
