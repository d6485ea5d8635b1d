"""Host time per rank of DeepSpeed v0.3.13-v0.5.4's per-tensor ZeRO-3 loops (runtime ``deepspeed-2021``).

    python benchmarks/deepspeed_host_loop.py [--ranks 1536] [--repeats 7]

Before each tensor's all-gather, DeepSpeed's ``_allgather_param`` walks every rank of the group in Python:
a ``narrow`` view of the flat output for that rank, an append, and a ``get_rank(group)`` call to find its
own slot (deepspeed/runtime/zero/partition_parameters.py at v0.3.16). Before each gradient's reduce-scatter,
``_reduce_scatter_gradient`` walks them again: bounds checks, ``view(-1).narrow`` and an append. This script
runs the same steps on CPU tensors, in a gloo group of one process, and prints the median host time per
rank of each loop (the runtime table's ``PerTensorFetch``). The collectives themselves and the copy launches
that follow are not part of it: those are NCCL's (planner/nccl.py) and the cluster profile's
``copy_launch_us``.
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


def reduce_loop(grad: torch.Tensor, ranks: int, part: int, numel: int) -> list:
    views = []
    for i in range(ranks):
        start, end = i * part, (i + 1) * part
        if start < numel and end <= numel:
            views.append(grad.view(-1).narrow(0, start, part))
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
    ap.add_argument("--repeats", type=int, default=7, help="timed runs of each loop (default 7)")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = dist.new_group([0])
    part = 1024
    flat = torch.zeros(part * args.ranks, dtype=torch.float16)
    gather = per_rank_us(lambda: gather_loop(flat, args.ranks, part, group), args.ranks, args.repeats)
    reduce = per_rank_us(lambda: reduce_loop(flat, args.ranks, part, flat.numel()), args.ranks, args.repeats)
    print(f"{'loop':<32} {'median us/rank':>15} {'min':>7} {'max':>7}")
    for name, xs in (("_allgather_param (gather)", gather), ("_reduce_scatter_gradient (reduce)", reduce)):
        print(f"{name:<32} {statistics.median(xs):>15.2f} {min(xs):>7.2f} {max(xs):>7.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
