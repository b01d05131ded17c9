"""What hardware we are on (with the precision helpers.precision picks for it), the distributed setup a
notebook needs, run directories, and glibc's malloc told to keep what a CPU training step frees."""
from __future__ import annotations

import contextlib
import io
import os
import platform
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from . import REPO_ROOT
from .precision import (AUTO, CPU_BF16_FLAGS, PRECISION_ENV, check_name, choose_precision, cpu_flags, cpu_matmul_speeds,
                        cpuinfo_field, forced_precision)


@dataclass(frozen=True)
class Runtime:
    device: str                 # "cuda" or "cpu"
    device_name: str
    capability: tuple | None    # CUDA compute capability, e.g. (7, 5) for a T4
    memory_gb: float            # device memory (GPU) or host RAM (CPU), in GB (10^9 bytes, helpers/README.md)
    precision: str              # "bf16", "fp16" or "fp32"
    reason: str                 # one sentence: why this precision
    matmul_tflops: dict | None = None   # CPU: the measurement behind the choice, {"fp32": .., "bf16": ..}

    @property
    def is_gpu(self) -> bool:
        return self.device == "cuda"


def detect() -> Runtime:
    """Inspect this machine once: device, memory and the precision the tutorial will use.

    Without a GPU it also sets DS_ACCELERATOR=cpu (unless set): the accelerator DeepSpeed would pick
    anyway, said up front, so its timestamped "unable to detect" warning stays out of the notebooks."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cap = (props.major, props.minor)
        forced = forced_precision("cuda", cap)
        precision, reason = choose_precision(cap)
        if forced:
            precision, reason = forced, f"forced by {PRECISION_ENV}={forced} (the rule says {precision}: {reason})"
        return Runtime("cuda", props.name, cap, props.total_memory / 1e9, precision, reason)
    import psutil
    forced = forced_precision("cpu")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    flags = cpu_flags()
    speeds = cpu_matmul_speeds() if set(CPU_BF16_FLAGS) & flags else None
    precision, reason = choose_precision(None, flags, speeds)
    if forced:
        precision, reason = forced, f"forced by {PRECISION_ENV}={forced} (the rule says {precision}: {reason})"
    name = cpuinfo_field("model name") or platform.machine()
    return Runtime("cpu", f"{name} ({os.cpu_count()} cores)", None,
                   psutil.virtual_memory().total / 1e9, precision, reason, speeds)


def resolve_precision(value: str | None, runtime: Runtime | None = None) -> str:
    """The precision a program's --precision value (helpers.precision.add_precision_flag) trains in: "auto" or
    None is the one this machine's rule picks (`runtime`'s, when the caller has detected it already, else
    detect()'s); any other value is that precision's name, checked."""
    if value in (None, AUTO):
        return (runtime or detect()).precision
    return check_name(value)


def free_port() -> int:
    """A TCP port nobody is listening on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", int(port)))
        except OSError:
            return False
        return True


def init_single_process() -> dict[str, str]:
    """Make this (notebook) process a 1-rank distributed job, as a launcher would (without these variables
    `deepspeed.initialize` falls back to MPI discovery). Only missing ones are set, and an existing group
    is kept, so a launcher's values win and re-running a notebook is safe."""
    import deepspeed
    dist = torch.distributed
    if not dist.is_initialized():
        defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        for key, value in defaults.items():
            os.environ.setdefault(key, value)
        if "MASTER_PORT" not in os.environ or (os.environ["WORLD_SIZE"] == "1" and "TORCHELASTIC_RUN_ID" not in os.environ
                                               and not port_is_free(os.environ["MASTER_PORT"])):
            # a 1-rank job's port is its own (except under torchrun, whose agent listens on it for the rank):
            # one inherited from a process that holds it (a notebook kernel running
            # `!python -m helpers.programs.train`) would end in EADDRINUSE
            os.environ["MASTER_PORT"] = str(free_port())
        with silenced_stderr():   # DeepSpeed probes every op once here; the libaio link test's error is noise
            import deepspeed.ops
            deepspeed.ops.__compatible_ops__
        with contextlib.redirect_stdout(io.StringIO()):   # its CPU backend prints "... built successfully" every time
            deepspeed.init_distributed(verbose=False)
    else:   # the group exists; deepspeed.initialize still reads these three from the environment
        for key, value in (("RANK", dist.get_rank()), ("LOCAL_RANK", dist.get_rank()),
                           ("WORLD_SIZE", dist.get_world_size())):
            os.environ.setdefault(key, str(value))
    return {k: os.environ.get(k, "") for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def collective_device(group=None) -> torch.device:
    """A device whose tensors the process group can reduce: the accelerator's (a GPU under NCCL, the CPU under
    gloo) where the group has a backend for it, else the first device type it has one for. NCCL has no CPU
    backend: a CPU tensor in a collective fails there ("No backend type associated with device type cpu")."""
    from deepspeed.accelerator import get_accelerator
    served = [entry.split(":")[0] for entry in torch.distributed.get_backend_config(group).split(",")]
    accelerator = get_accelerator()
    if accelerator.device_name() in served:
        return torch.device(accelerator.current_device_name())
    return torch.device(served[0])


def process_rank() -> int:
    """This process's rank: from the live process group, else what a launcher announced, else 0."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """Ranks in this job: the live process group's size, else what a launcher announced, else 1."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """Ranks of this job on this machine: what torchrun (LOCAL_WORLD_SIZE) or the deepspeed launcher
    (LOCAL_SIZE) announced, else the world size (every rank here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world_size())


def quiet_deepspeed(level: str = "WARNING") -> None:
    """DeepSpeed logs a lot at INFO; notebooks show only warnings and errors, minus two known
    harmless ones: torch 2.13 deprecates collectives DeepSpeed 0.19 still calls, and DeepSpeed's
    scheduler warns when the LR is read before the first step (the trainer records it every step)."""
    import logging
    import warnings
    from deepspeed.utils import logger
    logger.setLevel(getattr(logging, level))
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    if not any(getattr(f, "name", "") == "lr-before-start" for f in logger.filters):
        lr_filter = logging.Filter("lr-before-start")
        lr_filter.filter = lambda record: "before it has started" not in record.getMessage()
        logger.addFilter(lr_filter)


@contextlib.contextmanager
def rank_process():
    """One rank program's start-up and shutdown, around its work: DeepSpeed's logs quieted, the process in its
    group (under a launcher it joins the launcher's; run with plain python it is a 1-rank job), the world size
    yielded. After the block every rank waits for the others, then the group ends while Python is alive.
    An exception inside the block goes on up as it is, the group left alone: no barrier, which ranks that
    failed elsewhere would never reach (a hang); the launcher ends the ranks."""
    quiet_deepspeed()
    init_single_process()   # under a launcher: joins the launcher's group
    yield torch.distributed.get_world_size()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()   # gloo's threads end before exit can abort them (SIGABRT)


def environment_report(runtime: Runtime) -> dict[str, str]:
    """What a bug report needs: versions, device, and the precision this tutorial will use."""
    import sys
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    cap = f"sm_{runtime.capability[0]}{runtime.capability[1]}" if runtime.capability else "n/a (no CUDA)"
    return {"Python": sys.version.split()[0], "torch": torch.__version__,
            "CUDA (torch build)": torch.version.cuda or "none (CPU build)",
            "device": runtime.device_name, "compute capability": cap,
            "memory": f"{runtime.memory_gb:.1f} GB", "DeepSpeed": deepspeed.__version__,
            "DeepSpeed accelerator": get_accelerator().device_name(),
            "communication backend": get_accelerator().communication_backend_name(),
            "precision": f"{runtime.precision}: {runtime.reason}"}


def deepspeed_ops() -> dict[str, dict[str, bool]]:
    """For each DeepSpeed C++/CUDA op: can it JIT-build here, and is a build already cached?"""
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    from deepspeed.ops.op_builder.builder import probe_is_compatible
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    built = {p.name for p in cache.glob("*/*") if p.is_dir()}
    with silenced_stderr():   # the probes try test compiles whose linker errors are expected noise
        return {name: {"compatible": bool(probe_is_compatible(builder, False)), "built": name in built}
                for name, builder in ALL_OPS.items()}


@contextlib.contextmanager
def silenced_stderr():
    """Send file descriptor 2 to /dev/null for a moment (catches C-level output too)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run_dir(name: str) -> Path:
    """Where a notebook writes everything it makes: $TUTORIAL_RUN_DIR/<name>, default <repo>/runs/<name>."""
    root = os.environ.get("TUTORIAL_RUN_DIR") or REPO_ROOT / "runs"
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory a CPU training step frees, so the next step reuses its pages
    instead of faulting fresh ones in (notebook 03 measures why). Process-wide; False where malloc is not
    glibc's (nothing changed) or glibc refused a setting (the others still applied)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    import ctypes
    libc = ctypes.CDLL(None)
    # no block gets a mapping of its own; the heap is trimmed only past 1 GiB free (M_TRIM_THRESHOLD) and grows
    # in 256 MiB strides (M_TOP_PAD)
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**30), (M_TOP_PAD, 2**28))
    accepted = [libc.mallopt(param, value) == 1 for param, value in settings]   # each tried, even after a refusal
    return all(accepted)


def compile_problem(device: str) -> str | None:
    """Why torch.compile cannot generate kernels on `device`, or None where it can. On a GPU inductor writes
    Triton kernels, and whether this Triton compiles for this GPU (a T4 is sm_75; recent Triton releases
    target newer GPUs first) is answered here by compiling and running one small function on it, not by a
    version table. On a CPU inductor writes C++ with the compiler torch finds (tested in CI)."""
    if device == "cpu":
        return None
    try:
        twice_plus_one = torch.compile(lambda x: x * 2 + 1)
        ok = torch.equal(twice_plus_one(torch.ones(8, device=device)), torch.full((8,), 3.0, device=device))
    except Exception as err:   # inductor/Triton raise many types; the reader needs the first line
        return f"torch.compile failed on {device}: {str(err).strip().splitlines()[0][:200]}"
    return None if ok else "torch.compile ran on this GPU but computed a wrong result"


def open_files() -> set[Path]:
    """Every file some process on this machine holds open (Linux: /proc/<pid>/fd), those this user may see."""
    held = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            held.update(Path(os.readlink(fd)) for fd in fd_dir.iterdir())
        except OSError:   # the process ended, or is another user's
            continue
    return held


def remove_stale_locks(root: Path) -> list[Path]:
    """Remove the JIT `lock` files under `root` (DeepSpeed's ops build in ~/.cache/torch_extensions/<op>/) that no
    process holds open. torch's builder holds its op's `lock` open while it compiles; one killed mid-build leaves
    the file behind, and every later build of that op waits on it forever (the tests and the GPU kit clear them)."""
    locks = [p.resolve() for p in Path(root).glob("**/lock") if p.is_file()]
    stale = [p for p in locks if p not in open_files()] if locks else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def stuck_stack(code: str, env: dict[str, str], timeout: float = 120) -> list[tuple[str, str]]:
    """Run `python -c code` and, once it stops moving, return where it waits: its stack as (file name, function)
    pairs, innermost first, as `py-spy dump` would show it. The child dumps its stack on SIGUSR1 (faulthandler);
    "stuck" is the same stack in two dumps a second apart. The child is killed afterwards. Raises TimeoutError
    (with the last stack) if it is still moving after `timeout` seconds, or RuntimeError if it ends first."""
    import re
    import signal
    import subprocess
    import sys
    import time
    prologue = ("import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=False); "
                "print('registered', file=sys.stderr, flush=True); ")   # before it, SIGUSR1 would end the child
    child = subprocess.Popen([sys.executable, "-c", prologue + code], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    dumps, deadline = [], time.monotonic() + timeout
    try:
        if child.stderr.readline().strip() != "registered":
            raise RuntimeError("the process ended before it could report its stack")
        os.set_blocking(child.stderr.fileno(), False)
        while time.monotonic() < deadline and child.poll() is None:
            time.sleep(1)
            child.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            text = child.stderr.read() or ""
            if "most recent call first" in text:
                dumps.append(re.findall(r'File "(?:.*/)?([^/"]+)", line \d+ in (\S+)', text.split("most recent call first")[-1]))
            if len(dumps) >= 2 and dumps[-1] == dumps[-2] and dumps[-1]:
                return dumps[-1]
        if child.poll() is not None:
            raise RuntimeError(f"the process ended (exit code {child.returncode}) before it was stuck")
        raise TimeoutError(f"still moving after {timeout} s; last stack: {dumps[-1] if dumps else None}")
    finally:
        child.kill()
        child.wait()
