"""The smallest rank program: join the group, all-reduce (rank + 1), write a result.

It is the template for every experiment run through `helpers.launch.launch`: the launcher sets
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, the program reads `--out`, does its work, and each rank
writes one JSON result with `write_result`. Tests use `--fail-rank` and `--sleep` to check that
failures and hangs are reported instead of swallowed.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

from helpers.launch import write_result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="directory for rank{N}.json results")
    parser.add_argument("--fail-rank", type=int, default=None, help="this rank raises after init")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep (timeout tests)")
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")   # rank, world size and rendezvous come from the launcher's env
    rank = dist.get_rank()
    if rank == args.fail_rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    time.sleep(args.sleep)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)            # every rank ends with 1 + 2 + ... + world_size
    write_result(args.out, {"world_size": dist.get_world_size(), "sum": total.item(), "pid": os.getpid(),
                            "master_port": int(os.environ["MASTER_PORT"])})   # the launcher's choice
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
