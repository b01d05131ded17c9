"""Show a rank program, run it on N local ranks, and get each rank's result back as data.

A notebook process can be only one rank, so multi-rank experiments are the scripts in helpers/programs/,
run under a launcher. `run_program` turns keyword options into the program's flags (the one place that
does) and checks them with its own parser before any process starts; each rank calls `write_result`;
`launch` returns the results by rank, or raises `RankFailedError` with the failing rank's log
(per-rank logs in OUT_DIR/logs). `run_script` runs a script a notebook wrote, as a terminal would, and returns
what it printed and its exit code, failures included (notebook 10 reproduces them); `run_shown` runs one the
way a notebook shows it, and `rank_lines` picks each rank's lines out of what the ranks printed into one pipe.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import io
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from helpers import REPO_ROOT, with_repo_on_path
from helpers.config import differing_lines, save_json
from helpers.errors import InputError, require_positive_int
from helpers.precision import CPU_BF16_FLAGS, PRECISION_ENV, cpu_flags, cpu_matmul_speeds, trainable_precisions
from helpers.runtime import free_port, process_rank

PROGRAMS = REPO_ROOT / "helpers" / "programs"
# The notebook's own 1-rank group sets these. Both launchers overwrite them for their ranks today;
# removing them makes sure no rank can ever join the notebook's group or reuse the port it holds.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankFailedError(RuntimeError):
    """A rank crashed, hung past the timeout, or wrote no result. `.log` is the tail of its output."""

    def __init__(self, message: str, rank: int | None, returncode: int | None, log: str):
        super().__init__(message)
        self.rank, self.returncode, self.log = rank, returncode, log


def write_result(out_dir, result: dict) -> Path:
    """Inside a rank: save this rank's json-serialisable result as OUT_DIR/rank{RANK}.json."""
    path = Path(out_dir) / f"rank{process_rank()}.json"
    text = json.dumps(result)   # serialise first: a bad value must not leave half a file behind
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


CONFIGS = "configs"   # OUT_DIR/configs/<n>_<label>.json: each run's DeepSpeed config, numbered in run order


def save_config(out_dir, label: str, config: dict) -> None:
    """Inside a rank, just before deepspeed.initialize: rank 0 saves the run's DeepSpeed config as
    OUT_DIR/configs/<n>_<label>.json (a file a script's `--deepspeed_config` flag takes); run_program prints how they
    differ. The number, not the file's time, keeps the run order: runs can save within one clock tick."""
    if process_rank() == 0:
        folder = Path(out_dir) / CONFIGS
        n = len(list(folder.glob("*.json"))) + 1
        save_json(config, folder / f"{n:02d}_{label}.json")


def show_configs(out_dir) -> None:
    """Print the configs a launch's runs handed DeepSpeed (save_config), in the order they ran: the first one's
    file, then for each later one the settings in which it differs from the first."""
    paths = sorted((Path(out_dir) / CONFIGS).glob("*.json"))   # zero-padded run numbers sort in run order
    if not paths:
        return
    first, *later = paths
    label = {p: p.stem.split("_", 1)[1] for p in paths}
    print(f"  config of {label[first]}: {from_root(first)}")
    base = paths_from_root(json.loads(first.read_text()))
    for path in later:
        changed = differing_lines(base, paths_from_root(json.loads(path.read_text())))
        print(f"  {label[path]}: " + ("; ".join(changed) if changed else f"the same config as {label[first]}"))


def show(program: str, *names: str) -> None:
    """Print helpers/programs/<program>.py, or only its top-level functions/classes `names`, in file order."""
    path = PROGRAMS / f"{program}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no program {program!r}: choose from {sorted(p.stem for p in PROGRAMS.glob('[!_]*.py'))}")
    source = path.read_text()
    if names:
        lines = source.splitlines()
        defs = {n.name: n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        unknown = [n for n in names if n not in defs]
        if unknown:
            raise ValueError(f"{path.name} defines no {unknown}: it has {sorted(defs)}")
        spans = sorted((min([d.lineno for d in defs[n].decorator_list] + [defs[n].lineno]), defs[n].end_lineno)
                       for n in names)
        source = "\n\n\n".join("\n".join(lines[start - 1:stop]) for start, stop in spans)
    print(f"# helpers/programs/{path.name}" + (f": {', '.join(names)}" if names else ""))
    print(source)


def flags(options: dict) -> list[str]:
    """Keyword options -> a program's flags: steps=8 -> --steps=8, micro_batches=(1, 2) -> --micro-batches 1 2,
    offload_optimizer=True -> --offload-optimizer, False or None -> left out (the program's default)."""
    args = []
    for key, value in options.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            args += [flag, *map(str, value)]
        elif value is not False and value is not None:
            args.append(f"{flag}={value}")
    return args


def run_program(program: str, n_ranks: int, *, out_dir: str | Path, timeout: float = 600,
                launcher: str = "torchrun", like_ranks: int | None = None, echo: bool = True, **options) -> list[dict]:
    """Run helpers/programs/<program>.py on n_ranks with `options` as its flags (`checked_flags` first);
    each rank's result, by rank. `like_ranks`: place the ranks (device, threads) as a launch of that many
    would, e.g. a one-rank reference run beside a 2-rank one. `echo`: first print the command line, so that the
    reader can run it from the repository root (see `command_line`), and after the run the DeepSpeed configs
    its runs used (see `show_configs`)."""
    module, args = checked_flags(program, n_ranks, launcher, out_dir, options)
    if echo:
        print("$", command_line(module, n_ranks, out_dir, args, launcher))
    results = launch(module, n_ranks, args, out_dir=out_dir, timeout=timeout, launcher=launcher, like_ranks=like_ranks)
    if echo:
        show_configs(out_dir)
    return results


def run_script(script: str | Path, n_ranks: int, *args: str, launcher: str = "torchrun",
               launcher_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
               timeout: float = 300, like_ranks: int | None = None) -> tuple[int, str]:
    """Run a script as a terminal would: `torchrun --standalone --nproc_per_node N script *args`, or
    `deepspeed *launcher_args script *args` (its ranks chosen by launcher_args, e.g. --include localhost:1).
    Returns (exit code, what the launcher and the ranks printed, stdout and stderr together); a failing run is
    returned, not raised, because notebook 10 reproduces failures and reads their messages. The ranks are placed
    like `launch`'s (`child_env(like_ranks or n_ranks)`: a 1-rank run beside a 2-rank one says like_ranks=2);
    `env` adds variables. A run still going after `timeout` seconds is killed with everything it started, and
    its exit code reads -9."""
    if launcher == "torchrun":
        start = ["torch.distributed.run", "--standalone", "--nproc_per_node", str(n_ranks), *launcher_args]
    elif launcher == "deepspeed":
        start = ["deepspeed.launcher.runner", *launcher_args, "--master_port", str(free_port())]
    else:
        raise ValueError(f"launcher must be 'torchrun' or 'deepspeed', got {launcher!r}")
    proc = subprocess.Popen([sys.executable, "-m", *start, str(script), *args],
                            env=child_env(like_ranks or n_ranks) | (env or {}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        output, _ = proc.communicate()   # what it printed before the timeout, kept by the first communicate()
        return -9, output
    return proc.returncode, output


def run_shown(script: str | Path, n_ranks: int, *args: str, starts: tuple[str, ...] = ("rank ",),
              **options) -> list[str]:
    """`run_script` as a notebook shows it: the command as you would type it, then the lines the ranks printed
    that start with `starts`, rank by rank (`rank_lines`), which it returns. `options` go to `run_script`
    (launcher, launcher_args, env). A run that fails raises, with everything it printed."""
    launcher = options.get("launcher", "torchrun")
    command = (f"torchrun --standalone --nproc_per_node {n_ranks}" if launcher == "torchrun"
               else " ".join([launcher, *options.get("launcher_args", ())]))
    print("$", command, script, *args)
    returncode, output = run_script(script, n_ranks, *args, **{"timeout": 600, **options})
    if returncode:
        raise RuntimeError(f"{command} {script} exited with code {returncode}; it printed:\n{output}")
    lines = rank_lines(output, *starts)
    print("\n".join(lines))
    return lines


def rank_lines(output: str, *starts: str) -> list[str]:
    """The lines a run printed that start with one of `starts` ("rank " by default), rank by rank, each rank's in
    the order it printed them. The ranks share one pipe, and print() writes a line's text and its newline apart:
    one rank's line can follow another's unbroken, so each line is cut before every "rank N" first."""
    pieces = [piece for line in output.splitlines() for piece in re.split(r"(?=rank \d+[ :])", line)]
    chosen = [piece for piece in pieces if piece.startswith(starts or ("rank ",))]
    return sorted(chosen, key=lambda piece: int(m[1]) if (m := re.match(r"rank (\d+)", piece)) else -1)


def command_line(module: str, n_ranks: int, out_dir, args: list[str], launcher: str = "torchrun") -> str:
    """What a launch runs, as you would type it from the repository root (paths inside it, the run directory
    among them, shown relative to it; `launch` adds its own port and log flags)."""
    flags = [f"{flag}={from_root(value)}" if "=" in arg else from_root(arg)
             for arg in args for flag, _, value in [arg.partition("=")]]
    start = {"torchrun": ["torchrun", "--nproc_per_node", str(n_ranks), "-m", module],
             "deepspeed": ["deepspeed", "--num_gpus", str(n_ranks), "--no_local_rank", "--module", module]}[launcher]
    return " ".join([*start, "--out", from_root(out_dir), *flags])


def from_root(text) -> str:
    """An absolute path inside the repository, relative to its root; anything else as it is."""
    path = Path(text)
    if path.is_absolute() and path.resolve().is_relative_to(REPO_ROOT):
        return str(path.resolve().relative_to(REPO_ROOT))
    return str(text)


def paths_from_root(config: dict) -> dict:
    """`config` with its path settings (e.g. an NVMe folder inside the repository) shown relative to the root,
    as the printed command line shows them: the printed diff then reads the same on every machine."""
    return {key: paths_from_root(value) if isinstance(value, dict) else from_root(value) if isinstance(value, str)
            else value for key, value in config.items()}


def checked_flags(program: str, n_ranks: int, launcher: str, out_dir, options: dict) -> tuple[str, list[str]]:
    """(module, flags) of helpers/programs/<program>.py with `options`, checked by the program's own parser and
    its `check_options(args, n_ranks)` (where it has one); a mistake raises here, naming the option."""
    module = f"helpers.programs.{program}"
    _validate(module, n_ranks, launcher)
    code = importlib.import_module(module)
    args = flags(options)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parsed = code.parse(["--out", str(out_dir), *args])
    except SystemExit:   # argparse's last line says what is wrong: "prog: error: argument --lr: ..."
        why = said.getvalue().strip().splitlines()[-1].split("error: ", 1)[-1]
        raise InputError(f"bad options {options} for {program}: {why} (see `python -m {module} --help`)") from None
    if hasattr(code, "check_options"):
        code.check_options(parsed, n_ranks)
    return module, args


def per_run(ranks: list[dict], runs: str, label: str) -> dict:
    """{label of each run: [rank 0's record of it, rank 1's, ...]} from results in which every rank holds
    the list `runs` of its records in the same order (e.g. runs="stages", label="stage")."""
    return {run[label]: [{**r[runs][i], "rank": r["rank"]} for r in ranks] for i, run in enumerate(ranks[0][runs])}


def launch(module: str, n_ranks: int, args: list[str] | None = None, *, out_dir: str | Path,
           timeout: float = 600, launcher: str = "torchrun", like_ranks: int | None = None) -> list[dict]:
    """Run `python -m module --out OUT_DIR *args` on n_ranks local processes under torchrun or DeepSpeed's
    launcher; each rank's result, by rank. Each rank gets its own GPU when there are n_ranks of them, else
    all run on the CPU with gloo. Raises RankFailedError naming the failed rank, with its traceback (on a
    timeout, after killing every process it started)."""
    _validate(module, n_ranks, launcher)
    for _ in range(PORT_ATTEMPTS):
        out = fresh_out_dir(out_dir)
        port = str(free_port())   # never a fixed port: an earlier or parallel run may still hold it
        cmd = LAUNCHERS[launcher](module, n_ranks, port, out / "logs") + ["--out", str(out), *(args or [])]
        returncode = _run(cmd, child_env(like_ranks or n_ranks), out / "logs" / "launcher.log", timeout, module)
        if returncode == 0 or not _port_was_taken(out / "logs"):
            break
    _raise_if_failed(returncode, out, n_ranks, launcher, timeout)
    return read_results(out, n_ranks)


# free_port's port is free when it answers, not when the launcher binds it a second later: a program started
# at the same moment may take it first ("server socket has failed to listen"). Then the launch is repeated.
PORT_ATTEMPTS = 3
PORT_TAKEN = ("EADDRINUSE", "Address already in use", "failed to listen on any local network address")


def _port_was_taken(logs: Path) -> bool:
    return any(any(m in p.read_text(errors="replace") for m in PORT_TAKEN) for p in logs.rglob("*.log"))


def fresh_out_dir(out_dir: str | Path) -> Path:
    """OUT_DIR without an earlier run's results and logs (they must never pass for this run's), with logs/."""
    out = Path(out_dir).resolve()
    shutil.rmtree(out / "logs", ignore_errors=True)
    for stale in [*out.glob("rank*.json"), *(out / CONFIGS).glob("*.json")]:
        stale.unlink()
    (out / "logs").mkdir(parents=True)
    return out


def read_results(out: Path, n_ranks: int) -> list[dict]:
    return [{**json.loads((out / f"rank{r}.json").read_text()), "rank": r} for r in range(n_ranks)]   # by rank


LAUNCHERS = {   # (module, n_ranks, port, log dir) -> the command line, before "--out OUT_DIR ARGS"
    # --redirects 3: each rank's stdout and stderr go to LOGS/<run id>/attempt_0/<rank>/std{out,err}.log
    "torchrun": lambda module, n, port, logs: [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr",
        "127.0.0.1", "--master_port", port, "--log-dir", str(logs), "--redirects", "3", "-m", module],
    # --no_local_rank: the module need not parse --local_rank; each rank logs to LOGS/<time>_rank<N>.log
    "deepspeed": lambda module, n, port, logs: [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(n), "--num_nodes", "1",
        "--master_addr", "127.0.0.1", "--master_port", port, "--no_local_rank",
        "--enable_each_rank_log", str(logs), "--module", module],
}


def _validate(module: str, n_ranks: int, launcher: str) -> None:
    """Fail in the notebook, before any process starts, on the mistakes that are easy to make."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {sorted(LAUNCHERS)}, got {launcher!r}")
    require_positive_int("n_ranks", n_ranks)
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:   # a missing parent package raises instead of returning None
        found = False
    if not found:
        raise ModuleNotFoundError(f"experiment module {module!r} is not importable (check the name and sys.path)")


def _run(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float, module: str) -> int | None:
    """The launcher's exit code, or None when it ran past the timeout (everything is then killed)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)   # its own group, so killpg reaches only it
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        except KeyboardInterrupt:   # the notebook's Stop: the ranks stop as after Ctrl-C (the script saves first)
            interrupt_ranks(proc, module, log_path.parent)
            raise
        finally:   # on a timeout, a second Stop, or a rank that does not stop, none may outlive this call
            if proc.poll() is None:
                kill_tree(proc)


STOP_GRACE_S = 60   # for the ranks to finish their step and save, after the notebook's Stop


def ranks_of(proc: subprocess.Popen, module: str) -> list[psutil.Process]:
    """The rank processes of a job started by `proc`: those running `module`, below the launchers. A rank's
    own short-lived children (a subprocess between fork and exec still shows the rank's command line) are
    left out, and so is any process that ends while being looked at."""
    launchers = {"torch.distributed.run", "deepspeed.launcher.launch", "deepspeed.launcher.runner"}
    found = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            cmdline = p.cmdline()
            if module in cmdline and not launchers & set(cmdline):
                found[p.pid] = (p, p.ppid())
    return [p for p, parent in found.values() if parent not in found]


def interrupt_ranks(proc: subprocess.Popen, module: str, logs: Path) -> None:
    """SIGINT to each rank (neither launcher passes a SIGINT on), then wait for the job to end and print what
    the ranks said on stopping (where helpers.programs.train saved). A second Stop during the wait, or
    STOP_GRACE_S, ends it with kill_tree."""
    ranks = ranks_of(proc, module)
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    said = {line for p in logs.rglob("*.log") for line in p.read_text(errors="replace").splitlines()
            if ": stopped after step" in line}
    print(f"Stop: SIGINT sent to {len(ranks)} rank(s)", *sorted(said), sep="\n", file=sys.stderr)


def _raise_if_failed(returncode: int | None, out: Path, n_ranks: int, launcher: str, timeout: float) -> None:
    logs = out / "logs"
    missing = [r for r in range(n_ranks) if not (out / f"rank{r}.json").exists()]
    if returncode is None:
        log = _all_tails(logs, n_ranks, launcher)
        raise RankFailedError(f"timed out after {timeout:g} s, all ranks killed; ranks without a result: "
                              f"{missing} (logs in {logs})\n{log}", missing[0] if len(missing) == 1 else None, None, log)
    if returncode != 0:
        rank = _first_traceback_rank(logs, n_ranks, launcher)
        log = _all_tails(logs, n_ranks, launcher) if rank is None else tail(_rank_logs(logs, rank, launcher))
        who = "a rank (none printed a traceback)" if rank is None else f"rank {rank}"
        raise RankFailedError(f"{who} failed, launcher exit code {returncode} (logs in {logs})\n{log}",
                              rank, returncode, log)
    if missing:
        log = tail(_rank_logs(logs, missing[0], launcher))
        raise RankFailedError(f"rank {missing[0]} exited 0 but wrote no {out}/rank{missing[0]}.json "
                              f"(did it call write_result?)\n{log}", missing[0], 0, log)


def child_env(n_ranks: int) -> dict[str, str]:
    if set(CPU_BF16_FLAGS) & cpu_flags():
        cpu_matmul_speeds()   # measured here once, inherited: every rank picks the same CPU precision
    env = with_repo_on_path({k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS})
    # N ranks each starting one thread per core would oversubscribe the CPU N times over.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n_ranks)))
    if gpu_count() < n_ranks:
        # One GPU cannot host two NCCL ranks (e.g. Colab's single T4): run every rank on the CPU
        # with gloo instead, where ZeRO, pipeline and MoE partitioning still really happen.
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
        if env.get(PRECISION_ENV, "").strip().lower() not in ("", "auto", *trainable_precisions("cpu")):
            del env[PRECISION_ENV]   # fp16, a GPU's choice: the CPU ranks take their own rule's
    return env


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process below it. torchrun starts each rank in a session of
    its own, so killing the launcher's process group alone would leave the ranks running."""
    children = psutil.Process(proc.pid).children(recursive=True)   # before their parent dies
    os.killpg(proc.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait()
    psutil.wait_procs(children, timeout=5)   # SIGKILL is asynchronous: return once they are gone


def _rank_logs(logs: Path, rank: int, launcher: str) -> list[Path]:
    pattern = f"*/attempt_*/{rank}/std*.log" if launcher == "torchrun" else f"*_rank{rank}.log"
    return sorted(logs.glob(pattern), reverse=True)   # stdout before stderr, where the traceback is


def tail(paths: list[Path], lines: int = 40) -> str:
    """The last `lines` lines of the files' text, read in the order given."""
    text = "".join(p.read_text(errors="replace") for p in paths)
    return "\n".join(text.splitlines()[-lines:])


def _all_tails(logs: Path, n_ranks: int, launcher: str, lines: int = 10) -> str:
    parts = [f"--- rank {r} ---\n{tail(_rank_logs(logs, r, launcher), lines)}" for r in range(n_ranks)]
    return "\n".join(parts + [f"--- launcher ---\n{tail([logs / 'launcher.log'], lines)}"])


def _first_traceback_rank(logs: Path, n_ranks: int, launcher: str) -> int | None:
    """The rank whose traceback was written first. When one rank dies its peers fail too ("Connection
    closed by peer"), but only after it exited, so the earliest traceback is the root cause."""
    written = {}
    for r in range(n_ranks):
        times = [p.stat().st_mtime_ns for p in _rank_logs(logs, r, launcher)
                 if "Traceback (most recent call last)" in p.read_text(errors="replace")]
        if times:
            written[r] = min(times)
    return min(written, key=written.get) if written else None
