"""The device matrix: every config the notebooks, the trainer, configs/ and benchmarks/gpu.py would build, built
for a T4, an A100 40GB, an H200 and a CPU, and validated as DeepSpeed would see it there; the sizes they pick,
checked against each device's memory by the tutorial's formulas; the planner's plans against the host RAM.

No GPU is needed: `helpers.hardware.runtime_for` gives the `Runtime` detect() returns on each GPU, and the
notebooks' config cells (tag `device-config`) run with it as `rt`. tests/test_device_matrix.py asserts the
verdicts; `python -m tests.device_matrix` prints the table notebooks/README.md shows under "What each path needs"
(PAGE), and a test keeps the two equal.
"""
from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import nbformat

from helpers import REPO_ROOT
from helpers.config import load_json, validate
from helpers.errors import ConfigError
from helpers.hardware import GPUS, MATRIX_GPUS, runtime_for
from helpers.memory import formulas, planner
from helpers.model import MODEL_SIZES, auto_model_size, gpt2_param_count
from helpers.runtime import Runtime

CONFIG_TAG = "device-config"
CPUS = {"CPU (fp32)": "fp32", "CPU (bf16)": "bf16"}   # the two precisions the rule can pick on a CPU
SIMULATED_CPU_GB = 24.0   # the CI box's RAM: the CPU column's "fits" is read against it
PAGE = REPO_ROOT / "notebooks" / "README.md"   # the page that shows table()


def profiles() -> dict[str, Runtime]:
    """Every column of the matrix: the matrix GPUs, and a CPU in each precision its rule can pick."""
    gpus = {name: runtime_for(name) for name in MATRIX_GPUS}
    cpus = {name: Runtime("cpu", "a CPU", None, SIMULATED_CPU_GB, precision, f"the CPU rule picked {precision}")
            for name, precision in CPUS.items()}
    return {**gpus, **cpus}


def is_deepspeed_config(value) -> bool:
    return isinstance(value, dict) and ("train_micro_batch_size_per_gpu" in value or "train_batch_size" in value)


def notebook_configs(path: Path, rt: Runtime) -> dict[str, dict]:
    """Run a notebook's parameters cell and its `device-config` cells with `rt`; every DeepSpeed config they build."""
    cells = nbformat.read(path, as_version=4).cells
    chosen = [c for c in cells if {"parameters", CONFIG_TAG} & set(c.metadata.get("tags", []))]
    space = {"rt": rt, "RUN": Path(tempfile.mkdtemp(prefix="matrix-"))}
    with contextlib.redirect_stdout(io.StringIO()):   # the cells print their configs for the reader
        for cell in chosen:
            exec(cell.source, space)   # noqa: S102 (the notebook's own code, as the reader runs it)
    return {f"{path.stem}: {name}": value for name, value in space.items() if is_deepspeed_config(value)}


def trainer_configs(rt: Runtime) -> dict[str, dict]:
    """The trainer's config at each ZeRO stage and offload the notebooks and programs run."""
    from helpers.config import build_config, validate
    settings = {f"ZeRO {s}": dict(zero_stage=s) for s in (0, 1, 2, 3)}
    settings |= {"ZeRO 2 + offload optimizer": dict(zero_stage=2, offload_optimizer=True),
                 "ZeRO 3 + offload optimizer + params": dict(zero_stage=3, offload_optimizer=True, offload_param=True)}
    built = {}
    for name, choice in settings.items():
        try:
            config = build_config(micro_batch=16, precision=rt.precision, device=rt.device, **choice)
            built[f"trainer: {name}"] = validate(config, device=rt.device, capability=rt.capability)
        except ConfigError as err:   # as the trainer validates: keep the refusal for the verdict
            built[f"trainer: {name}"] = err
    return built


def gpu_script_configs(rt: Runtime) -> dict[str, dict]:
    """The training configs benchmarks/gpu.py would run on this GPU (none on a CPU: it runs nothing there)."""
    from benchmarks import gpu_plan as gpu
    if not rt.is_gpu:
        return {}
    gpu_name = rt.device_name.removeprefix("NVIDIA ")
    planned = gpu.parts(Path(tempfile.mkdtemp()), rt.capability, GPUS[gpu_name]["memory_gb"])
    return {f"gpu.py: {p['name']}": p.get("config") or load_json(REPO_ROOT / p["command"][p["command"].index("--config") + 1])
            for p in planned if p["command"] and "--config" in p["command"]}


def expected_refusal(config: dict, rt: Runtime) -> str | None:
    """What the validator must say of a config on this device, or None where DeepSpeed runs it. Only three
    things a notebook builds are device-bound, and each notebook runs them only where they hold."""
    zero = config.get("zero_optimization", {})
    if config.get("fp16", {}).get("enabled") and not rt.is_gpu:
        return "fp16.enabled is true but this device is a CPU"
    if (zero.get("zero_quantized_weights") or zero.get("zero_quantized_gradients")) and not rt.is_gpu:
        return "(ZeRO++) is not implemented on a CPU"
    if config.get("bf16", {}).get("enabled") and rt.is_gpu and rt.precision != "bf16":
        return "has no bf16 tensor cores"
    return None


def verdict(config, rt: Runtime) -> tuple[bool, str]:
    """(as expected, what happened) for one config on one device."""
    if isinstance(config, ConfigError):
        return False, f"refused: {config}"
    expected = expected_refusal(config, rt)
    try:
        validate(config, device=rt.device, capability=rt.capability)
    except ConfigError as err:
        return expected is not None and expected in str(err), f"refused: {err}"
    return expected is None, "accepted"


def all_configs(rt: Runtime) -> dict[str, dict]:
    built = {}
    for path in sorted((REPO_ROOT / "notebooks").glob("[0-9]*.ipynb")):
        built |= notebook_configs(path, rt)
    built |= trainer_configs(rt)
    built |= {f"configs/{p.name}": load_json(p) for p in sorted((REPO_ROOT / "configs").glob("*.json"))}
    return built | gpu_script_configs(rt)


def parameters(notebook: str) -> dict:
    """A notebook's parameters cell, run: the sizes it trains at."""
    path = next((REPO_ROOT / "notebooks").glob(f"{notebook}_*.ipynb"))
    cell = next(c for c in nbformat.read(path, as_version=4).cells if "parameters" in c.metadata.get("tags", []))
    space = {}
    exec(cell.source, space)   # noqa: S102
    return space


def training_gb(size: str, seq_len: int, micro_batch: int, precision: str, overhead_gb: float, vocab: int = 130) -> float:
    """GB one in-kernel training run needs by notebook 05's planner (the formulas notebooks 04-05 teach): model
    states at ZeRO 0, activations with the logits, and a GPU's fixed overhead (the CUDA context, workspaces)."""
    n_layer, hidden, heads = MODEL_SIZES[size]
    shape = {"params": gpt2_param_count(vocab, seq_len, n_layer, hidden), "largest_layer_params": vocab * hidden,
             "n_layer": n_layer, "hidden": hidden, "heads": heads, "vocab": vocab, "context": seq_len}
    rows = planner.plan(shape, float("inf"), precision=precision, micro_batches=(micro_batch,), overhead_gb=overhead_gb)
    return planner.row_for(rows, 0, micro_batch=micro_batch)["gpu_gb"]


def in_kernel_trainings(rt: Runtime) -> dict[str, float]:
    """GB of the largest training each notebook runs in the kernel (on the device) at the sizes it picks."""
    p03, p05 = parameters("03"), parameters("05")
    size03 = auto_model_size(rt) if p03["MODEL_SIZE"] == "auto" else p03["MODEL_SIZE"]
    overhead = planner.OVERHEAD_GB if rt.is_gpu else 0.0
    return {f"03: trainer, {size03}, seq {p03['SEQ_LEN']}, micro-batch {p03['MICRO_BATCH']}":
            training_gb(size03, p03["SEQ_LEN"], p03["MICRO_BATCH"], rt.precision, overhead),
            f"05: activation sweep, {p05['MODEL_SIZE']}, seq {max(p05['SEQ_LENS'])}, micro-batch 1":
            training_gb(p05["MODEL_SIZE"], max(p05["SEQ_LENS"]), 1, rt.precision, overhead)}


def gpt2_xl_plan(gpu: str) -> dict | None:
    """The planner's pick for GPT-2 1.5B on one such GPU, with the host RAM beside it (notebook 05)."""
    spec = GPUS[gpu]
    return planner.best_plan("GPT-2 1.5B", spec["memory_gb"], precision=runtime_for(gpu).precision,
                             host_memory_gb=spec["host_gb"])


def deepspeed_host_gb(plan: dict) -> float:
    """DeepSpeed's own estimate of the host RAM a plan's offload needs (its estimators, no safety margin)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    xl = formulas.models()["GPT-2 1.5B"]
    offload = plan["offload"] != "none"
    if plan["stage"] < 3:
        host, _ = estimate_zero2_model_states_mem_needs(xl["params"], 1, 1, cpu_offload=offload,
                                                        additional_buffer_factor=1)
    else:
        host, _, _ = estimate_zero3_model_states_mem_needs(xl["params"], xl["largest_layer_params"], 1, 1,
                                                           cpu_offload=offload, additional_buffer_factor=1,
                                                           cpu_offload_params=plan["offload"] == "optimizer+params")
    return host / formulas.GB if offload else 0.0


def table() -> str:
    """The matrix notebooks/README.md shows (PAGE), one column per device."""
    from benchmarks import gpu_plan as gpu_script
    columns = profiles()
    rows = {name: [] for name in ("precision", "configs built, as DeepSpeed sees them", "device memory",
                                  "03's trainer needs", "05's longest activation run needs",
                                  "`benchmarks/gpu.py`", "GPT-2 1.5B (notebook 05), host RAM included",
                                  "multi-rank experiments (04-06)")}
    for name, rt in columns.items():
        built = all_configs(rt)
        outcomes = [verdict(c, rt) for c in built.values()]
        refused = sum(text.startswith("refused") for _, text in outcomes)
        rows["precision"].append(rt.precision)
        rows["configs built, as DeepSpeed sees them"].append(
            f"{len(built)} built, {len(built) - refused} accepted" + (f", {refused} refused as the notebooks expect"
                                                                     if refused else ""))
        need = list(in_kernel_trainings(rt).values())
        if rt.is_gpu:
            spec = GPUS[name]
            rows["device memory"].append(f"{spec['memory_gb']} GB, host {spec['host_gb']} GB")
            planned = gpu_script.plan(Path(tempfile.mkdtemp()), spec["capability"], spec["memory_gb"])
            notebooks = [j for lane in planned["lanes"] for j in lane["jobs"] if j["command"]]
            bench = planned["benchmark"]
            rows["`benchmarks/gpu.py`"].append(
                f"{len(notebooks)} runs in {len(planned['lanes'])} lanes, caps {gpu_script.caps_total(planned)} s"
                + (f"; benchmark micro-batch {bench['micro_batch']}" if bench["command"] else f"; {bench['skipped']}"))
            plan = gpt2_xl_plan(name)
            rows["GPT-2 1.5B (notebook 05), host RAM included"].append(
                "nothing fits" if plan is None else
                f"ZeRO {plan['stage']}, offload {plan['offload']}, micro-batch {plan['micro_batch']}: "
                f"{plan['gpu_gb']:.1f} GB GPU, {plan['cpu_gb']:.1f} GB host")
            rows["multi-rank experiments (04-06)"].append("CPU ranks, gloo (one GPU hosts one rank)")
        else:
            rows["device memory"].append(f"host RAM ({SIMULATED_CPU_GB:g} GB on the CI box)")
            rows["`benchmarks/gpu.py`"].append("says no GPU, runs nothing")
            rows["GPT-2 1.5B (notebook 05), host RAM included"].append("planned for GPUs only")
            rows["multi-rank experiments (04-06)"].append("CPU ranks, gloo")
        rows["03's trainer needs"].append(f"{need[0]:.2f} GB")
        rows["05's longest activation run needs"].append(f"{need[1]:.2f} GB")
    lines = ["| | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {row} | " + " | ".join(cells) + " |" for row, cells in rows.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
