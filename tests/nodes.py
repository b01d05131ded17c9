"""Several "nodes" on one machine: one launcher invocation per node, started side by side, as on a cluster.

On a cluster every node runs the same launcher command with its own node rank, and all of them meet
at the first node's address. Here every node is this machine, so the commands differ from a
cluster's in two places only: --master_addr is 127.0.0.1, and DeepSpeed's launcher is started once
per node with --no_ssh and --node_rank (on a cluster it can instead ssh into every host of the hostfile
from the first node; one machine has no second host to ssh to). What is simulated: the network
(loopback, not between machines) and the file system (shared, so every rank writes its checkpoint
partition into one folder, as on a cluster with a shared disk). What is real: N launchers, each
starting its own ranks, a rendezvous across them, and the global ranks DeepSpeed and torch compute from
the node rank.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from helpers import REPO_ROOT
from helpers.launch import RankFailedError, checked_flags, child_env, fresh_out_dir, kill_tree, read_results, tail
from helpers.runtime import free_port


def node_commands(module: str, args: list[str], *, nodes: int, ranks_per_node: int, port: int,
                  launcher: str = "torchrun", hostfile: Path | None = None) -> list[list[str]]:
    """The launcher command line of each node, node 0 first (the one --master_addr points at)."""
    if launcher == "torchrun":
        return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(node),
                 "--nproc_per_node", str(ranks_per_node), "--master_addr", "127.0.0.1", "--master_port", str(port),
                 "-m", module, *args] for node in range(nodes)]
    if launcher == "deepspeed":
        return [[sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
                 "--node_rank", str(node), "--num_nodes", str(nodes), "--num_gpus", str(ranks_per_node),
                 "--master_addr", "127.0.0.1", "--master_port", str(port), "--no_local_rank",
                 "--module", module, *args] for node in range(nodes)]
    raise ValueError(f"launcher must be 'torchrun' or 'deepspeed', got {launcher!r}")


def hostfile_text(nodes: int, ranks_per_node: int) -> str:
    """DeepSpeed's hostfile: one line per node, "<hostname> slots=<ranks on it>"."""
    return "".join(f"node{node} slots={ranks_per_node}\n" for node in range(nodes))


def run_on_nodes(program: str, nodes: int, ranks_per_node: int, *, out_dir: str | Path, launcher: str = "torchrun",
                 timeout: float = 600, **options) -> list[dict]:
    """Run helpers/programs/<program>.py on `nodes` simulated nodes x `ranks_per_node` ranks; each global
    rank's result, by rank. The options are checked first, as helpers.launch.run_program does."""
    world = nodes * ranks_per_node
    module, args = checked_flags(program, world, launcher, out_dir, options)
    out = fresh_out_dir(out_dir)
    hostfile = out / "hostfile"
    hostfile.write_text(hostfile_text(nodes, ranks_per_node))
    commands = node_commands(module, ["--out", str(out), *args], nodes=nodes, ranks_per_node=ranks_per_node,
                             port=free_port(), launcher=launcher, hostfile=hostfile)
    returncodes = _run_side_by_side(commands, child_env(world), out / "logs", timeout)
    missing = [r for r in range(world) if not (out / f"rank{r}.json").exists()]
    if any(code != 0 for code in returncodes) or missing:   # None (timed out) counts as failed
        logs = "\n".join(f"--- node {n} ---\n{tail([out / 'logs' / f'node{n}.log'], 15)}" for n in range(nodes))
        what = "timed out" if None in returncodes else f"exit codes by node {returncodes}"
        raise RankFailedError(f"{what}; ranks without a result: {missing} (logs in {out / 'logs'})\n{logs}",
                              missing[0] if len(missing) == 1 else None, None, logs)
    return read_results(out, world)


def _run_side_by_side(commands: list[list[str]], env: dict, logs: Path, timeout: float) -> list[int | None]:
    """Start every node's launcher at once (they wait for each other at the rendezvous); their exit codes,
    None for one still running at the timeout (every launcher is then killed with all its ranks)."""
    procs = []
    for node, command in enumerate(commands):
        with open(logs / f"node{node}.log", "w") as log:
            procs.append(subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        # Poll rather than wait on one node: when a node fails, the others would wait for it until the timeout.
        while time.monotonic() < deadline and any(p.poll() is None for p in procs) \
                and not any(p.poll() not in (None, 0) for p in procs):
            time.sleep(0.2)
        return [proc.poll() for proc in procs]
    finally:   # on a timeout, a failed node (its peers would wait for it), or an interrupt: no rank outlives this
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)
