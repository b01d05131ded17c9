"""Synthetic text whose best achievable loss is known exactly, so a loss curve has a true floor.

`MarkovSource` is a seeded Markov chain over pseudo-words: its entropy rate is the lowest next-token
loss any model can reach. `SyntheticTextDataset` renders it (or uniform random words, the classic demo
whose floor is ln V) as text and tokenises it word-level, so one word is one token.
"""
from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections.abc import Sequence

import datasets
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
MAX_WORDS = 4096  # the transition matrix is dense (n_words**2 float64)
SPECIAL_TOKENS = ["[PAD]", "[UNK]"]
N_WORDS = 128   # the Markov source's pseudo-words, by default


def _cumulative(weights: np.ndarray) -> list[float]:
    cum = np.cumsum(weights).tolist()
    cum[-1] = 1.0  # so bisect of any u in [0, 1) stays in range despite rounding
    return cum


def make_words(n_words: int, rng: np.random.Generator) -> list[str]:
    """`n_words` distinct pronounceable pseudo-words of 2-3 consonant+vowel syllables."""
    words: dict[str, None] = {}  # insertion-ordered set
    while len(words) < n_words:
        words["".join(rng.choice(_SYLLABLES, size=int(rng.integers(2, 4))))] = None
    return list(words)


class MarkovSource:
    """Seeded first-order Markov chain over pseudo-words.

    Row i always contains i -> (i+1) % n_words, so the chain is one big cycle (irreducible); when
    successors >= 2, word 0 also gets a self-loop, which makes it aperiodic (cycle lengths n_words
    and 1 have gcd 1). The other successors are drawn at random, the row weights from Dirichlet(1).
    With successors == 1 the chain is a deterministic, periodic cycle: uniform pi, entropy rate 0.
    """

    def __init__(self, n_words: int = N_WORDS, successors: int = 4, seed: int = 0) -> None:
        if not 2 <= n_words <= MAX_WORDS:
            raise ValueError(f"n_words must be in 2..{MAX_WORDS}, got {n_words}")
        if not 1 <= successors <= n_words:
            raise ValueError(f"successors must be in 1..n_words ({n_words}), got {successors}: "
                             "lower successors or raise n_words")
        # Separate streams: the words depend only on (n_words, seed).
        word_rng, chain_rng = np.random.default_rng(seed).spawn(2)
        self.seed = seed
        self._setup(make_words(n_words, word_rng), self._draw_transition(n_words, successors, chain_rng))

    @staticmethod
    def _draw_transition(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
        keys = rng.random((n, n))
        rows = np.arange(n)
        keys[rows, (rows + 1) % n] = -1.0  # forced edges sort first, so they are always kept
        if k >= 2:
            keys[0, 0] = -1.0
        cols = np.argpartition(keys, k - 1, axis=1)[:, :k]
        P = np.zeros((n, n))
        P[rows[:, None], cols] = rng.dirichlet(np.ones(k), size=n)
        return P / P.sum(1, keepdims=True)  # exact 1.0 rows (numpy's Dirichlet can give 1 - 1e-16)

    def _setup(self, words: list[str], P: np.ndarray) -> None:
        self.words = words
        self.n_words = len(words)
        self.transition = P
        self.successors = int((P > 0).sum(1).max())
        self.index = {w: i for i, w in enumerate(words)}
        self._pi = self._solve_stationary()
        # Successors and cumulative weights as plain lists: sampling is sequential, and a Python
        # bisect per step is far cheaper than a numpy call per step.
        self._next = [np.flatnonzero(row).tolist() for row in P]
        self._cum = [_cumulative(row[row > 0]) for row in P]
        self._pi_cum = _cumulative(self._pi)

    def _solve_stationary(self) -> np.ndarray:
        # Solve pi (P - I) = 0 with one equation replaced by sum(pi) = 1.
        A = self.transition.T - np.eye(self.n_words)
        A[-1] = 1.0
        pi = np.linalg.solve(A, np.eye(self.n_words)[-1])
        assert pi.min() > -1e-10 and abs(pi.sum() - 1) < 1e-10, "chain is not irreducible"
        pi = np.clip(pi, 0, None)  # drop round-off negatives
        return pi / pi.sum()

    def stationary(self) -> np.ndarray:
        """Stationary distribution pi (pi P = pi, sums to 1)."""
        return self._pi.copy()

    def entropy_rate(self) -> float:
        """Exact entropy rate in nats/token: sum_i pi_i * H(P_i), H(P_i) = -sum_j P_ij ln P_ij.

        Every sequence starts from pi, so every position is pi-distributed and this is the lowest
        achievable average cross-entropy for predicting token t+1 from tokens <= t.
        """
        P = self.transition
        row_entropy = (P * np.log(1 / np.where(P > 0, P, 1.0))).sum(1)  # 0 ln 0 = 0
        return float(self._pi @ row_entropy)

    def sample(self, n_tokens: int, rng: np.random.Generator) -> np.ndarray:
        """`n_tokens` word indices: the first from pi, then the chain."""
        u = rng.random(n_tokens).tolist()
        nxt, cum = self._next, self._cum
        out = [bisect_right(self._pi_cum, u[0])] if n_tokens else []
        for t in range(1, n_tokens):
            out.append(nxt[out[-1]][bisect_right(cum[out[-1]], u[t])])
        return np.array(out, dtype=np.int64)

    def valid_fraction(self, word_indices: Sequence[int] | np.ndarray) -> float:
        """Fraction of consecutive pairs the chain allows; index -1 = unknown word.

        NaN when there are fewer than 2 words (no pairs to score).
        """
        idx = np.asarray(word_indices, dtype=np.int64)
        if idx.size < 2:
            return float("nan")
        a, b = idx[:-1], idx[1:]
        known = (a >= 0) & (b >= 0)
        ok = known & (self.transition[np.maximum(a, 0), np.maximum(b, 0)] > 0)
        return float(ok.mean())

    def valid_fraction_of_text(self, text: str) -> float:
        """`valid_fraction` of whitespace-split text; unknown words are invalid."""
        return self.valid_fraction([self.index.get(w, -1) for w in text.split()])

    def render(self, indices: Sequence[int] | np.ndarray) -> str:
        """Words joined by single spaces."""
        return " ".join(self.words[i] for i in indices)


def train_tokenizer(texts: list[str], words: list[str] | None = None, vocab_size: int | None = None,
                    eos_token: str | None = None) -> PreTrainedTokenizerFast:
    """Train a word-level tokenizer locally and wrap it with the usual HF API.

    Word-level means one word is one token, so the entropy rate per word is exactly the optimal loss
    per token (BPE would split words and change the per-token floor). Every one of `words` gets an id.
    `vocab_size` keeps only the most frequent words (the rest read as [UNK]: real text has a long tail);
    `eos_token` adds a token that marks where one text ends and the next begins.
    """
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    # WhitespaceSplit (not Whitespace, which also splits off punctuation) splits exactly like
    # str.split, so tokens always match the words valid_fraction_of_text scores.
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # join tokens with spaces
    special = SPECIAL_TOKENS + ([eos_token] if eos_token else [])
    trainer = trainers.WordLevelTrainer(special_tokens=special, min_frequency=0,
                                        **({"vocab_size": vocab_size} if vocab_size else {}))
    tok.train_from_iterator(list(texts) + ([" ".join(words)] if words else []), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token=eos_token,
                                   clean_up_tokenization_spaces=False)


class SyntheticTextDataset(torch.utils.data.Dataset):
    """Token sequences from a Markov chain ("markov") or uniform random words ("random").

    `seed` drives sampling; `source_seed` fixes the chain and word list, so an eval set built with
    another `seed` and `tokenizer=train.tokenizer` shares both. `hf` keeps the `datasets.Dataset`
    (columns "text" and "input_ids", the latter as torch tensors).
    """

    MODES = ("markov", "random")

    def __init__(self, mode: str = "markov", n_samples: int = 2048, seq_len: int = 64, n_words: int = N_WORDS,
                 successors: int = 4, seed: int = 0, source_seed: int = 0,
                 tokenizer: PreTrainedTokenizerFast | None = None) -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (need a next token to predict), got {seq_len}")
        self.mode, self.seq_len, self.n_words = mode, seq_len, n_words
        self.source = MarkovSource(n_words, successors, seed=source_seed)
        self.texts = self._make_texts(n_samples, np.random.default_rng(seed))
        if tokenizer is None:
            tokenizer = train_tokenizer(self.texts, words=self.source.words)
        else:
            _check_tokenizer(tokenizer, self.source.words)
        self.tokenizer, self.vocab_size = tokenizer, len(tokenizer)
        self.ln_vocab = math.log(n_words)
        self.floor_nats = self.source.entropy_rate() if mode == "markov" else self.ln_vocab
        self.hf = self._tokenize()
        self._ids: torch.Tensor = self.hf["input_ids"][:]  # Column -> (n_samples, seq_len) tensor
        assert self._ids.shape == (n_samples, seq_len)
        assert not (self._ids == tokenizer.pad_token_id).any(), "pads found: text is not one token per word"

    def _make_texts(self, n_samples: int, rng: np.random.Generator) -> list[str]:
        if self.mode == "random":
            rows = rng.integers(0, self.n_words, size=(n_samples, self.seq_len))
        else:
            rows = [self.source.sample(self.seq_len, rng) for _ in range(n_samples)]
        return [self.source.render(r) for r in rows]

    def _tokenize(self) -> datasets.Dataset:
        enc = self.tokenizer(self.texts, truncation=True, max_length=self.seq_len, padding="max_length")
        ds = datasets.Dataset.from_dict({"text": self.texts, "input_ids": enc["input_ids"]})   # in memory, no cache
        return ds.with_format("torch", columns=["input_ids"], output_all_columns=True)

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self._ids[i]}

    def token_counts(self) -> np.ndarray:
        """Occurrences of each token id over the dataset (length vocab_size)."""
        return np.bincount(self._ids.flatten().numpy(), minlength=self.vocab_size)


def generation_seconds(n_samples: int, seq_len: int, sample_tokens: int = 262_144) -> float:
    """About how long SyntheticTextDataset("markov") takes here for n_samples x seq_len: a sample of about
    `sample_tokens` (under a second) timed on this machine, scaled by the tokens. Sampling and tokenising are
    linear in them; the sample's fixed costs (the tokenizer, the chain) make this an overestimate (1.7x
    on a 2-core EPYC: 5.3 min estimated where 1.5M sequences of 64 took 3.2)."""
    sample = max(1, sample_tokens // seq_len)
    start = time.perf_counter()
    SyntheticTextDataset("markov", n_samples=sample, seq_len=seq_len)
    return (time.perf_counter() - start) * n_samples / sample


def _check_tokenizer(tokenizer: PreTrainedTokenizerFast, words: list[str]) -> None:
    vocab = tokenizer.get_vocab()
    missing = [w for w in words if w not in vocab]
    if missing:
        raise ValueError(f"tokenizer is missing {len(missing)} of the {len(words)} words (e.g. {missing[:3]}): "
                         "pass the tokenizer of a dataset with the same n_words and source_seed, or None")


def source_loss(data: SyntheticTextDataset) -> float:
    """Mean next-token loss of the *true* Markov probabilities on `data`'s own samples (nats/token).

    A finite-sample check of the floor: it should sit within sampling noise of the entropy rate.
    """
    idx = np.array([[data.source.index[w] for w in text.split()] for text in data.texts])
    probs = data.source.transition[idx[:, :-1], idx[:, 1:]]
    return float(-np.log(probs).mean()) + 0.0   # + 0.0: a deterministic chain gives 0.0, not -0.0


def bigram_loss(train: SyntheticTextDataset, test: SyntheticTextDataset, smoothing: float = 0.1) -> float:
    """Held-out loss of a counting model P(b | a) = (count(a,b) + s) / (count(a) + s V), fit on `train`.

    No neural network: it shows how much of the gap between ln V and the floor plain counting closes.
    """
    V = train.vocab_size
    ids = train._ids.numpy()
    counts = np.zeros((V, V))
    np.add.at(counts, (ids[:, :-1].ravel(), ids[:, 1:].ravel()), 1)
    probs = (counts + smoothing) / (counts.sum(1, keepdims=True) + smoothing * V)
    test_ids = test._ids.numpy()
    return float(-np.log(probs[test_ids[:, :-1], test_ids[:, 1:]]).mean())
