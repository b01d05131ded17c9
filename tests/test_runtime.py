"""Precision choice (helpers.precision) and the single-process distributed environment (helpers.runtime)."""
import json
import os
from pathlib import Path

import pytest

from helpers.precision import CPU_BF16_FLAGS, MEASURED_ENV, PRECISION_ENV, choose_precision, cpu_flags
from helpers.runtime import detect, free_port

pytestmark = pytest.mark.precision   # follows the precision rule: run again with the other one forced


# Measured matmul TFLOP/s: an Intel Xeon with avx512_bf16 but no AMX (notebook 01 there), and a
# Sapphire Rapids Xeon with AMX (this project's CI box on 2026-11-30).
XEON_AVX512_BF16 = {"fp32": 0.239, "bf16": 0.134}
XEON_AMX = {"fp32": 0.36, "bf16": 1.27}


@pytest.mark.parametrize("capability, flags, speeds, expected", [
    ((9, 0), set(), None, "bf16"),            # H100 / H200
    ((8, 0), set(), None, "bf16"),            # A100
    ((7, 5), set(), None, "fp16"),            # T4 (Colab free tier)
    ((6, 0), set(), None, "fp16"),            # P100
    (None, {"avx2"}, None, "fp32"),           # CPU without native bf16: emulated, nothing to measure
    (None, {"avx2"}, XEON_AMX, "fp32"),       # speeds without the instructions cannot be native: ignored
    (None, {"avx512_bf16"}, XEON_AVX512_BF16, "fp32"),        # the flag alone is not a speed
    (None, {"avx512_bf16", "amx_bf16"}, XEON_AMX, "bf16"),
    (None, {"amx_bf16"}, {"fp32": 1.0, "bf16": 1.4}, "fp32"),   # faster, but inside the margin
])
def test_precision_rule(capability, flags, speeds, expected):
    precision, reason = choose_precision(capability, flags, speeds)
    assert precision == expected and reason


def test_precision_rule_on_a_bf16_cpu_needs_a_measurement():
    with pytest.raises(ValueError, match="speeds"):
        choose_precision(None, {"amx_bf16"})


def test_detect_on_this_machine_is_consistent():
    rt = detect()
    assert rt.device in ("cpu", "cuda") and rt.memory_gb > 0
    flags = cpu_flags() if rt.device == "cpu" else set()
    rule = choose_precision(rt.capability, flags, rt.matmul_tflops)[0]
    forced = os.environ.get(PRECISION_ENV, "auto")
    assert rt.precision == (rule if forced == "auto" else forced)
    if rt.device == "cpu" and set(CPU_BF16_FLAGS) & flags:
        assert set(rt.matmul_tflops) == {"fp32", "bf16"} and min(rt.matmul_tflops.values()) > 0
        assert "measured" in rt.reason


def test_free_port_is_bindable():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def run_fresh(code: str, **env) -> dict:
    """Run `code` in a new Python process (no process group yet) and return the dict it prints."""
    import json, subprocess, sys
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                              "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


SETUP_TWICE = """
import json
from helpers.runtime import init_single_process
first = init_single_process(); second = init_single_process()
print(json.dumps({"first": first, "second": second}))
"""


def test_single_process_env_fills_only_what_is_missing():
    got = run_fresh(SETUP_TWICE, MASTER_ADDR="localhost")
    first = got["first"]
    assert first["RANK"] == "0" and first["WORLD_SIZE"] == "1" and first["LOCAL_RANK"] == "0"
    assert first["MASTER_ADDR"] == "localhost"        # a value that was already set is kept
    assert int(first["MASTER_PORT"]) > 0
    assert got["second"] == first                      # a re-run changes nothing, the port included


def test_a_one_rank_job_does_not_take_an_inherited_port_another_process_listens_on():
    """`!python -m helpers.programs.train` in a notebook inherits the kernel's MASTER_PORT, which the kernel's
    own process group still listens on: the script's one rank must pick another, not fail with EADDRINUSE."""
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = str(held.getsockname()[1])
        got = run_fresh(SETUP_TWICE, MASTER_PORT=taken)
    assert got["first"]["MASTER_PORT"] != taken and got["first"]["WORLD_SIZE"] == "1"


FORCED = """
import json
from helpers.runtime import detect
rt = detect()
print(json.dumps({"precision": rt.precision, "reason": rt.reason}))
"""


@pytest.mark.parametrize("value", ["fp32", "bf16"])
def test_the_environment_variable_forces_a_precision(value):
    got = run_fresh(FORCED, **{PRECISION_ENV: value})
    assert got["precision"] == value and PRECISION_ENV in got["reason"]


@pytest.mark.parametrize("value", ["fp16", "bf61"])
def test_a_precision_this_cpu_cannot_run_is_refused_naming_the_variable(value):
    import subprocess, sys
    if detect().is_gpu:
        pytest.skip("fp16 is allowed on a GPU")
    env = {**os.environ, PRECISION_ENV: value}
    run = subprocess.run([sys.executable, "-c", FORCED], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode != 0 and f"{PRECISION_ENV}={value!r}" in run.stderr


MEASURE_TWICE = """
import json, os
from helpers.precision import MEASURED_ENV, cpu_matmul_speeds
first = cpu_matmul_speeds(); inherited = os.environ[MEASURED_ENV]; second = cpu_matmul_speeds()
print(json.dumps({"first": first, "second": second, "inherited": inherited}))
"""


def test_the_cpu_measurement_is_taken_once_and_inherited_by_child_processes():
    env = {k: v for k, v in os.environ.items() if k != MEASURED_ENV}
    import json, subprocess, sys
    out = subprocess.run([sys.executable, "-c", MEASURE_TWICE], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["second"] == got["first"]   # read back, not measured again (two timings never agree exactly)
    assert min(got["first"].values()) > 0
    child = run_fresh("import json; from helpers.precision import cpu_matmul_speeds; "
                      "print(json.dumps(cpu_matmul_speeds()))", **{MEASURED_ENV: got["inherited"]})
    assert child == got["first"]


@pytest.mark.parametrize("value", ["fp32=0.3", "fp32=a,bf16=1", "nonsense"])
def test_a_malformed_inherited_measurement_is_refused_naming_the_variable(value):
    import subprocess, sys
    code = "from helpers.precision import cpu_matmul_speeds; cpu_matmul_speeds()"
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, MEASURED_ENV: value}, capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode != 0 and f"{MEASURED_ENV}={value!r}" in run.stderr and "unset it" in run.stderr


STEP_FAULTS = """
import json, resource, statistics, sys, torch
from helpers.model import build_model
from helpers.runtime import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
torch.set_num_threads(1)
model = build_model(4096, 128, "tiny")
ids = torch.randint(0, 4096, (16, 128))   # logits: 16 x 128 x 4096 fp32 = 32 MiB, as large blocks go
def step_faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(input_ids=ids, labels=ids).loss.backward()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
for _ in range(4):   # the first steps fault their pages in either way (the heap grows to the steps' layout)
    step_faults()
# The median step: kept, the heap still grows now and then when a block lands somewhere new (one 32 MiB
# block: 8,192 faults, seen as late as step 10), but most steps fault nothing.
print(json.dumps({"applied": applied, "faults": statistics.median(step_faults() for _ in range(9))}))
"""


def test_kept_memory_spares_later_training_steps_their_page_faults():
    import platform, subprocess, sys
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("keep_freed_memory tunes glibc's malloc only")
    faults = {}
    for mode in ("default", "keep"):   # a process each: the setting is process-wide and cannot be undone
        out = subprocess.run([sys.executable, "-c", STEP_FAULTS, mode], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent.parent).stdout
        faults[mode] = json.loads(out.strip().splitlines()[-1])
    assert faults["keep"]["applied"] is True
    # The kernel's own count. By default glibc maps a block of 32 MiB or more afresh each time (8,192 pages
    # of 4 KiB for the logits alone, more for their gradient and the softmax); kept, the pages are reused.
    assert faults["default"]["faults"] >= 8192, faults
    assert faults["keep"]["faults"] < faults["default"]["faults"] / 10, faults


def test_compile_problem_is_none_where_inductor_builds_and_one_line_where_it_cannot():
    import torch
    from helpers.runtime import compile_problem
    assert compile_problem("cpu") is None   # CI compiles on the CPU in notebook 03 and tests/test_compile.py
    if not torch.cuda.is_available():       # a device this torch cannot run: the reason, in one line
        why = compile_problem("cuda")
        assert why.startswith("torch.compile failed on cuda: ") and "\n" not in why


def test_stuck_stack_names_where_a_stuck_process_waits_and_refuses_one_that_ends():
    import os
    from helpers.runtime import stuck_stack
    waits = "import time\ndef wait_here():\n    while True:\n        time.sleep(0.1)\nwait_here()"
    assert stuck_stack(waits, dict(os.environ))[0] == ("<string>", "wait_here")
    with pytest.raises(RuntimeError, match="ended"):
        stuck_stack("print('done')", dict(os.environ))
