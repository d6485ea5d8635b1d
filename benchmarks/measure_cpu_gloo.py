"""Measure the numbers behind profiles/cpu-gloo.toml on this machine.

    python benchmarks/measure_cpu_gloo.py

Prints single-thread fp32 GEMM throughput, streaming memory bandwidth and gloo
all-reduce time vs message size between 2 local processes (TCP loopback).
`meshplan profile` (profiler issue) will write such numbers as a profile itself.
"""
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def best_of(fn, repeat=5):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gemm_and_stream():
    torch.set_num_threads(1)
    for n in (256, 512, 1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        t = best_of(lambda: a @ b)
        print(f"gemm fp32 {n}^3: {2 * n ** 3 / t / 1e9:.1f} GFLOP/s")
    x = torch.empty(64 * 2**20 // 4)
    y = torch.empty_like(x)
    t = best_of(lambda: y.copy_(x))
    print(f"stream copy: {2 * x.numel() * 4 / t / 1e9:.2f} GB/s (read + write)")


def worker(rank, world):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    for size in (4, 2**10, 2**16, 2**20, 2**22, 2**24):
        x = torch.ones(size // 4)
        t = best_of(lambda: dist.all_reduce(x), repeat=5)
        if rank == 0:
            busbw = 2 * (world - 1) / world * size / t
            print(f"gloo all_reduce {size:>9} B x{world}: {t * 1e6:9.1f} us  busbw {busbw / 1e9:.3f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    gemm_and_stream()
    mp.spawn(worker, args=(2,), nprocs=2)
