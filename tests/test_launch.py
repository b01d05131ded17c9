"""helpers.launch: N real ranks on this machine, their results back as data, failures named."""
import json
import re
import socket
import time

import psutil
import pytest

from helpers.errors import InputError
from helpers.launch import RankFailedError, launch, run_program

ECHO = "tests.rank_programs.echo"


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """One 2-rank echo run, launched from a process that looks like a 1-rank job on a busy port
    (as a notebook kernel does), with stale results from an 'earlier run' in the folder."""
    out = tmp_path_factory.mktemp("echo")
    (out / "rank0.json").write_text(json.dumps({"stale": True}))
    (out / "rank5.json").write_text(json.dumps({"stale": True}))
    with socket.socket() as busy, pytest.MonkeyPatch.context() as mp:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
            mp.setenv(key, value)
        results = launch(ECHO, 2, out_dir=out, timeout=120)
    return out, port, results


def test_results_come_back_ordered_by_rank(hostile_run):
    _, _, results = hostile_run
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["sum"] == 3 for r in results)   # all_reduce of 1 + 2
    assert results[0]["pid"] != results[1]["pid"]


def test_parent_distributed_env_is_not_inherited(hostile_run):
    _, busy_port, results = hostile_run
    assert results[0]["master_port"] == results[1]["master_port"] != busy_port


def test_stale_results_are_removed(hostile_run):
    out, _, results = hostile_run
    assert not (out / "rank5.json").exists()
    assert not any("stale" in r for r in results)


def test_failing_rank_is_named_with_its_traceback(tmp_path):
    with pytest.raises(RankFailedError) as info:
        launch(ECHO, 2, ["--fail-rank", "1"], out_dir=tmp_path, timeout=120)
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)
    assert "deliberate failure on rank 1" in info.value.log


def test_timeout_kills_every_rank(tmp_path):
    start = time.perf_counter()
    with pytest.raises(RankFailedError, match="timed out after 10 s"):
        launch(ECHO, 2, ["--sleep", "60"], out_dir=tmp_path, timeout=10)
    assert time.perf_counter() - start < 40
    survivors = [p for p in psutil.process_iter(["cmdline", "status"])
                 if str(tmp_path) in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert survivors == []


def test_rank_that_writes_no_result_is_named(tmp_path):
    with pytest.raises(RankFailedError, match=r"rank 0 exited 0 but wrote no") as info:
        launch("tests.rank_programs.silent", 1, out_dir=tmp_path, timeout=120)
    assert "finished without writing a result" in info.value.log


@pytest.mark.parametrize("kwargs, problem", [
    ({"module": ECHO, "n_ranks": 0}, "n_ranks=0"),
    ({"module": "helpers.programs.no_such_program", "n_ranks": 2}, "no_such_program"),
    ({"module": "no_such_package.experiment", "n_ranks": 2}, "no_such_package"),
    ({"module": ECHO, "n_ranks": 2, "launcher": "mpirun"}, "mpirun"),
])
def test_bad_inputs_fail_before_anything_starts(tmp_path, kwargs, problem):
    out = tmp_path / "never_created"
    with pytest.raises((ValueError, ModuleNotFoundError), match=problem):
        launch(**kwargs, out_dir=out)
    assert not out.exists()


# A number a rank would only trip over later (a NaN learning rate trains NaN losses; a 0 sequence length fails
# deep in the model) is refused by the program's parser before any rank starts, naming the flag.
@pytest.mark.parametrize("program, options, message", [
    ("zero_stages", {"stages": [1], "lr": float("nan")}, "argument --lr: nan must be a finite number > 0"),
    ("comm_dtype", {"lr": float("inf")}, "argument --lr: inf must be a finite number > 0"),
    ("moe", {"aux_loss_coef": float("nan")}, "argument --aux-loss-coef: nan must be a finite number >= 0"),
    ("moe", {"capacity_factor": -1.0}, "argument --capacity-factor: -1.0 must be a finite number > 0"),
    ("pipeline", {"grad_clip": float("-inf")}, "argument --grad-clip: -inf must be a finite number >= 0"),
    ("pipeline", {"steps": 1}, "argument --steps: 1 must be at least 2 (the first is warm-up)"),
    ("zero_stages", {"stages": [4]}, "argument --stages: invalid choice: 4"),
    ("comm_dtype", {"model_size": "smal"}, "argument --model-size: invalid choice: 'smal'"),
    ("train", {"config": "configs/zero0.json", "seq_len": 0}, "argument --seq-len: 0 must be at least 2"),
    ("train", {"config": "configs/zero0.json", "n_samples": 0}, "argument --n-samples: 0 must be at least 1"),
])
def test_a_bad_number_is_named_before_any_rank_starts(tmp_path, program, options, message):
    out = tmp_path / "never_created"
    with pytest.raises(InputError, match=re.escape(f"for {program}: {message}")):
        run_program(program, 2, out_dir=out, **options)
    assert not out.exists()


def test_an_output_folder_that_is_a_file_is_named_before_any_rank_starts(tmp_path):
    (tmp_path / "taken").write_text("")
    with pytest.raises(InputError, match=f"--output-dir {tmp_path}/taken/run: {tmp_path}/taken is a file; name a folder"):
        run_program("train", 2, out_dir=tmp_path / "never", config="configs/zero0.json",
                    output_dir=tmp_path / "taken" / "run")


def test_deepspeed_launcher_works_on_cpu(tmp_path):
    results = launch(ECHO, 2, out_dir=tmp_path, timeout=120, launcher="deepspeed")
    assert [(r["rank"], r["sum"]) for r in results] == [(0, 3), (1, 3)]


def test_the_printed_command_runs_as_printed_from_the_repository_root(tmp_path):
    """What run_program prints is a command a reader can paste: run it (torchrun from this venv) and the ranks
    answer as they do under launch()."""
    import os
    import shlex
    import subprocess
    import sys
    from helpers import REPO_ROOT
    from helpers.launch import command_line
    from helpers.runtime import free_port
    printed = command_line(ECHO, 2, tmp_path, [])
    assert printed.startswith(f"torchrun --nproc_per_node 2 -m {ECHO} --out "), printed
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               PET_MASTER_PORT=str(free_port()))   # torchrun reads its flags' defaults from PET_* variables
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    subprocess.run(shlex.split(printed), cwd=REPO_ROOT, env=env, check=True, timeout=120, capture_output=True)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["sum"] for r in (0, 1)] == [3, 3]
    assert command_line(ECHO, 2, tmp_path, [], "deepspeed").startswith(
        f"deepspeed --num_gpus 2 --no_local_rank --module {ECHO} --out ")


# ---- the programs' side: options -> flags, and showing a program ----

def test_options_become_the_programs_flags():
    from helpers.launch import flags
    assert flags({"steps": 8, "micro_batches": (1, 2), "offload_optimizer": True, "paper_comm": False, "seed": None,
                  "config": "configs/zero2.json"}) == ["--steps=8", "--micro-batches", "1", "2", "--offload-optimizer",
                                                       "--config=configs/zero2.json"]


def test_show_prints_the_named_functions_of_a_program(capsys):
    from helpers.launch import show
    show("zero_stages", "zero_block")
    printed = capsys.readouterr().out
    assert printed.startswith("# helpers/programs/zero_stages.py: zero_block\ndef zero_block(")
    assert "def run_stage(" not in printed


@pytest.mark.parametrize("args, message", [(("no_such_program",), "no program 'no_such_program'"),
                                           (("zero_stages", "no_such_function"), "defines no \\['no_such_function'\\]")])
def test_show_names_what_does_not_exist(args, message):
    from helpers.launch import show
    with pytest.raises((FileNotFoundError, ValueError), match=message):
        show(*args)


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_port_taken_between_pick_and_bind_is_picked_again(launcher, tmp_path, monkeypatch):
    """Another program starting at the same moment can take the port free_port found before the launcher binds
    it: the first launch fails to listen, the second, on a new port, runs."""
    import helpers.launch
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        real = helpers.launch.free_port
        monkeypatch.setattr(helpers.launch, "free_port", lambda: next(ports, None) or real())
        results = launch(ECHO, 2, out_dir=tmp_path, timeout=120, launcher=launcher)
    assert [r["rank"] for r in results] == [0, 1] and next(ports, None) is None


# ---- the configs a launch's runs used ----

def test_differing_lines_name_each_changed_added_and_removed_setting():
    from helpers.config import differing_lines
    base = {"train_batch_size": 8, "zero_optimization": {"stage": 0, "overlap_comm": True}, "fp16": {"enabled": True}}
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
              "bf16": {"enabled": True}}
    assert differing_lines(base, config) == [
        "zero_optimization.stage: 0 -> 2", "zero_optimization.reduce_bucket_size: 1000", "bf16.enabled: true",
        "zero_optimization.overlap_comm: true -> (absent)", "fp16.enabled: true -> (absent)"]
    assert differing_lines(config, config) == []


def test_a_launch_prints_where_its_configs_are_and_how_they_differ(tmp_path, capsys, monkeypatch):
    """Rank 0 saves each run's config (another rank saves none); show_configs names the first file and each
    later run's settings that differ from it, in the order the runs saved them."""
    from helpers.config import build_config
    from helpers.launch import save_config, show_configs
    monkeypatch.setattr("helpers.launch.process_rank", lambda: 1)   # an earlier test may have left a process group
    save_config(tmp_path, "ignored", {"train_batch_size": 1})
    assert not (tmp_path / "configs").exists()
    monkeypatch.setattr("helpers.launch.process_rank", lambda: 0)
    for stage in (3, 0, 2):   # not in name order
        save_config(tmp_path, f"stage{stage}", build_config(device="cpu", zero_stage=stage, world_size=2))
    show_configs(tmp_path)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"  config of stage3: {tmp_path / 'configs' / '01_stage3.json'}"
    assert printed[1:] == ["  stage0: zero_optimization.stage: 3 -> 0", "  stage2: zero_optimization.stage: 3 -> 2"]
    assert json.loads((tmp_path / "configs" / "03_stage2.json").read_text()) == build_config(
        device="cpu", zero_stage=2, world_size=2)


def test_a_path_setting_inside_the_repository_is_shown_from_its_root(tmp_path, capsys, monkeypatch):
    """An NVMe folder under runs/ prints as runs/..., not as this machine's absolute path."""
    from helpers import REPO_ROOT
    from helpers.launch import save_config, show_configs
    monkeypatch.setattr("helpers.launch.process_rank", lambda: 0)
    inside, outside = REPO_ROOT / "runs" / "x" / "nvme", tmp_path / "nvme"
    for label, folder in (("cpu", None), ("inside", inside), ("outside", outside)):
        save_config(tmp_path, label, {"zero_optimization": {"offload_param": {"nvme_path": folder and str(folder)}}})
    show_configs(tmp_path)
    printed = capsys.readouterr().out.splitlines()
    assert printed[1] == '  inside: zero_optimization.offload_param.nvme_path: null -> "runs/x/nvme"'
    assert printed[2] == f'  outside: zero_optimization.offload_param.nvme_path: null -> "{outside}"'


# Every way a notebook or helper starts ranks, and the position of its rank count. Each places its ranks with
# child_env(like_ranks or n_ranks); child_env itself is left out: its argument is the placement.
LAUNCH_DOORS = {"run_program": 1, "run_script": 1, "run_shown": 1, "launch": 1}


def launch_sources() -> list[tuple[str, str]]:
    """(where, source) of every notebook code cell (an IPython magic line read as a statement) and helpers module."""
    import nbformat
    from helpers import REPO_ROOT
    sources = [(p.name, "\n".join(l[:len(l) - len(l.lstrip())] + "pass" if l.lstrip().startswith(("%", "!")) else l
                                  for l in c.source.splitlines()))
               for p in sorted((REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))
               for c in nbformat.read(p, as_version=4).cells if c.cell_type == "code"]
    return sources + [(str(p.relative_to(REPO_ROOT)), p.read_text()) for p in sorted((REPO_ROOT / "helpers").rglob("*.py"))]


def reference_launches() -> list[tuple[str, int, str]]:
    """(where, line, source) of every 1-rank launch, through any door, that has no `like_ranks`: on a one-GPU
    machine it runs on the GPU, in the GPU's precision, while its multi-rank peers run as CPU processes."""
    import ast
    found = []
    for where, source in launch_sources():
        for node in ast.walk(ast.parse(source)):
            door = isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
            at = LAUNCH_DOORS.get(door)
            if (at is not None and len(node.args) > at and isinstance(node.args[at], ast.Constant)
                    and node.args[at].value == 1 and "like_ranks" not in {k.arg for k in node.keywords}):
                found.append((where, node.lineno, ast.get_source_segment(source, node)[:120]))
    return found


def test_every_one_rank_reference_is_placed_like_its_multi_rank_peers():
    """On a one-GPU machine (Colab's T4) a 1-rank launch gets the GPU and its precision (fp16 on a T4) while
    2 or more ranks run as CPU processes in the CPU's: a 1-rank reference for them must say `like_ranks`, whichever
    door it goes through (notebook 10's universal-checkpoint resume went through run_script and compared losses
    with == across the two devices)."""
    assert reference_launches() == []


def test_no_notebook_starts_ranks_from_a_shell_line():
    """A `!torchrun ...` or `!deepspeed ...` line bypasses child_env: on one GPU its 2 ranks would both take the GPU."""
    import re
    shell = re.compile(r"^\s*(!|%%bash|%%sh).*\b(torchrun|deepspeed|torch\.distributed\.run)\b", re.M)
    import nbformat
    from helpers import REPO_ROOT
    found = [(p.name, c.source[:80]) for p in sorted((REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))
             for c in nbformat.read(p, as_version=4).cells if c.cell_type == "code" and shell.search(c.source)]
    assert found == []


@pytest.mark.parametrize("n_ranks, like_ranks, on_gpu", [(1, None, True), (2, None, False), (1, 2, False)])
def test_a_one_gpu_machine_places_ranks_by_the_launch_they_stand_beside(n_ranks, like_ranks, on_gpu, monkeypatch):
    from helpers import launch as launching
    from helpers.precision import PRECISION_ENV
    monkeypatch.setattr(launching, "gpu_count", lambda: 1)   # a T4 on Colab, as torch would count it
    monkeypatch.setenv(PRECISION_ENV, "fp16")                  # what the kernel's rule picks on a T4
    env = launching.child_env(like_ranks or n_ranks)
    assert (env.get("CUDA_VISIBLE_DEVICES") != "") == on_gpu
    assert (env.get(PRECISION_ENV) == "fp16") == on_gpu      # CPU ranks take the CPU rule's precision


def test_run_script_returns_a_failing_run_with_every_ranks_lines(tmp_path):
    """Notebook 10 reproduces failures: run_script hands back the exit code and what the ranks printed, both
    ranks' lines, where launch() would raise."""
    script = tmp_path / "two_ranks.py"
    script.write_text("import os, sys\nrank = os.environ['RANK']\nprint(f'rank {rank}: here', flush=True)\n"
                      "sys.exit(3 if rank == '1' else 0)\n")
    from helpers.launch import run_script
    code, output = run_script(script, 2)
    assert code != 0 and "rank 0: here" in output and "rank 1: here" in output, output


def test_run_script_kills_a_run_past_its_timeout(tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import os, time\nprint(f'pid {os.getpid()}', flush=True)\ntime.sleep(600)\n")
    from helpers.launch import run_script
    code, output = run_script(script, 1, timeout=15)
    pids = [int(line.split()[1]) for line in output.splitlines() if line.startswith("pid ")]
    assert code == -9 and pids and not any(psutil.pid_exists(pid) for pid in pids), output


def test_rank_lines_cuts_lines_run_together_and_orders_them_by_rank():
    """Ranks share one pipe: a line's text and its newline arrive apart, so one rank's line can follow another's
    unbroken. rank_lines cuts them apart, keeps each rank's lines in the order it printed them, rank 10 after 9."""
    from helpers.launch import rank_lines
    output = ("rank 1 step 1: loss 4.9\n[W] a warning\nrank 0 step 1: loss 4.8rank 1 step 2: loss 4.7\n"
              "config: {}\nrank 10: last\nrank 9: ninth\nrank 0 step 2: loss 4.6\n")
    assert rank_lines(output) == ["rank 0 step 1: loss 4.8", "rank 0 step 2: loss 4.6", "rank 1 step 1: loss 4.9",
                                  "rank 1 step 2: loss 4.7", "rank 9: ninth", "rank 10: last"]
    assert rank_lines(output, "config: ", "rank 9") == ["config: {}", "rank 9: ninth"]


def test_run_shown_prints_the_command_and_the_ranks_lines_and_raises_on_a_failure(tmp_path, capsys):
    from helpers.launch import run_shown
    script = tmp_path / "two_ranks.py"
    script.write_text("import os, sys\nrank = os.environ['RANK']\nprint(f'rank {rank}: here', flush=True)\n"
                      "sys.exit(int(sys.argv[1]) if rank == '1' else 0)\n")
    assert run_shown(script, 2, "0") == ["rank 0: here", "rank 1: here"]
    assert capsys.readouterr().out == f"$ torchrun --standalone --nproc_per_node 2 {script} 0\nrank 0: here\nrank 1: here\n"
    with pytest.raises(RuntimeError, match=r"exited with code 1; it printed:\n(.|\n)*rank 1: here"):
        run_shown(script, 2, "3")
