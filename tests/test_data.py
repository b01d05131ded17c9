"""Tests for helpers.data: the Markov source's exact floor, the tokenizer and the dataset."""

import math

import numpy as np
import pytest
import torch

from helpers.data import MarkovSource, SyntheticTextDataset, train_tokenizer


@pytest.fixture(scope="module")
def src() -> MarkovSource:
    return MarkovSource(n_words=128, successors=4, seed=0)


@pytest.fixture(scope="module")
def train() -> SyntheticTextDataset:
    return SyntheticTextDataset(n_samples=256, seq_len=32, seed=0)


# --- MarkovSource -------------------------------------------------------------


def test_two_state_chain_matches_closed_form():
    a, b = 0.3, 0.1
    chain = MarkovSource.__new__(MarkovSource)   # a hand-built chain instead of a drawn one
    chain._setup(["ka", "po"], np.array([[1 - a, a], [b, 1 - b]]))

    def h(p: float) -> float:
        return -(p * math.log(p) + (1 - p) * math.log(1 - p))

    pi = np.array([b, a]) / (a + b)
    np.testing.assert_allclose(chain.stationary(), pi, atol=1e-12)
    assert chain.entropy_rate() == pytest.approx(pi[0] * h(a) + pi[1] * h(b), abs=1e-12)


def test_stationary_is_fixed_point(src):
    pi = src.stationary()
    assert pi.min() >= 0 and pi.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(pi @ src.transition, pi, atol=1e-12)


def test_rows_have_exact_successors_and_sum_to_one(src):
    P = src.transition
    assert P.shape == (128, 128) and P.dtype == np.float64
    assert ((P > 0).sum(1) == 4).all()
    np.testing.assert_allclose(P.sum(1), 1.0, atol=1e-12)
    rows = np.arange(128)
    assert (P[rows, (rows + 1) % 128] > 0).all() and P[0, 0] > 0  # cycle + self-loop


def test_entropy_rate_bounds(src):
    h = src.entropy_rate()
    assert 0 < h <= math.log(4) < math.log(128)


def test_empirical_cross_entropy_matches_entropy_rate(src):
    x = src.sample(200_000, np.random.default_rng(1))
    ce = -np.log(src.transition[x[:-1], x[1:]]).mean()
    assert ce == pytest.approx(src.entropy_rate(), abs=0.02)


def test_sample_start_follows_stationary(src):
    rng = np.random.default_rng(2)
    starts = np.array([src.sample(2, rng)[0] for _ in range(20_000)])
    freq = np.bincount(starts, minlength=128) / len(starts)
    assert np.abs(freq - src.stationary()).sum() < 0.1


def test_words_are_distinct_pronounceable_lowercase(src):
    assert len(src.words) == len(set(src.words)) == 128
    assert all(w.isalpha() and w.islower() and 4 <= len(w) <= 6 for w in src.words)


def test_determinism_and_seed_dependence():
    a, b, c = MarkovSource(seed=0), MarkovSource(seed=0), MarkovSource(seed=1)
    assert a.words == b.words and np.array_equal(a.transition, b.transition)
    assert a.words != c.words and not np.array_equal(a.transition, c.transition)
    s1 = a.sample(100, np.random.default_rng(5))
    assert np.array_equal(s1, a.sample(100, np.random.default_rng(5)))
    assert not np.array_equal(s1, a.sample(100, np.random.default_rng(6)))


def test_valid_fraction(src):
    sample = src.sample(5_000, np.random.default_rng(3))
    assert src.valid_fraction(sample) == 1.0
    assert src.valid_fraction_of_text(src.render(sample)) == 1.0
    uniform = np.random.default_rng(4).integers(0, 128, size=20_000)
    assert src.valid_fraction(uniform) == pytest.approx(4 / 128, abs=0.01)
    a = int(sample[0])
    bad = int(np.flatnonzero(src.transition[a] == 0)[0])
    assert src.valid_fraction([a, bad]) == 0.0
    assert src.valid_fraction_of_text(f"{src.words[a]} notaword {src.words[a]}") == 0.0
    assert math.isnan(src.valid_fraction([a]))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_words=1), "n_words"),
        (dict(successors=0), "successors"),
        (dict(n_words=8, successors=9), "successors"),
    ],
)
def test_source_bad_args(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MarkovSource(**kwargs)


# --- tokenizer ----------------------------------------------------------------


def test_tokenizer_round_trip_one_token_per_word(src):
    texts = [src.render(src.sample(20, np.random.default_rng(i))) for i in range(10)]
    tok = train_tokenizer(texts, words=src.words)
    assert tok.pad_token == "[PAD]" and tok.unk_token == "[UNK]"
    assert len(tok) == 128 + 2  # every word has an id, even unseen ones
    text = src.render(src.sample(50, np.random.default_rng(99)))
    ids = tok(text)["input_ids"]
    assert len(ids) == 50 and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok("notaword")["input_ids"] == [tok.unk_token_id]


# --- dataset ------------------------------------------------------------------


def test_dataset_shapes_and_floor(train):
    assert len(train) == 256
    item = train[3]["input_ids"]
    assert item.shape == (32,) and item.dtype == torch.long
    assert train.vocab_size == len(train.tokenizer) == 130
    assert train.floor_nats == pytest.approx(train.source.entropy_rate())
    assert train.ln_vocab == pytest.approx(math.log(128))
    assert train.tokenizer.decode(item) == train.texts[3] == train.hf["text"][3]
    counts = train.token_counts()
    assert counts.shape == (130,) and counts.sum() == 256 * 32 and counts[:2].sum() == 0


def test_random_mode(train):
    rnd = SyntheticTextDataset("random", n_samples=256, seq_len=32, tokenizer=train.tokenizer)
    assert rnd.floor_nats == pytest.approx(math.log(128))
    assert rnd.source.valid_fraction_of_text(" ".join(rnd.texts)) < 0.1


def _word_to_id(ds: SyntheticTextDataset) -> dict[str, int]:
    pairs = {(w, int(t)) for i in range(len(ds)) for w, t in zip(ds.texts[i].split(), ds[i]["input_ids"])}
    mapping = dict(pairs)
    assert len(mapping) == len(pairs)  # each word always gets the same id
    return mapping


def test_eval_set_shares_chain_and_tokenizer(train):
    ev = SyntheticTextDataset(n_samples=256, seq_len=32, seed=1, tokenizer=train.tokenizer)
    assert ev.texts != train.texts
    assert np.array_equal(ev.source.transition, train.source.transition)
    a, b = _word_to_id(train), _word_to_id(ev)
    shared = a.keys() & b.keys()
    assert len(shared) > 100 and all(a[w] == b[w] for w in shared)


def test_dataset_is_deterministic(train):
    again = SyntheticTextDataset(n_samples=256, seq_len=32, seed=0)
    assert again.texts == train.texts
    assert torch.equal(again[10]["input_ids"], train[10]["input_ids"])


def test_foreign_tokenizer_rejected(train):
    with pytest.raises(ValueError, match="tokenizer"):
        SyntheticTextDataset(n_samples=4, source_seed=1, tokenizer=train.tokenizer)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(mode="bigram"), "mode"),
        (dict(n_samples=0), "n_samples"),
        (dict(seq_len=1), "seq_len"),
        (dict(n_words=1), "n_words"),
        (dict(successors=200), "successors"),
    ],
)
def test_dataset_bad_args(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SyntheticTextDataset(**kwargs)
