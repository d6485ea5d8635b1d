"""What one device of this machine does: GEMM and attention throughput, memory bandwidth, CPU Adam.

Every number is timed here (best of ``repeat`` after a warm-up: the achieved
rate without interference, as nccl-tests and mamf-finder report it); nothing is
read from a datasheet. Collectives live in ``executor/profile_comm.py`` (the
planner never imports torch.distributed).
"""
from __future__ import annotations

import os
import time

GEMM_SHAPES = ((512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 1024, 4096), (2048, 4096, 1024))
GEMM_SHAPES_QUICK = ((512, 512, 512), (1024, 1024, 1024))
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_of(fn, device: str, repeat: int = 5) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def gemm(device: str, dtype: str, shapes, repeat: int) -> list[dict]:
    """(m x k) @ (k x n): 2 m n k FLOPs per product."""
    import torch
    dt = getattr(torch, TORCH_DTYPES[dtype])
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device).to(dt)
        b = torch.randn(k, n, device=device).to(dt)
        t = best_of(lambda: a @ b, device, repeat)
        rows.append({"m": m, "n": n, "k": k, "dtype": dtype, "seconds": t, "tflops": 2.0 * m * n * k / t / 1e12})
    return rows


def attention(device: str, dtype: str, quick: bool, repeat: int) -> dict:
    """Causal SDPA forward and backward at one training shape; FLOPs as the cost model counts them
    (planner.cost.compute.attention_flops: 4 b h s^2 d, halved for causal; backward 2.5x)."""
    import torch
    import torch.nn.functional as F
    dt = getattr(torch, TORCH_DTYPES[dtype])
    b, h, s, d = (1, 8, 512, 64) if quick else (1, 16, 2048, 64)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
    fwd = best_of(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, repeat)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)

    def both():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(grad)
    total = best_of(both, device, repeat)
    flops = 4.0 * b * h * s * s * d * 0.5
    return {"batch": b, "heads": h, "seq": s, "head_dim": d, "dtype": dtype, "fwd_s": fwd,
            "bwd_s": max(total - fwd, 1e-12), "flops_fwd": flops,
            "tflops": (flops + 2.5 * flops) / total / 1e12}


def copy_bandwidth(device: str, quick: bool, repeat: int) -> dict:
    """A large tensor copy: read + write bytes over time (STREAM 'copy')."""
    import torch
    nbytes = (64 if quick or not device.startswith("cuda") else 1024) * 2**20
    x = torch.empty(nbytes // 4, device=device)
    y = torch.empty_like(x)
    t = best_of(lambda: y.copy_(x), device, repeat)
    return {"bytes": nbytes, "seconds": t, "GBps": 2 * nbytes / t / 1e9}


def host_to_device(device: str, repeat: int) -> dict | None:
    """Pinned host to device copy (the offload path); None on a CPU-only run."""
    import torch
    if not device.startswith("cuda"):
        return None
    nbytes = 256 * 2**20
    host = torch.empty(nbytes // 4).pin_memory()
    dev = torch.empty(nbytes // 4, device=device)
    t = best_of(lambda: dev.copy_(host, non_blocking=True), device, repeat)
    return {"bytes": nbytes, "seconds": t, "GBps": nbytes / t / 1e9}


def cpu_adam(quick: bool, repeat: int) -> dict:
    """One AdamW step (foreach) on the CPU: the bytes the cost model charges per parameter
    (planner.cost.step.ADAM_BYTES_PER_PARAM = 28 for mixed precision) over the time."""
    import torch
    n = (4 if quick else 16) * 2**20
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    t = best_of(opt.step, "cpu", repeat)
    return {"params": n, "seconds": t, "GBps": 28.0 * n / t / 1e9}


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_info(device: str) -> dict:
    """Name, memory and multiprocessor count as the runtime reports them."""
    import platform

    import torch
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        return {"name": props.name, "memory_bytes": props.total_memory, "sm_count": props.multi_processor_count}
    return {"name": platform.processor() or platform.machine() or "CPU", "memory_bytes": host_memory_bytes(),
            "sm_count": 1}


def measure(device: str, dtypes: list[str], *, threads: int, quick: bool) -> dict:
    """Everything above for one device, threads fixed as a training process would run."""
    import torch
    if not device.startswith("cuda"):
        torch.set_num_threads(threads)
    repeat = 3 if quick else 5
    shapes = GEMM_SHAPES_QUICK if quick else GEMM_SHAPES
    out = {"device": device_info(device), "device_type": device.split(":")[0], "threads": threads, "gemm": [],
           "attention": {}}
    for dtype in dtypes:
        out["gemm"] += gemm(device, dtype, shapes, repeat)
        out["attention"][dtype] = attention(device, dtype, quick, repeat)
    out["copy"] = copy_bandwidth(device, quick, repeat)
    out["host_copy"] = copy_bandwidth("cpu", quick, repeat) if device.startswith("cuda") else out["copy"]
    out["h2d"] = host_to_device(device, repeat)
    out["adam"] = cpu_adam(quick, repeat)
    out["host_memory_bytes"] = host_memory_bytes()
    return out
