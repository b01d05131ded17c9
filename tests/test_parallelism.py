"""Notebook 07's programs and formulas, without launching ranks (nbval runs the notebook, whose check cells hold
the 2- and 4-rank runs against 1 rank, the comms logger and the measured bytes): the Llama's parameter split
counted from the built model, the validator on `sequence_parallel_size`, the refusals that must come before
any rank starts (one of them a hang: a sequence-parallel rank out of batches waits forever), the command line
a launch prints, the longest-sequence arithmetic, and the one-line refusals of the notebook's parameters cell."""
import pytest
import torch

from helpers.config import build_config, validate
from helpers.errors import ConfigError
from helpers.launch import checked_flags, command_line
from helpers.model import MODEL_SIZES, build_llama, llama_param_count
from helpers.topics import sequence_parallel
from helpers.topics.tensor_parallel import COLUMN_PARALLEL, ROW_PARALLEL


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_the_split_and_whole_counts_are_the_models_linears_and_the_rest(size):
    model = build_llama(130, 32, size)
    linears = sum(m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    counts = llama_param_count(130, *MODEL_SIZES[size][:2])
    assert counts["split"] == linears
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    kinds = {name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == set(COLUMN_PARALLEL) | set(ROW_PARALLEL) | {"lm_head"}   # every linear has its Megatron kind


def test_the_validator_takes_sequence_parallel_size_as_a_number_only():
    config = build_config(torch_adam=True, device="cpu") | {"sequence_parallel_size": 2}
    assert validate(config, device="cpu")["sequence_parallel_size"] == 2
    with pytest.raises(ConfigError, match="sequence_parallel_size='2'"):
        validate(config | {"sequence_parallel_size": "2"}, device="cpu")


@pytest.mark.parametrize("program, n_ranks, options, message", [
    ("tensor_parallel", 3, {"tp_size": 2}, "does not divide the 3 ranks"),
    ("tensor_parallel", 8, {"tp_size": 8}, "more than the 4 attention heads"),
    ("sequence_parallel", 2, {"sp_size": 2, "steps": 3}, "steps=3 is not a multiple of sp_size=2"),
    ("sequence_parallel", 2, {"sp_size": 2, "seq_len": 63}, "sequence length 63 is not divisible"),
    ("sequence_parallel", 3, {"sp_size": 3}, "does not divide the 4 attention heads"),
])
def test_what_deepspeed_would_refuse_or_hang_on_is_refused_before_any_rank_starts(program, n_ranks, options, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        checked_flags(program, n_ranks, "torchrun", tmp_path, options)


def test_the_printed_command_names_paths_relative_to_the_repository_root(tmp_path):
    from helpers import REPO_ROOT
    module, args = checked_flags("tensor_parallel", 2, "torchrun", REPO_ROOT / "runs" / "x", {"tp_size": 2, "stages": (1, 2)})
    assert command_line(module, 2, REPO_ROOT / "runs" / "x", args) == \
        "torchrun --nproc_per_node 2 -m helpers.programs.tensor_parallel --out runs/x --tp-size=2 --stages 1 2"


def test_the_longest_sequence_scales_with_the_ranks_and_is_a_multiple_of_them():
    rows = [{"sequence length": 64, "bytes, 1 rank": 6400}, {"sequence length": 128, "bytes, 1 rank": 12800}]
    per_token = sequence_parallel.bytes_per_token(rows)
    assert per_token == 100
    assert sequence_parallel.longest_sequence(10_050, per_token, 1) == 100
    assert sequence_parallel.longest_sequence(10_050, per_token, 4) == 400
    assert sequence_parallel.longest_sequence(10_000, 300.0, 2) % 2 == 0


def _notebook_07_parameters_and_setup():
    import nbformat
    from helpers import REPO_ROOT
    cells = nbformat.read(REPO_ROOT / "notebooks" / "07_tensor_sequence_parallel.ipynb", as_version=4).cells
    i = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    return cells[i].source, cells[i + 1].source


@pytest.mark.parametrize("name, value, message", [
    ("N_RANKS", 4, r"N_RANKS=4: use 2"),
    ("STEPS", 3, r"STEPS=3: use an even integer >= 2"),
    ("TP_SEQ_LEN", 1, r"TP_SEQ_LEN=1: use an integer >= 2"),
    ("TP_BATCH", 3, r"TP_BATCH=3: use an even integer >= 2"),
    ("SP_LENGTHS", (64, 65), r"SP_LENGTHS=\(64, 65\): use a tuple of increasing values, each an even integer >= 2"),
    ("ACTIVATION_BUDGET_MB", 0, r"ACTIVATION_BUDGET_MB=0: use a number from 0.001 to 1e\+06"),
    ("SEED", -1, r"SEED=-1: use an integer >= 0"),
])
def test_notebook_07_refuses_in_one_line_what_its_parameters_cell_does_not_offer(name, value, message):
    """The cell after the parameters cell stops with one line naming the parameter and what to use, before any
    DeepSpeed or torch code could fail deeper with a traceback."""
    parameters, setup = _notebook_07_parameters_and_setup()
    namespace = {}
    exec(parameters, namespace)
    namespace[name] = value
    with pytest.raises(ValueError, match=message):
        exec(setup, namespace)


def test_notebook_07_accepts_its_default_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("TUTORIAL_RUN_DIR", str(tmp_path))
    parameters, setup = _notebook_07_parameters_and_setup()
    namespace = {}
    exec(parameters, namespace)
    exec(setup, namespace)
    assert namespace["RUN"].is_relative_to(tmp_path)
