"""Your own text as training data (a text file or folder, a `save_to_disk` dataset, or a hub dataset name,
online only), tokenised and packed into rows of `seq_len` tokens for the same trainer:
    train, held_out = load_own_text("my_notes.txt", seq_len=64)
Every mistake in the input is a `DataError` naming it and the fix, raised before any model is built.
"""
from __future__ import annotations

import codecs
import os
import re
import socket
from pathlib import Path

import datasets
import numpy as np
import torch

from helpers.errors import DataError
from helpers.data import train_tokenizer

WORD_LEVEL = "word-level"   # the --tokenizer that trains the project's word-level tokenizer on your text
END_OF_TEXT = "[EOS]"       # the word-level tokenizer's mark between two lines (rows) of your text
SNIFF_BYTES = 1 << 16       # how much of each file is read to tell text from binary
HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?(:[\w.-]+)?$")   # "wikitext:wikitext-2-raw-v1", "user/name"


class PackedText(torch.utils.data.Dataset):
    """Rows of `seq_len` token ids cut from one long stream of your text (no padding, nothing wasted
    but the last partial row). It has what the trainer reads from a dataset: `seq_len`, `tokenizer`,
    `vocab_size` and items {"input_ids": row}. `floor_nats` is None: real text has no known floor."""

    floor_nats = None

    def __init__(self, rows: torch.Tensor, tokenizer):
        self.rows, self.tokenizer = rows, tokenizer
        self.seq_len, self.vocab_size = rows.shape[1], len(tokenizer)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i]}


def load_own_text(source: str | Path, seq_len: int, *, tokenizer: str = WORD_LEVEL, text_column: str = "text",
                  held_out: float = 0.1, seed: int = 0, vocab_size: int = 8192) -> tuple[PackedText, PackedText]:
    """(train, held_out) from `source`. The held-out rows are drawn by `seed` (datasets'
    train_test_split), so every rank and every resumed run carves out the same ones."""
    if not isinstance(held_out, float) or not 0 < held_out < 1:
        raise DataError(f"--held-out {held_out!r} must be a fraction between 0 and 1 (e.g. 0.1)")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"--seq-len {seq_len!r} must be an integer of at least 2 (a token and the next one to predict)")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 4:
        raise DataError(f"--vocab-size {vocab_size!r} must be an integer of at least 4 (3 ids are [PAD], [UNK], [EOS])")
    texts = read_texts(source, text_column)
    tok = (train_tokenizer(texts, vocab_size=vocab_size, eos_token=END_OF_TEXT) if tokenizer == WORD_LEVEL
           else pretrained_tokenizer(tokenizer))
    rows = pack(texts, tok, seq_len)
    if len(rows) < 2:
        raise DataError(f"--data {source}: {len(rows)} row(s) of --seq-len {seq_len} tokens, and training needs "
                        "at least 2 (one to train on, one held out): use more text or a shorter --seq-len")
    split = datasets.Dataset.from_dict({"row": np.arange(len(rows))}).train_test_split(
        test_size=max(1, round(held_out * len(rows))), seed=seed)
    return tuple(PackedText(rows[split[part]["row"]], tok) for part in ("train", "test"))


def read_texts(source: str | Path, text_column: str = "text") -> list[str]:
    """The non-empty strings of `source`'s text column, in order."""
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()   # a saved notebook would keep each loader bar, rates and all
    try:
        table = _table(source)
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    texts = [t for t in _text_column(table, text_column, source) if t.strip()]
    if not texts:
        raise DataError(f"--data {source}: the text is empty (only blank lines); give it some text")
    return texts


def _table(source: str | Path):
    path = Path(source).expanduser()
    if path.is_file():
        return datasets.load_dataset("text", data_files=str(_text_file(path)), split="train")
    if path.is_dir():
        return _saved_dataset(path) if _is_saved_dataset(path) else _text_folder(path)
    if _looks_like_hub_name(str(source)):
        return _hub_dataset(str(source))
    raise DataError(f"--data {source}: no such file or folder (a text file, a folder of text files, "
                    "or a dataset saved with Dataset.save_to_disk)")


def _text_file(path: Path) -> Path:
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if not head.strip():
        raise DataError(f"--data {path}: the file is empty; give it some text")
    try:   # an incremental decoder does not fail on a character the sniffed bytes cut in half
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        binary = b"\0" in head
    except UnicodeDecodeError:
        binary = True
    if binary:
        raise DataError(f"--data {path}: not a UTF-8 text file (it looks binary, e.g. compressed or an image); "
                        "pass plain text, or a folder saved with Dataset.save_to_disk")
    return path


def _text_folder(folder: Path):
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not any(part.startswith(".")
                                                                           for part in p.relative_to(folder).parts))
    if not files:
        raise DataError(f"--data {folder}: the folder has no files; put text files in it")
    # Every file must be text: a stray binary would otherwise be read as gibberish "lines".
    return datasets.load_dataset("text", data_files=[str(_text_file(p)) for p in files], split="train")


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _saved_dataset(folder: Path):
    table = datasets.load_from_disk(str(folder))
    if isinstance(table, datasets.DatasetDict):
        if "train" not in table:
            raise DataError(f"--data {folder}: a DatasetDict without a 'train' split (it has {sorted(table)}); "
                            "save the split to train on as a Dataset, or name one 'train'")
        table = table["train"]
    return table


def _looks_like_hub_name(source: str) -> bool:
    """'user/name' or 'name' (optionally ':config'), not something that reads as a local path or file."""
    return bool(HUB_NAME.match(source)) and not source.startswith(".") and not Path(source).suffix[1:].isalpha()


def _hub_dataset(name: str):
    require_online(f"--data {name}", "pass a local text file or folder, or a dataset saved with "
                                     "Dataset.save_to_disk on a machine that is online")
    repo, _, config = name.partition(":")
    return datasets.load_dataset(repo, config or None, split="train")


def _text_column(table, column: str, source) -> list[str]:
    if column not in table.column_names:
        raise DataError(f"--data {source}: no column {column!r}; its columns are {table.column_names}: "
                        "name the one with the text (--text-column, or text_column=)")
    feature = table.features[column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        # Value('int64') as datasets 4+ writes it (3.x: "Value(dtype='int64', id=None)"): one message on every version
        shown = f"Value({feature.dtype!r})" if isinstance(feature, datasets.Value) else feature
        raise DataError(f"--data {source}: column {column!r} holds {shown}, not text: name a column of strings")
    return table[column]


def require_online(what: str, offline_alternative: str) -> None:
    """Raise DataError at once when the hub cannot be reached (HF_HUB_OFFLINE, or no route to it)."""
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or \
        os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("0", "")
    if not offline:
        try:
            socket.create_connection(("huggingface.co", 443), timeout=5).close()
        except OSError:
            offline = True
    if offline:
        raise DataError(f"{what}: not a local path, and as a name on the Hugging Face hub it needs a network "
                        f"connection this machine does not have; {offline_alternative}")


def pretrained_tokenizer(name: str):
    """A tokenizer saved with save_pretrained (a folder, e.g. a checkpoint's) or a hub name (online)."""
    from transformers import AutoTokenizer
    folder = Path(name).expanduser()
    if not folder.is_dir():
        require_online(f"--tokenizer {name}", f"use --tokenizer {WORD_LEVEL} (trained on your text here), "
                                              "or a folder written by tokenizer.save_pretrained")
    tok = AutoTokenizer.from_pretrained(str(folder) if folder.is_dir() else name)
    if tok.pad_token is None:   # GPT-2's has none; packed rows never pad, the model only needs an id
        tok.pad_token = tok.eos_token
    return tok


def pack(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """All texts as one token stream (the tokenizer's end-of-text token between them, where it has one),
    cut into rows of `seq_len`; the last partial row is dropped."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    # split_special_tokens: a "[UNK]" or "<|endoftext|>" written in your text is text, not the special token.
    rows = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    ids = [i for row in rows for i in row + separator]
    n_rows = len(ids) // seq_len
    return torch.tensor(ids[:n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)


def require_global_batch(train: PackedText, global_batch: int, source) -> None:
    """Data shorter than one global batch cannot make a single optimizer step: say so before any engine exists."""
    if len(train) < global_batch:
        raise DataError(f"--data {source}: {len(train)} training rows of {train.seq_len} tokens, fewer than one "
                        f"global batch ({global_batch} rows = micro-batch x gradient accumulation x ranks): "
                        "use more text, a shorter --seq-len, or a smaller batch")


def unigram_loss(train: PackedText, held_out: PackedText) -> float:
    """Nats per token on `held_out` of the best model that ignores context: each word's frequency in `train`
    (add-one smoothed, so a word the training rows never hold still has a probability). A language model
    below this line predicts from the words before, not from word frequencies alone."""
    counts = torch.bincount(train.rows.flatten(), minlength=train.vocab_size).double() + 1
    log_p = counts.log() - counts.sum().log()
    return -log_p[held_out.rows.flatten()].mean().item()
