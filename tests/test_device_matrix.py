"""The device matrix (tests/device_matrix.py): for a T4, an A100 40GB, an H200 and a CPU in either precision,
every config the notebooks, the trainer, configs/ and benchmarks/gpu.py build is what DeepSpeed accepts there
(or refused where the notebook expects it), the sizes they train at fit the device, and the planner's plans
fit the host RAM by DeepSpeed's own estimator; notebooks/README.md shows the table it builds."""
import pytest

from benchmarks import gpu_plan as gpu_script
from helpers import REPO_ROOT
from helpers.hardware import GPUS, MATRIX_GPUS
from helpers.memory import planner
from tests import device_matrix

PROFILES = device_matrix.profiles()


@pytest.mark.parametrize("name", PROFILES)
def test_every_config_is_what_deepspeed_accepts_on_that_device(name):
    rt = PROFILES[name]
    built = device_matrix.all_configs(rt)
    assert any(key.startswith("01_setup") for key in built) and any(key.startswith("03_trainer") for key in built)
    wrong = {key: text for key, config in built.items() for ok, text in [device_matrix.verdict(config, rt)] if not ok}
    assert not wrong, wrong


@pytest.mark.parametrize("name", PROFILES)
def test_what_the_notebooks_train_in_the_kernel_fits_the_device(name):
    rt = PROFILES[name]
    memory = GPUS[name]["memory_gb"] if rt.is_gpu else device_matrix.SIMULATED_CPU_GB
    needs = device_matrix.in_kernel_trainings(rt)
    assert all(gb <= 0.9 * memory for gb in needs.values()), needs


@pytest.mark.parametrize("name", MATRIX_GPUS)
def test_the_gpu_scripts_benchmark_fits_by_the_formulas(name):
    """One process keeps every contender's model states (ZeRO 0) and runs one step at a time: the micro-batch is the
    largest at which n x states + one step's activations + the planner's overhead fit 0.9 of the GPU."""
    from benchmarks import gpu_benchmark
    spec = GPUS[name]
    planned = gpu_script.parts(REPO_ROOT / "runs" / "never-written", spec["capability"], spec["memory_gb"])
    bench = next(p for p in planned if p["name"].startswith("benchmark"))
    n = len(gpu_benchmark.contender_names(compiled=True, hf=True))
    precision = "bf16" if spec["capability"] >= (8, 0) else "fp32"

    def fits(mb):
        row = planner.row_for(planner.plan("GPT-2 124M", float("inf"), precision=precision, micro_batches=(mb,)), 0,
                              micro_batch=mb)
        return n * row["model_states_gb"] + row["activations_gb"] + row["overhead_gb"] <= 0.9 * spec["memory_gb"]
    fitting = [mb for mb in gpu_benchmark.MICRO_BATCHES if fits(mb)]
    assert bench.get("micro_batch") == (max(fitting) if fitting else None), (fitting, bench.get("micro_batch"))


@pytest.mark.parametrize("name", [g for g in MATRIX_GPUS if GPUS[g]["host_gb"]])
def test_the_planners_plan_for_gpt2_xl_fits_the_host_by_deepspeeds_estimator(name):
    plan = device_matrix.gpt2_xl_plan(name)
    spec = GPUS[name]
    if plan is None:   # the T4: every offload that fits its GPU needs more host RAM than Colab gives
        gpu_only = planner.best_plan("GPT-2 1.5B", spec["memory_gb"], precision="fp16")
        assert gpu_only["offload"] != "none"
        assert device_matrix.deepspeed_host_gb(gpu_only) > spec["host_gb"], gpu_only
        return
    assert plan["gpu_gb"] <= spec["memory_gb"]
    assert device_matrix.deepspeed_host_gb(plan) <= spec["host_gb"], plan


def test_the_notebooks_page_shows_the_matrix_as_built_now():
    assert device_matrix.table() in device_matrix.PAGE.read_text(), "python -m tests.device_matrix prints the table"
