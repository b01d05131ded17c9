"""ZeRO-Infinity (notebook 08): ZeRO-3 with the optimizer state and the parameters offloaded to NVMe, i.e. to
files on a disk, instead of host RAM (Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the GPU Memory Wall").

    torchrun --nproc_per_node 2 -m helpers.programs.zero_infinity --out runs/zero_infinity --steps 4

The program trains the same model (same seed, same batches) twice with ZeRO-3: first with `offload_optimizer`
and `offload_param` on {"device": "cpu"} (ZeRO-Offload), then on {"device": "nvme", "nvme_path": OUT/nvme}
(ZeRO-Infinity). Both runs do the same arithmetic (DeepSpeedCPUAdam on the same fp32 partitions), so their
losses are equal; only where the bytes wait between uses changes. Per run and rank it records the losses,
the seconds per step, the bytes in each tier (device, host, disk) and, for NVMe, the swap files DeepSpeed
wrote with their sizes (notebook 08 holds them against the paper's accounting).

NVMe offload reads and writes with Linux's libaio through DeepSpeed's async_io op (built on first use, which
takes minutes); `nvme_available()` says whether it can be built here. On a CPU-only machine the "device" is
the CPU as well, and "nvme" is whatever disk holds OUT: the structure is ZeRO-Infinity's, the speeds are not.
"""
import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import deepspeed
import torch
from transformers import set_seed

from helpers.batches import ResumableBatches
from helpers.config import build_config, validate
from helpers.data import SyntheticTextDataset
from helpers.errors import integer, number
from helpers.launch import save_config, write_result
from helpers.memory.measured import measurement_zero_extra, storage_bytes, tensors_in
from helpers.model import MODEL_SIZES, build_model
from helpers.precision import add_precision_flag
from helpers.runtime import detect, process_rank, rank_process, resolve_precision, world_size

SWAP_MIN_BYTES = 2**20   # DeepSpeed swaps a tensor only from 1 MiB on (swap_tensor/utils.py MIN_AIO_BYTES)
AIO = {"block_size": SWAP_MIN_BYTES, "queue_depth": 8, "intra_op_parallelism": 1,   # DeepSpeed's defaults,
       "single_submit": False, "overlap_events": True}   # written out: block_size also raises the threshold above
NO_LIBAIO = ("NVMe offload needs DeepSpeed's async_io op, which cannot be built here: libaio is missing; "
             "install it (apt-get install libaio-dev) and run again, or offload to 'cpu' only")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=integer(2, "the first step is not timed"), default=4)
    p.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
    p.add_argument("--vocab", type=integer(1), default=4096,
                   help="the model's vocabulary (>= the data's): sets the embedding, the one partition over 1 MiB")
    p.add_argument("--seq-len", type=integer(2), default=32)
    p.add_argument("--micro-batch", type=integer(1), default=2)
    p.add_argument("--lr", type=number(), default=3e-3)
    add_precision_flag(p)
    p.add_argument("--seed", type=integer(0), default=0)
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    with rank_process() as world:   # quiet logs, the launcher's group; at the end a barrier and the group's end
        check_options(a, world)
        rt = detect()
        precision = resolve_precision(a.precision, rt)
        data = SyntheticTextDataset("markov", n_samples=256, seq_len=a.seq_len, seed=a.seed)
        if data.vocab_size > a.vocab:
            raise ValueError(f"vocab={a.vocab} is under the data vocab {data.vocab_size}: use vocab >= {data.vocab_size}")
        if process_rank() == 0:   # DeepSpeed clears its parameter folders, not the optimizer's: start empty
            shutil.rmtree(Path(a.out) / "nvme", ignore_errors=True)
        torch.distributed.barrier()
        runs = {kind: run(a, kind, data, precision) for kind in ("cpu", "nvme")}
        write_result(a.out, {"runs": runs, "losses_equal": runs["cpu"]["losses"] == runs["nvme"]["losses"],
                             "world_size": world, "precision": precision, "device": rt.device,
                             "model_size": a.model_size, "vocab_size": a.vocab, "data_vocab_size": data.vocab_size,
                             "seq_len": a.seq_len, "micro_batch": a.micro_batch, "steps": a.steps,
                             "nvme_path": str((Path(a.out) / "nvme").resolve())})


def nvme_available() -> bool:
    """Whether DeepSpeed's async_io op (libaio) can be built on this machine: what NVMe offload needs. DeepSpeed's
    own test (AsyncIOBuilder.is_compatible), run in a fresh interpreter: it compiles a probe with stderr redirected
    by file descriptor, and in a notebook kernel whose stderr has none (nbval's) it answers False, whatever is installed."""
    probe = "from deepspeed.ops.op_builder import AsyncIOBuilder as B; raise SystemExit(0 if B().is_compatible() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def check_options(a, world_size: int) -> None:
    """ValueError, before any rank starts, for a run whose parameters would never reach the disk, or a machine
    where nothing can (no libaio)."""
    hidden = MODEL_SIZES[a.model_size][1]
    partition = a.vocab * hidden // world_size * 2   # the embedding's partition in 16 bits: the largest one
    if partition < SWAP_MIN_BYTES:
        least = -(-SWAP_MIN_BYTES * world_size // (2 * hidden))
        raise ValueError(f"vocab={a.vocab} x hidden {hidden} / {world_size} ranks is a {partition} B partition, under "
                         f"the 1 MiB DeepSpeed swaps to NVMe: no parameter would reach the disk; use vocab >= {least}")
    if not nvme_available():   # else DeepSpeed fails building async_io inside the first rank's initialize
        raise ValueError(NO_LIBAIO)


def offload_blocks(kind: str, nvme: Path, largest_numel: int) -> dict:
    """offload_optimizer and offload_param of one run: host RAM ("cpu") or files under `nvme` ("nvme")."""
    if kind == "cpu":
        return {"offload_optimizer": {"device": "cpu", "pin_memory": False},
                "offload_param": {"device": "cpu", "pin_memory": False}}
    return {"offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False,
                                  "buffer_count": 4},   # fp32 partitions staged in RAM while Adam runs
            "offload_param": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False, "buffer_count": 5,
                              "buffer_size": largest_numel}}   # each read buffer holds the largest partition whole


def infinity_config(a, kind: str, precision: str, model, nvme: Path) -> dict:
    """The run's DeepSpeed config: ZeRO-3, everything offloaded to `kind`, DeepSpeedCPUAdam as the optimizer."""
    n_params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())   # the whole parameter bounds its partition
    zero = {**measurement_zero_extra(n_params),   # buckets of the model's size; every parameter partitioned
            # With a prefetch bucket DeepSpeed 0.19 swaps in a parameter it has already assigned a read buffer,
            # and the second step fails ("param N already assigned swap buffer id"): fetch on demand only.
            "stage3_prefetch_bucket_size": 0,
            **offload_blocks(kind, nvme, largest)}
    config = build_config(micro_batch=a.micro_batch, world_size=world_size(), zero_stage=3, precision=precision,
                          lr=a.lr, warmup_steps=2, total_steps=2 * a.steps, device=detect().device,
                          offload_optimizer=True, offload_param=True,   # DeepSpeedCPUAdam, not torch's AdamW
                          zero_extra=zero)   # the offload blocks above are kept as written
    if kind == "nvme":
        config["aio"] = dict(AIO)
    return validate(config, device=detect().device, world_size=world_size())


def swap_files(nvme: Path, rank: int) -> dict:
    """This rank's swap files under `nvme`, by what they hold, as {kind: {relative path: bytes}}. DeepSpeed's
    folders: zero_stage_3/<dtype>params/rank<r>/<id>_param.tensor.swp (parameter partitions) and
    zero_stage_3/optimizer/rank<r>/ (fp32 master partition and Adam's m and v, <id>.tensor.swp; gradients
    <id>_gradient_<offset>_<length>.tensor.swp)."""
    files = {"optimizer_states": {}, "gradients": {}, "parameters": {}}
    for path in sorted((nvme / "zero_stage_3").glob(f"*/rank{rank}/*")):
        folder = path.parent.parent.name
        kind = "parameters" if folder.endswith("params") else "gradients" if "_gradient_" in path.name \
            else "optimizer_states"
        files[kind][str(path.relative_to(nvme))] = path.stat().st_size
    return files


def tier_bytes(engine, files: dict) -> dict:
    """Bytes this rank holds in each tier now, between steps. device: the parameters' `p.data` (empty when
    ZeRO-3 has partitioned and offloaded them; on a CPU-only machine the "device" is the CPU too); host: each
    storage once (helpers.memory.measured.storage_bytes), by what it is; disk: the swap files."""
    opt, params, seen = engine.optimizer, list(engine.module.parameters()), set()
    inner = getattr(opt, "optimizer", opt)
    swapper = getattr(opt, "optimizer_swapper", None)
    param_swapper = getattr(params[0], "nvme_swapper", None)
    # param_partitions: ds_tensors, views of one flat copy of this rank's partitions, which DeepSpeed keeps in RAM
    # (up to offload_param.max_in_cpu elements, 1e9 by default) beside the swapped ones' files
    host = {"param_partitions": [p.ds_tensor for p in params],
            "fp32_masters": list(getattr(opt, "fp32_partitioned_groups_flat", [])),
            "adam_states": list(inner.state.values()),
            "grad_partitions": getattr(opt, "grad_partitions_flat_buffer", None),
            "param_swap_buffers": getattr(param_swapper, "buffers", None),   # DeepSpeed's read buffers
            "optimizer_swap_buffers": getattr(getattr(swapper, "swap_buffer_manager", None), "all_buffers", None)}
    host = {name: storage_bytes(tensors_in(objs), seen) for name, objs in host.items()}
    return {"device": sum(p.data.numel() * p.data.element_size() for p in params),
            "device_is": str(engine.device), "host": sum(host.values()), "host_parts": host,
            "disk": sum(sum(kind.values()) for kind in files.values())}


def run(a, kind: str, data, precision: str) -> dict:
    """Train --steps steps with everything offloaded to `kind` ("cpu" or "nvme"); what this rank saw."""
    set_seed(a.seed)
    model = build_model(a.vocab, a.seq_len, a.model_size, data.tokenizer.pad_token_id, a.seed)   # same weights
    nvme = (Path(a.out) / "nvme").resolve()
    config = infinity_config(a, kind, precision, model, nvme)
    save_config(a.out, kind, config)
    if precision == "fp32":
        # deepspeed.initialize partitions the model with zero.Init(dtype=<the params' dtype>), and on an
        # accelerator without fp16 (a CPU) DeepSpeed 0.19's Init._set_dtype then picks bfloat16 instead (its
        # `dtype or float16 if fp16 else bfloat16 if ...` drops the dtype): the NVMe swapper would round fp32
        # partitions to bf16 on disk and the losses drift from the cpu run's. Given no dtype, Init reads the config's.
        deepspeed.zero.Init(module=model, config_dict_or_path=config)
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    batches = ResumableBatches(data, a.micro_batch, a.seed, process_rank(), world_size())   # same batches
    losses, step_s = [], []
    for _ in range(a.steps):
        start = time.perf_counter()
        ids = batches.next().to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        step_s.append(time.perf_counter() - start)
    files = swap_files(nvme, process_rank()) if kind == "nvme" else {}
    result = {"kind": kind, "losses": losses, "step_s": step_s,
              "seconds_per_step": statistics.median(step_s[1:]),   # the first step also allocates and builds
              "tiers": tier_bytes(engine, files), "swap_files": files,
              "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
              "zero_config": config["zero_optimization"], "aio": config.get("aio")}
    engine.destroy()
    return result


if __name__ == "__main__":
    main()
