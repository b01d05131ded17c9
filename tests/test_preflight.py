"""The preflight's rules (notebook 01, colab_setup.sh), on the cases a Colab runtime can present: package rows
are fatal, CUDA-build rows warnings; its Adam-op check on this machine's own op, against torch's AdamW."""
import re
from pathlib import Path

import pytest

from helpers import preflight
from helpers.preflight import (MINIMUM_VERSIONS, _built, _step_gap, adam_op_matches_torch, arch_list_problem,
                               cuda_problem, main, release, version_problems)

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements.txt"


@pytest.mark.parametrize("text, expected", [("2.13.0+cu126", (2, 13, 0)), ("4.56.0.dev0", (4, 56, 0)),
                                            ("12.4", (12, 4)), ("8.1.9", (8, 1, 9)), ("1.15.0rc1", (1, 15, 0))])
def test_versions_compare_by_their_numbers(text, expected):
    assert release(text) == expected


def test_old_or_missing_packages_are_named_with_the_install_line():
    problems = version_problems({"transformers": "4.57.1", "torch": "2.13.0+cu126", "accelerate": None},
                                {"transformers": "5.3", "torch": "2.6", "accelerate": "1.1"})
    assert problems == ["transformers 4.57.1 is older than 5.3, which the helpers need: pip install -U 'transformers>=5.3'",
                        "accelerate is not installed: pip install 'accelerate>=1.1'"]
    assert version_problems({"torch": "2.10.0"}, {"torch": "2.6"}) == []   # 10 > 6: numbers, not strings


@pytest.mark.parametrize("torch_cuda, nvcc, says", [
    ("12.6", (12, 4), None),                    # Colab today: the same major, a minor apart (DeepSpeed accepts it)
    ("12.8", (13, 0), "needs the same major"),  # a newer toolkit beside an older torch build
    ("12.6", None, "no nvcc"),                  # a runtime-only CUDA install
    (None, (12, 4), "CPU build"),
    ("11.8", (11, 8), "c++20"),                 # torch 2.12+ compiles with -std=c++20: nvcc 12+
])
def test_nvcc_must_match_torchs_cuda_major(torch_cuda, nvcc, says):
    problem = cuda_problem(torch_cuda, nvcc)
    assert problem is None if says is None else says in problem


def test_this_machines_adam_op_builds_and_steps_like_torch():
    assert adam_op_matches_torch("cpu") < 1e-5   # DeepSpeedCPUAdam, ZeRO-Offload's optimizer (notebook 05)


def test_a_fused_adamw_step_is_compared_with_the_plain_one():
    # On a GPU the preflight steps torch's fused AdamW there; torch has a fused AdamW for the CPU too (2.4+).
    import torch
    assert _step_gap("cpu", lambda p: torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)) < 1e-5
    assert _step_gap("cpu", lambda p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.01)) > 1e-5   # it sees a difference


def test_requirements_txt_pins_versions_the_floors_accept():
    # colab_setup.sh installs these pins where Colab's are below the floors: they must pass the preflight.
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", REQUIREMENTS.read_text(), re.M))
    assert set(MINIMUM_VERSIONS) <= set(pins)
    assert version_problems(pins) == []
    assert pins["deepspeed"] == preflight.DEEPSPEED


def test_a_build_that_raises_is_a_row_with_its_last_line():
    def fails():
        raise RuntimeError("Error building extension 'fused_adam'\nnvcc fatal : Unsupported gpu architecture")
    row = _built("FusedAdam built", fails, fatal=False)
    assert row == {"check": "FusedAdam built", "ok": False, "fatal": False,
                   "detail": "RuntimeError: nvcc fatal : Unsupported gpu architecture"}
    assert _built("step", lambda: 2e-7, fatal=True) == {"check": "step", "ok": True, "fatal": True, "detail": "max |Δ| 2.0e-07"}


def row(check, ok, fatal):
    return {"check": check, "ok": ok, "fatal": fatal, "detail": "why"}


@pytest.mark.parametrize("rows, code, says", [
    ([row("transformers >= 5.3", True, True), row("nvcc matches torch's CUDA", False, False)], 0, "warn nvcc"),
    ([row("transformers >= 5.3", False, True), row("nvcc matches torch's CUDA", False, False)], 1, "NO   transformers"),
    ([row("transformers >= 5.3", True, True)], 0, "ok   transformers"),
])
def test_only_a_package_problem_fails_the_set_up_a_cuda_toolkit_one_is_a_warning(rows, code, says, monkeypatch, capsys):
    monkeypatch.setattr(preflight, "report", lambda fused_adam=False, cpu_adam=True: rows)
    assert main([]) == code
    printed = capsys.readouterr().out
    assert says in printed
    assert ("warning(s)" in printed) == any(not r["ok"] and not r["fatal"] for r in rows)


def test_no_cpu_adam_skips_its_build_and_says_so(monkeypatch, capsys):
    # colab_setup.sh passes --no-cpu-adam for the notebooks that never step DeepSpeedCPUAdam: no build, no row.
    def build(device):
        raise AssertionError("DeepSpeedCPUAdam was built")
    monkeypatch.setattr(preflight, "adam_op_matches_torch", build)
    rows = preflight.report(cpu_adam=False)
    assert not any(r["check"].startswith("DeepSpeedCPUAdam") for r in rows)
    assert {r["check"].split(" ")[0] for r in rows if r["fatal"]} >= set(MINIMUM_VERSIONS)   # the other checks stay
    assert main(["--no-cpu-adam"]) == 0
    assert "DeepSpeedCPUAdam not built (--no-cpu-adam)" in capsys.readouterr().out


def test_this_machine_passes_its_own_preflight():
    rows = preflight.report()   # on a GPU also its CUDA-build rows, which may warn (nvcc is the machine's)
    assert [r for r in rows if not r["ok"] and (r["fatal"] or r["check"].startswith("DeepSpeedCPUAdam"))] == []
    assert {r["check"].split(" ")[0] for r in rows if r["fatal"]} >= set(MINIMUM_VERSIONS)


@pytest.mark.parametrize("arch_list, fix", [
    (None, None), ("", None), ("8.0;9.0+PTX", None), ("7.5 8.6", None),
    ("9.0a", "'9.0'"), ("8.0;9.0a;10.0f+PTX", "'8.0;9.0;10.0+PTX'"),
])
def test_an_arch_list_deepspeeds_builder_cannot_read_is_refused_with_the_one_it_can(arch_list, fix, monkeypatch):
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder
    problem = arch_list_problem(arch_list)
    assert (problem is None) == (fix is None)

    def deepspeed_reads(value):   # DeepSpeed's own parsing of the variable, as its JIT build of FusedAdam runs it
        builder = FusedAdamBuilder()
        builder.jit_mode = True
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
        builder.compute_capability_args()

    if fix is None:
        if arch_list:
            deepspeed_reads(arch_list)
        return
    assert problem.startswith(f"TORCH_CUDA_ARCH_LIST={arch_list!r}") and f"set TORCH_CUDA_ARCH_LIST={fix}" in problem
    with pytest.raises(ValueError, match="invalid literal for int"):
        deepspeed_reads(arch_list)
    deepspeed_reads(fix.strip("'"))   # the suggested value is one DeepSpeed reads
