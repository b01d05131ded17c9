"""The rank programs' shared pieces: one --precision flag (helpers.precision.add_precision_flag), one resolver
(helpers.runtime.resolve_precision), and one start-up and shutdown (helpers.runtime.rank_process), the last on
2 real ranks under torchrun (join, all-reduce, end the group) and, for an error inside the block, in a fresh 1-rank process.

This file is also the 2-rank program of that test: `python -m tests.test_rank_process --out OUT` (see rank_main)."""
import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.errors import ConfigError
from helpers.precision import PRECISIONS, add_precision_flag
from helpers.runtime import Runtime, detect, resolve_precision

ROOT = Path(__file__).resolve().parent.parent


def parser_with_flag(**kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="program")
    add_precision_flag(p, **kwargs)
    return p


def test_the_flag_takes_auto_by_default_and_each_precision_by_name():
    p = parser_with_flag()
    assert p.parse_args([]).precision == "auto"
    assert p.parse_args(["--precision", "auto"]).precision == "auto"
    for name in PRECISIONS:
        assert p.parse_args(["--precision", name]).precision == name


def test_the_flag_refuses_another_value_with_argparses_error(capsys):
    with pytest.raises(SystemExit) as stop:
        parser_with_flag().parse_args(["--precision", "fp8"])
    assert stop.value.code == 2
    assert "argument --precision: invalid choice: 'fp8'" in capsys.readouterr().err


def test_a_program_keeps_its_own_default_and_an_unknown_default_is_refused():
    assert parser_with_flag(default="fp32").parse_args([]).precision == "fp32"   # comm_dtype's
    with pytest.raises(ConfigError, match="fp8"):
        parser_with_flag(default="fp8")


def test_auto_resolves_to_the_rule_and_a_name_to_itself():
    rule = detect().precision
    assert resolve_precision("auto") == rule
    assert resolve_precision(None) == rule
    assert resolve_precision("fp16") == "fp16"
    with pytest.raises(ConfigError, match="fp8"):
        resolve_precision("fp8")


def test_auto_resolves_to_the_given_runtime_without_detecting_again():
    other = "fp32" if detect().precision == "bf16" else "bf16"   # not this machine's pick: the runtime's is used
    runtime = Runtime("cpu", "a CPU", None, 1.0, other, "given")
    assert resolve_precision("auto", runtime) == other
    assert resolve_precision("fp16", runtime) == "fp16"


PROGRAMS = {"comm_dtype": [], "inference": [], "moe": [], "sequence_parallel": [], "tensor_parallel": [],
            "zero3": [], "zero_infinity": [], "zero_stages": ["--stages", "0"]}


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_every_program_takes_the_one_flag(program, capsys):
    parse = importlib.import_module(f"helpers.programs.{program}").parse
    args = ["--out", "x", *PROGRAMS[program]]
    assert parse([*args, "--precision", "bf16"]).precision == "bf16"
    with pytest.raises(SystemExit):
        parse([*args, "--precision", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_every_program_reads_top_to_bottom():
    """Like nanoGPT's train.py: its options (parse), then main, then what main calls (helpers/programs/README.md)."""
    import ast
    for path in sorted((ROOT / "helpers" / "programs").glob("[!_]*.py")):
        defs = [n.name for n in ast.parse(path.read_text()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert defs[:2] == ["parse", "main"], f"{path.name}: put main right after parse (it has {defs[:3]})"



def test_every_program_starts_up_in_rank_process_or_says_why_not():
    """One home for a rank's start-up and shutdown: a program that does its own says why, in a comment that
    starts "Not runtime.rank_process:" (helpers/programs/README.md names them: train, pipeline)."""
    own = []
    for path in sorted((ROOT / "helpers" / "programs").glob("[!_]*.py")):
        text = path.read_text()
        assert "with rank_process()" in text or "# Not runtime.rank_process: " in text, path.name
        own += [path.stem] if "with rank_process()" not in text else []
    assert own == ["pipeline", "train"], own

# ---- rank_process ----

def run_fresh(code: str) -> dict:
    """Run `code` in a new Python process with no launcher's variables (a 1-rank job); the dict it prints last."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                              "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    done = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]   # a SIGABRT at exit (gloo's threads) would show here
    return json.loads(done.stdout.strip().splitlines()[-1])


RAISING = """
import json, torch
from helpers.runtime import rank_process
try:
    with rank_process():
        raise KeyError("inside the block")
except KeyError as err:
    caught = str(err)
left = torch.distributed.is_initialized()
torch.distributed.destroy_process_group()
print(json.dumps({"caught": caught, "group_left_alone": left}))
"""


def test_an_exception_inside_goes_on_up_and_leaves_the_group_alone():
    """No barrier on the way out (ranks that failed elsewhere would never reach it) and no destroy: as the
    programs did before rank_process, the exception is the rank's end and the launcher ends the others."""
    got = run_fresh(RAISING)
    assert got == {"caught": "'inside the block'", "group_left_alone": True}


def test_two_ranks_under_torchrun_reduce_inside_and_end_their_group(tmp_path):
    from helpers.launch import launch
    ranks = launch("tests.test_rank_process", 2, out_dir=tmp_path, timeout=300)   # a failed rank raises here
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r == {"rank": r["rank"], "world": 2, "sum": 3.0, "inside": True, "after": False} for r in ranks)


def rank_main(argv=None) -> None:
    """What each of the 2 ranks of the test above runs: an all-reduce of (rank + 1) inside rank_process."""
    import torch
    from helpers.launch import write_result
    from helpers.runtime import rank_process
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    with rank_process() as world:
        inside = torch.distributed.is_initialized()
        total = torch.tensor([torch.distributed.get_rank() + 1.0])
        torch.distributed.all_reduce(total)
    write_result(a.out, {"world": world, "sum": total.item(), "inside": inside,
                         "after": torch.distributed.is_initialized()})


if __name__ == "__main__":
    rank_main()
