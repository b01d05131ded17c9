"""helpers/own_text.py and the train program's --data: your own text (a file, a folder, a dataset saved with
save_to_disk) packed to seq_len, a reproducible held-out split, exact resume, and a clear error for every
bad input."""
import datasets
import pytest
import torch

from helpers import REPO_ROOT, presets
from helpers.checkpoints import CheckpointMismatchError
from helpers.errors import DataError
from helpers.own_text import load_own_text
from helpers.programs import train as program
from tests.trainers import make_trainer

# Sample text of some size: the page that documents --data ("Your own text"), about 100 rows of 16 tokens; the
# trainer-API test below needs more than one micro-batch of 64 of them.
SAMPLE = REPO_ROOT / "helpers" / "programs" / "README.md"
LINES = ["the cat sat on the mat", "the dog sat on the log", "", "a bird sang `[EOS]`, in (the [UNK])"]


def words_of(lines: list[str]) -> list[str]:
    """What the word-level tokenizer should read, derived with str.split: each non-blank line's words, then [EOS]
    (text that contains "[EOS]" or "[UNK]" inside a word is read as that word, not split at the special token)."""
    return [w for line in lines if line.strip() for w in line.split() + ["[EOS]"]]


def all_rows_as_words(parts) -> list[list[str]]:
    return sorted(parts[0].tokenizer.convert_ids_to_tokens(row.tolist()) for part in parts for row in part.rows)


def test_a_text_file_is_packed_word_by_word(tmp_path):
    (tmp_path / "t.txt").write_text("\n".join(LINES * 5))
    parts = load_own_text(tmp_path / "t.txt", seq_len=5, held_out=0.2)
    words = words_of(LINES * 5)
    assert all_rows_as_words(parts) == sorted(words[i:i + 5] for i in range(0, len(words) - 4, 5))
    assert [len(p) for p in parts] == [18, 4]   # (7 + 7 + 8) x 5 = 110 words = 22 rows of 5, round(0.2 x 22) = 4 held out
    assert parts[0].seq_len == 5 and parts[0].vocab_size == len(set(words)) + 2   # + [PAD], [UNK]


def test_the_held_out_split_is_reproducible_and_disjoint(tmp_path):
    (tmp_path / "t.txt").write_text("\n".join(f"line {i} says word{i % 7} and word{i % 5}" for i in range(200)))
    train, held = load_own_text(tmp_path / "t.txt", seq_len=8, seed=0)
    again, held_again = load_own_text(tmp_path / "t.txt", seq_len=8, seed=0)
    _, other_held = load_own_text(tmp_path / "t.txt", seq_len=8, seed=1)
    assert torch.equal(train.rows, again.rows) and torch.equal(held.rows, held_again.rows)
    assert not torch.equal(held.rows, other_held.rows)
    assert not {tuple(r.tolist()) for r in train.rows} & {tuple(r.tolist()) for r in held.rows}


def test_a_folder_reads_its_text_files_in_name_order(tmp_path):
    (tmp_path / "one.txt").write_text("\n".join(LINES * 3))
    (tmp_path / "folder" / "sub").mkdir(parents=True)
    (tmp_path / "folder" / "a.txt").write_text("\n".join(LINES[:2] * 3))
    (tmp_path / "folder" / "sub" / "b.md").write_text("\n".join(LINES[2:] * 3))
    (tmp_path / "folder" / ".notes").write_bytes(b"\0\1 hidden files are skipped")
    from_folder = load_own_text(tmp_path / "folder", seq_len=4)
    words = words_of(LINES[:2] * 3 + LINES[2:] * 3)
    assert all_rows_as_words(from_folder) == sorted(words[i:i + 4] for i in range(0, len(words) - 3, 4))


def test_a_saved_dataset_reads_like_the_same_lines_in_a_file(tmp_path):
    datasets.Dataset.from_dict({"body": LINES * 5, "n": list(range(20))}).save_to_disk(tmp_path / "saved")
    datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": LINES * 5})).save_to_disk(tmp_path / "dict")
    (tmp_path / "t.txt").write_text("\n".join(LINES * 5))
    from_file = load_own_text(tmp_path / "t.txt", seq_len=5)
    for saved in (load_own_text(tmp_path / "saved", seq_len=5, text_column="body"),
                  load_own_text(tmp_path / "dict", seq_len=5)):
        assert all(torch.equal(a.rows, b.rows) for a, b in zip(saved, from_file))


def _bad_inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n  \n\t\n" * 50)
    (tmp_path / "data.bin").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "short.txt").write_text("too few words")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("fine text")
    (tmp_path / "mixed" / "b.gz").write_bytes(b"\x1f\x8b\x08\0" + bytes(100))
    (tmp_path / "no_files").mkdir()
    datasets.Dataset.from_dict({"body": ["a b"], "n": [1]}).save_to_disk(tmp_path / "columns")
    datasets.Dataset.from_dict({"text": ["", "  ", "\t"]}).save_to_disk(tmp_path / "blank_rows")
    datasets.DatasetDict(validation=datasets.Dataset.from_dict({"text": ["a b"]})).save_to_disk(tmp_path / "splits")


@pytest.mark.parametrize("source, options, message", [
    ("missing.txt", {}, "missing.txt: no such file or folder"),
    ("empty.txt", {}, "empty.txt: the file is empty"),
    ("blank.txt", {}, "blank.txt: the file is empty"),
    ("blank_rows", {}, "blank_rows: the text is empty (only blank lines)"),
    ("data.bin", {}, "data.bin: not a UTF-8 text file"),
    ("mixed", {}, "b.gz: not a UTF-8 text file"),
    ("no_files", {}, "no_files: the folder has no files"),
    ("columns", {}, "no column 'text'; its columns are ['body', 'n']"),
    ("columns", {"text_column": "n"}, "column 'n' holds Value('int64'), not text"),
    ("splits", {}, "without a 'train' split (it has ['validation'])"),
    ("short.txt", {}, "0 row(s) of --seq-len 16 tokens"),
    ("blank.txt", {"held_out": 1.5}, "--held-out 1.5 must be a fraction"),
    ("blank.txt", {"held_out": "0.1"}, "--held-out '0.1' must be a fraction"),
    ("blank.txt", {"seq_len": 1}, "--seq-len 1 must be an integer of at least 2"),
    ("blank.txt", {"vocab_size": 2}, "--vocab-size 2 must be an integer of at least 4"),
])
def test_bad_data_input_is_named(tmp_path, source, options, message):
    _bad_inputs(tmp_path)
    with pytest.raises(DataError) as error:
        load_own_text(tmp_path / source, **{"seq_len": 16} | options)
    assert message in str(error.value)


def test_a_hub_name_offline_fails_at_once_naming_the_flag_and_the_offline_way(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"--data roneneldan/TinyStories: not a local path.*save_to_disk"):
        load_own_text("roneneldan/TinyStories", seq_len=16)
    with pytest.raises(DataError, match=r"--tokenizer gpt2: .*--tokenizer word-level"):
        load_own_text(SAMPLE, seq_len=16, tokenizer="gpt2")


def test_a_saved_tokenizer_folder_is_used_as_it_is(tmp_path):
    train, _ = load_own_text(SAMPLE, seq_len=16)
    train.tokenizer.save_pretrained(tmp_path / "tok")
    again, _ = load_own_text(SAMPLE, seq_len=16, tokenizer=str(tmp_path / "tok"))
    assert torch.equal(train.rows, again.rows)


def test_data_shorter_than_one_global_batch_stops_before_any_rank_starts(tmp_path):
    (tmp_path / "t.txt").write_text("\n".join(LINES * 20))   # 440 tokens: 27 rows of 16, 3 held out
    args = program.parse(["--config", "configs/zero2.json", "--data", str(tmp_path / "t.txt"), "--seq-len", "16"])
    with pytest.raises(DataError, match=r"24 training rows of 16 tokens, fewer than one global batch \(32 rows"):
        program.check_options(args, world_size=2)


def test_synthetic_size_flags_with_data_and_data_flags_without_it_are_refused(capsys):
    with pytest.raises(SystemExit):
        program.parse(["--config", "configs/zero2.json", "--data", str(SAMPLE), "--n-samples", "64"])
    assert "with --data the size is your text's" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        program.parse(["--config", "configs/zero2.json", "--tokenizer", "gpt2", "--held-out", "0.2"])
    assert "--tokenizer, --held-out only apply to your own text: add --data" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # 0 is refused, not read as "the default"
        program.parse(["--config", "configs/zero2.json", "--n-samples", "0"])
    assert "argument --n-samples: 0 must be at least 1" in capsys.readouterr().err


def test_a_data_mistake_is_one_line_from_the_script(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: --data .*nope.txt: no such file or folder"):
        program.cli(["--config", "configs/zero0.json", "--data", str(tmp_path / "nope.txt")])


def _run(tmp_path, data, *extra):
    return program.main(["--config", str(presets.CONFIG_DIR / "zero2.json"), "--data", str(data), "--seq-len", "16",
                         "--output-dir", str(tmp_path), *extra])


@pytest.fixture(params=["text file", "saved dataset"])
def own_data(request, tmp_path):
    text = SAMPLE.read_text().splitlines()
    if request.param == "text file":
        (tmp_path / "mine.txt").write_text("\n".join(text))
        return tmp_path / "mine.txt"
    datasets.Dataset.from_dict({"text": text}).save_to_disk(tmp_path / "mine")
    return tmp_path / "mine"


def test_training_on_own_text_resumes_exactly(own_data, tmp_path):
    straight = _run(tmp_path / "straight", own_data, "--steps", "4", "--save-every", "2")
    resumed = _run(tmp_path / "resumed", own_data, "--steps", "4",
                   "--resume-from", str(tmp_path / "straight" / "checkpoints" / "step2"))
    assert straight["floor_nats"] is None and straight["data"] == str(own_data)
    assert [m["loss"] for m in resumed["history"][2:]] == [m["loss"] for m in straight["history"][2:]]
    assert resumed["eval_loss"] == straight["eval_loss"]


def test_resuming_on_other_text_of_the_same_size_is_refused(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    (tmp_path / "mine.txt").write_text("\n".join(lines))
    (tmp_path / "reversed.txt").write_text("\n".join(reversed(lines)))   # same words and rows, other order
    _run(tmp_path / "first", tmp_path / "mine.txt", "--steps", "1")
    with pytest.raises(CheckpointMismatchError, match="other token ids than this run's data"):
        _run(tmp_path / "second", tmp_path / "reversed.txt", "--steps", "2",
             "--resume-from", str(tmp_path / "first" / "checkpoints"))


def test_the_trainer_api_takes_own_text_and_evaluates_a_small_held_out_set(tmp_path):
    train, held = load_own_text(SAMPLE, seq_len=16, held_out=0.01)
    trainer = make_trainer(train, micro_batch=64, precision="fp32", output_dir=tmp_path, warmup_steps=1, total_steps=2)
    trainer.train(2, progress=False)
    assert len(held) < 64 and trainer.evaluate(held) > 0   # fewer held-out rows than one micro-batch


def test_the_unigram_loss_is_the_cross_entropy_of_word_frequencies(tmp_path):
    """Counted by hand: training rows hold 'a' 3 times and 'b' once; with add-one smoothing over the vocabulary."""
    from helpers.own_text import PackedText, unigram_loss
    import math
    (tmp_path / "t.txt").write_text("a a a b")
    parts = load_own_text(tmp_path / "t.txt", seq_len=2, held_out=0.5)
    tok = parts[0].tokenizer
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    train, held_out = PackedText(torch.tensor([[a, a], [a, b]]), tok), PackedText(torch.tensor([[a, b]]), tok)
    total = 4 + len(tok)   # 4 counted tokens, plus one for every id of the vocabulary
    expected = -(math.log(4 / total) + math.log(2 / total)) / 2
    assert abs(unigram_loss(train, held_out) - expected) < 1e-12
