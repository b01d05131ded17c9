"""The GPU preflight's rules (notebook 01, colab_setup.sh), on the cases a Colab runtime can present, and its
Adam-op check on this machine's own op, against torch's AdamW."""
import pytest

from helpers.preflight import adam_op_matches_torch, arch_list_problem, cuda_problem, release, version_problems


@pytest.mark.parametrize("text, expected", [("2.13.0+cu126", (2, 13, 0)), ("4.56.0.dev0", (4, 56, 0)),
                                            ("12.4", (12, 4)), ("8.1.9", (8, 1, 9)), ("1.15.0rc1", (1, 15, 0))])
def test_versions_compare_by_their_numbers(text, expected):
    assert release(text) == expected


def test_old_or_missing_packages_are_named_with_the_install_line():
    problems = version_problems({"transformers": "4.46.2", "torch": "2.13.0+cu126", "accelerate": None},
                                {"transformers": "4.56", "torch": "2.6", "accelerate": "1.1"})
    assert problems == ["transformers 4.46.2 is older than 4.56, which the helpers need: pip install -U 'transformers>=4.56'",
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
