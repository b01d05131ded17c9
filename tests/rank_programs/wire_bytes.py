"""What each collective makes this rank write to its sockets under gloo, by the kernel's count, per byte of the
tensor DeepSpeed's comms logger would record (the whole tensor, or this rank's shard for an all-gather)."""
import argparse

import torch
import torch.distributed as dist

from helpers.comms import written_bytes
from helpers.launch import write_result

ELEMENTS = 1_000_000   # 4 MB: gloo's per-message headers are a rounding error


def per_logged_byte(run, logged_elements: int) -> float:
    run()                      # the first call sets up gloo's buffers; count the second
    dist.barrier()
    before = written_bytes()
    run()
    dist.barrier()             # the barrier's own few bytes are inside the count: negligible against 4 MB
    return (written_bytes() - before) / (4 * logged_elements)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    n, whole = dist.get_world_size(), torch.ones(ELEMENTS)

    def reduce_to_each_rank():   # as ZeRO 1-2 configured the paper's way do: one reduce per owner
        for root in range(n):
            dist.reduce(whole, dst=root)

    measured = {
        "all_reduce": per_logged_byte(lambda: dist.all_reduce(whole), ELEMENTS),
        "reduce_scatter_tensor": per_logged_byte(
            lambda: dist.reduce_scatter_tensor(torch.empty(ELEMENTS // n), whole), ELEMENTS),
        "all_gather_into_tensor": per_logged_byte(
            lambda: dist.all_gather_into_tensor(torch.empty(n * ELEMENTS), whole), ELEMENTS),
        "reduce": per_logged_byte(reduce_to_each_rank, n * ELEMENTS),
    }
    write_result(args.out, {"world_size": n, "per_logged_byte": measured})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
