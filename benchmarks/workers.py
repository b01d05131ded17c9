"""Each contender in a process of its own, driven one block of steps at a time by the parent.

Why processes: a process's peak memory covers everything it ever ran, so contenders sharing one process
could not be told apart. Why one block at a time: the parent alternates the contenders, so at any moment
exactly one of them computes while the others wait on their pipe (idle, no CPU), and a busy spell of
the machine hits them all alike.

Memory per worker: on a GPU the CUDA allocator's peak; on a CPU the peak resident set (VmHWM), reset
after imports and data are loaded (helpers.memory.measured.memory_mark), reported with that baseline.
"""
from __future__ import annotations

import multiprocessing
import os
import resource
import shutil
import time
import traceback
from pathlib import Path

import torch

from helpers.memory.measured import memory_mark, peak_memory, storage_bytes


class WorkerError(RuntimeError):
    """A contender failed in its worker process; the message carries its traceback and log file."""


def tensor_bytes(*roots) -> int:
    """Bytes of the distinct tensor storages reachable from roots through containers and the attributes of
    torch.optim / DeepSpeed objects (where ZeRO keeps its flat buffers): parameters, gradients,
    optimizer state, communication buckets. On a CPU, pages never touched are not resident."""
    seen, tensors, todo = set(), [], list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            todo += [obj.grad] if obj.grad is not None else []
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set)):
            todo += obj
        elif type(obj).__module__.startswith(("torch.optim", "deepspeed")) and hasattr(obj, "__dict__"):
            todo += vars(obj).values()
    return storage_bytes(tensors)   # each storage once: views and tied weights share one


def serve(conn, name: str, data, setup, log_path: str) -> None:
    """The worker's side: build the contender, then obey ('train', k), ('report', None), ('stop', None)."""
    with open(log_path, "a") as log:   # DeepSpeed and transformers print; the benchmark's output stays clean
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    # An empty inductor cache of its own: a compiled contender's compile time is that of a first run.
    cache = Path(setup.out_dir) / "inductor_cache" / name
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    try:
        from .contenders import make_contender
        torch.set_num_threads(setup.threads)
        baseline = memory_mark(setup.device)
        contender = make_contender(name, data, setup)
        conn.send(("ok", None))
        while True:
            command, arg = conn.recv()
            if command == "train":
                wall, cpu = time.perf_counter(), time.process_time()   # process_time: all this process's threads
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt   # pages the kernel had to map in
                contender.train(arg)
                if setup.device == "cuda":
                    torch.cuda.synchronize()
                conn.send(("ok", {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                                  "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}))
            elif command == "report":
                contender.finish()
                conn.send(("ok", {"losses": contender.losses, "lrs": contender.lrs,
                                  "baseline_bytes": baseline, "peak_bytes": peak_memory(setup.device),
                                  "state_bytes": tensor_bytes(*contender.state())}))
            else:
                return
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class Worker:
    """The parent's handle on one contender's process."""

    def __init__(self, name: str, data, setup):
        self.name, self.log = name, Path(setup.out_dir) / f"{name}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_text("")
        ctx = multiprocessing.get_context("spawn")   # a fresh interpreter: no state inherited from the parent
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, name, data, setup, str(self.log)), daemon=True)
        self.process.start()
        child.close()   # so a dead worker reads as EOF here instead of a hang

    def wait(self):
        """The answer to the last command (the first one: the contender is built)."""
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise WorkerError(f"{self.name}: the worker process died (exit code {self.process.exitcode}); "
                              f"see {self.log}") from None
        if status == "error":
            raise WorkerError(f"{self.name} failed (log: {self.log}):\n{value}")
        return value

    def call(self, command: str, arg=None):
        self.conn.send((command, arg))
        return self.wait()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop", None))
            except OSError:
                pass
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
