"""Host time per rank of DeepSpeed v0.3.13-v0.4.2's per-tensor ZeRO-3 gather loop (runtime ``deepspeed-2021``).

    python benchmarks/deepspeed_host_loop.py [--ranks 1536] [--repeats 7]

Before each tensor's all-gather, DeepSpeed's ``_allgather_param`` walks every rank of the group in Python:
a ``narrow`` view of the flat output for that rank, an append, and a ``get_rank(group)`` call to find its
own slot (deepspeed/runtime/zero/partition_parameters.py at v0.3.16). This script runs the same steps on CPU
tensors, in a gloo group of one process, and prints the median host time per rank of the loop (the runtime
table's ``PerTensorFetch.gather_loop_s``). The collective itself and the copy launches that follow are not part
of it: those are NCCL's (planner/nccl.py) and the cluster profile's ``copy_launch_us``. (The gradients of
those versions' defaults go through no such loop: they are all-reduced in buckets, planner/cost/fetch.py.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def gather_loop(flat: torch.Tensor, ranks: int, part: int, group) -> list:
    views = []
    for i in range(ranks):
        views.append(flat.narrow(0, part * i, part))
        if i == dist.get_rank(group=group):
            pass                                    # DeepSpeed copies its own shard in here (once)
    return views


def per_rank_us(fn, ranks: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) / ranks * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1536, help="ranks of the data-parallel group (default 1536)")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs of the loop (default 7)")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.new_group([0])
    part = 1024
    flat = torch.zeros(part * args.ranks, dtype=torch.float16)
    gather = per_rank_us(lambda: gather_loop(flat, args.ranks, part, group), args.ranks, args.repeats)
    print(f"{'loop':<32} {'median us/rank':>15} {'min':>7} {'max':>7}")
    print(f"{'_allgather_param (gather)':<32} {statistics.median(gather):>15.2f} {min(gather):>7.2f} {max(gather):>7.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
