"""How long each notebook would take on a Colab T4, estimated from a stored CPU run.

    python -m benchmarks.colab_time            # reads the cell timings stored in notebooks/*.ipynb

The table notebooks/README.md shows under "Time on a Colab T4, estimated" (PAGE) is this one at the CPU peak the
stored run measured (benchmarks.stored_run writes it; --cpu-peak-tflops takes another). Each stored notebook keeps its cells' start
and end times (nbclient records them). Two kinds of cell:
- cells that launch rank programs (`run_program`, `pipeline.run`, a notebook's `torchrun(...)` or `launch(...)` of
  its shown script on 2 ranks, `run_script`): on a single GPU these ranks run on the
  CPU with gloo there too, and a free Colab runtime has 2 vCPUs, like the CI box: their time carries over;
- every other cell runs in the kernel, on the T4. Its compute cannot exceed what this CPU could do in that
  time: seconds x this CPU's matmul peak (in the precision the run trained in: --cpu-peak-tflops, or measured
  now, 1024 x 1024, best of 3) FLOPs at most, times the growth of the model the notebook picks on a GPU (03:
  "small" instead of "tiny", helpers.model.auto_model_size). At the T4's fp16 peak (65 TFLOP/s) that many FLOPs
  take the "in-kernel FLOPs at its peak" column: an upper bound on the FLOPs' own time, not on the Python,
  kernel-launch and JIT-build time around them, which the "in the kernel" column bounds from above instead.
So the estimate is a range: ranks + GPU compute (every in-kernel second is FLOPs) up to ranks + in-kernel
time here (the T4 no faster than 2 CPU cores). Not in it: the set-up each notebook's fresh runtime pays first
(colab_setup.sh's installs, the first DeepSpeedCPUAdam build), which the page lists beside the table.
"""
from __future__ import annotations

import argparse
import datetime

import nbformat

from helpers import REPO_ROOT
from helpers.hardware import GPUS
from helpers.model import MODEL_SIZES, gpt2_param_count

PAGE = REPO_ROOT / "notebooks" / "README.md"   # the page that shows the table markdown() writes
# A cell that starts rank processes (helpers' programs, or a notebook's own shown script under torchrun or the
# deepspeed launcher): its seconds are CPU ranks on a one-GPU Colab too, not kernel time the GPU would shorten.
RANK_LAUNCHES = ("run_program(", "pipeline.run(", "torchrun(", 'launch("', "run_script(")   # 01's run("torchrun", 1 rank) keeps the GPU
GPU_MODEL_GROWTH = {"03": ("tiny", "small"), "08": ("tiny", "small"), "09": ("tiny", "small")}   # notebook -> (CPU model, GPU model) where auto_model_size differs


def cell_seconds(cell) -> float:
    times = cell.get("metadata", {}).get("execution", {})
    if "iopub.execute_input" not in times or "shell.execute_reply" not in times:
        return 0.0
    start, end = (datetime.datetime.fromisoformat(times[k].replace("Z", "+00:00"))
                  for k in ("iopub.execute_input", "shell.execute_reply"))
    return (end - start).total_seconds()


def growth(notebook: str, vocab: int = 130, seq_len: int = 64) -> float:
    """Parameters of the GPU's model over the CPU's, for a notebook whose model size follows the device."""
    if notebook not in GPU_MODEL_GROWTH:
        return 1.0
    cpu, gpu = (gpt2_param_count(vocab, seq_len, *MODEL_SIZES[size][:2]) for size in GPU_MODEL_GROWTH[notebook])
    return gpu / cpu


def estimate(cpu_peak_tflops: float, gpu: str = "T4") -> list[dict]:
    """Per notebook: seconds here (all, in rank programs, in the kernel) and the T4 range (see the module doc)."""
    rows = []
    for path in sorted((REPO_ROOT / "notebooks").glob("[0-9]*.ipynb")):
        code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        ranks = sum(cell_seconds(c) for c in code if any(k in c.source for k in RANK_LAUNCHES))
        kernel = sum(cell_seconds(c) for c in code) - ranks
        compute = kernel * cpu_peak_tflops * growth(path.stem[:2]) / GPUS[gpu]["peak_tflops"]
        rows.append({"notebook": path.stem, "here s": ranks + kernel, "rank programs s": ranks,
                     "in the kernel s": kernel, f"{gpu} GPU compute s (at most)": compute,
                     f"{gpu} estimate s": (ranks + compute, ranks + kernel)})
    return rows


def markdown(rows: list[dict], gpu: str = "T4") -> str:
    lines = [f"| notebook | here (s) | of which rank programs | in the kernel | {gpu}: in-kernel FLOPs at its peak | "
             f"{gpu} estimate |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        low, high = r[f"{gpu} estimate s"]
        lines.append(f"| {r['notebook']} | {r['here s']:.0f} | {r['rank programs s']:.0f} | {r['in the kernel s']:.0f} | "
                     f"{r[f'{gpu} GPU compute s (at most)']:.1f} | {low / 60:.1f}-{high / 60:.1f} min |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-peak-tflops", type=float, default=None,
                   help="this CPU's matmul peak in the run's precision (default: measured now, 1024 x 1024, best of 3)")
    a = p.parse_args(argv)
    if a.cpu_peak_tflops is None:
        from helpers.runtime import detect
        rt = detect()
        from helpers.precision import dtype, matmul_tflops
        a.cpu_peak_tflops = max(matmul_tflops(dtype(rt.precision), "cpu", n=1024) for _ in range(3))
        print(f"this CPU: {a.cpu_peak_tflops:.3f} TFLOP/s in {rt.precision} (1024 x 1024 matmul, best of 3)")
    for notebook, (cpu, gpu) in GPU_MODEL_GROWTH.items():
        print(f"notebook {notebook}: its model grows {growth(notebook):.1f}x in parameters on a GPU ({cpu} -> {gpu})")
    print(markdown(estimate(a.cpu_peak_tflops)))


if __name__ == "__main__":
    main()
