"""What one device of this machine does: GEMM and attention throughput, memory bandwidth, CPU Adam.

Every number is timed here (best of ``repeat`` after a warm-up: the achieved
rate without interference, as nccl-tests and mamf-finder report it); nothing is
read from a datasheet. Collectives, which take several processes, are measured by
``collectives.py`` beside this module.
"""
from __future__ import annotations

import os

from planner.layers import attention_flops
from planner.cost.step import ADAM_BYTES_PER_PARAM
from planner.trace.measured import PRECISION_DTYPES

GEMM_SHAPES = ((512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 1024, 4096), (2048, 4096, 1024))
GEMM_SHAPES_QUICK = ((512, 512, 512), (1024, 1024, 1024))


def best_of(fn, device: str, repeat: int = 5) -> float:
    """Seconds per call of ``fn`` (``kernels.time_per_call``: back-to-back calls between
    synchronisations, best of ``repeat``)."""
    from .kernels import time_per_call
    return time_per_call(fn, device, repeat)


def gemm(device: str, dtype: str, shapes, repeat: int) -> list[dict]:
    """(m x k) @ (k x n): 2 m n k FLOPs per product."""
    import torch
    dt = getattr(torch, PRECISION_DTYPES[dtype])
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
    dt = getattr(torch, PRECISION_DTYPES[dtype])
    b, h, s, d = (1, 8, 512, 64) if quick else (1, 16, 2048, 64)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
    fwd = best_of(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, repeat)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)

    def both():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(grad)
    total = best_of(both, device, repeat)
    flops = attention_flops(b, h, s, s, d, causal=True)
    return {"batch": b, "heads": h, "seq": s, "head_dim": d, "dtype": dtype, "fwd_s": fwd,
            "bwd_s": max(total - fwd, 1e-12), "flops_fwd": flops,
            "tflops": (flops + 2.5 * flops) / total / 1e12}


def copy_bandwidth(device: str, quick: bool, repeat: int) -> dict:
    """A large tensor copy: read + write bytes over time (STREAM 'copy')."""
    from .kernels import bandwidth_sweep
    nbytes = (64 if quick or not device.startswith("cuda") else 1024) * 2**20
    return bandwidth_sweep(device, [nbytes], repeat)[0]


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
    return {"params": n, "seconds": t, "GBps": ADAM_BYTES_PER_PARAM * n / t / 1e9}


def device_adam(quick: bool, repeat: int) -> dict:
    """One AdamW step as the executor runs it on a CPU device (executor/train.py make_optimizer:
    ``foreach=False``, the per-parameter loop of elementwise ops), over parameters in 8 tensors:
    28 B per parameter over the time, which the cost model charges for the step on this device."""
    import torch
    n, tensors = (4 if quick else 16) * 2**20, 8
    params = [torch.nn.Parameter(torch.randn(n // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    opt.step()                       # the moments are allocated by the first step
    t = best_of(opt.step, "cpu", repeat)
    return {"params": n, "tensors": tensors, "foreach": False, "seconds": t,
            "GBps": ADAM_BYTES_PER_PARAM * n / t / 1e9}


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_info(device: str) -> dict:
    """Name, memory and multiprocessor count as the runtime reports them."""
    import platform

    import torch
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        return {"name": props.name, "memory_bytes": props.total_memory, "sm_count": props.multi_processor_count,
                "compute_capability": [props.major, props.minor], "cpu_vendor": cpu_vendor()}
    return {"name": platform.processor() or platform.machine() or "CPU", "memory_bytes": host_memory_bytes(),
            "sm_count": 1, "cpu_vendor": cpu_vendor()}


def cpu_vendor() -> str:
    """The host CPU's vendor as a profile's [host] cpu_vendor names it: intel, amd or arm ("" where unknown), from
    /proc/cpuinfo's vendor_id (x86) or the machine type (Arm)."""
    import platform
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "arm"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    vendor = line.split(":", 1)[1].strip()
                    return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, "")
    except OSError:
        pass
    return ""


def nccl_arch(compute_capability) -> str:
    """The row of NCCL's tuning tables (src/graph/tuning.cc: compute capability 10 and up Blackwell, 9 Hopper, 8
    Ampere, else Volta) for a CUDA device's (major, minor); "" for none."""
    if not compute_capability:
        return ""
    major = compute_capability[0]
    return "blackwell" if major >= 10 else "hopper" if major == 9 else "ampere" if major == 8 else "volta"


def _cores() -> int:
    """The CPUs this process may run on (its affinity), which its peers on the host share."""
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def measure(device: str, dtypes: list[str], *, threads: int, quick: bool) -> dict:
    """Everything above for one device, threads fixed as a training process would run."""
    import torch
    if not device.startswith("cuda"):
        torch.set_num_threads(threads)
    repeat = 3 if quick else 5
    shapes = GEMM_SHAPES_QUICK if quick else GEMM_SHAPES
    out = {"device": device_info(device), "device_type": device.split(":")[0], "threads": threads, "gemm": [],
           "attention": {}, "cores": _cores()}
    for dtype in dtypes:
        out["gemm"] += gemm(device, dtype, shapes, repeat)
        out["attention"][dtype] = attention(device, dtype, quick, repeat)
    out["copy"] = copy_bandwidth(device, quick, repeat)
    out["host_copy"] = copy_bandwidth("cpu", quick, repeat) if device.startswith("cuda") else out["copy"]
    out["h2d"] = host_to_device(device, repeat)
    out["adam"] = cpu_adam(quick, repeat)
    if not device.startswith("cuda"):
        out["device_adam"] = device_adam(quick, repeat)
    out["host_memory_bytes"] = host_memory_bytes()
    out["kernels"] = kernel_detail(device, dtypes, quick=quick)
    return out


# The shapes of kernel_detail on a GPU: token counts and linear widths (in, out) of transformers
# from 0.1B to 8B parameters (GPT-2, GPT-3 XL, Llama 3.x: hidden 768-4096, 4x or SwiGLU MLPs,
# 50257- and 128256-entry vocabularies), attention as those models run it.
GPU_TOKENS = (2048, 8192, 32768)
GPU_WIDTHS = tuple((k, n) for k in (768, 1024, 2048, 3072, 4096, 8192) for n in (768, 1024, 2048, 3072, 4096, 8192))
GPU_HEAD_WIDTHS = tuple((h, v) for h in (768, 2048, 3072) for v in (50257, 128256))
GPU_ATTENTION = ((8, 12, 12, 2048, 64), (2, 16, 16, 4096, 64), (1, 16, 16, 8192, 128), (4, 32, 8, 2048, 64),
                 (2, 32, 8, 8192, 64), (1, 24, 8, 4096, 128), (2, 24, 8, 2048, 128))
GPU_COPY_BYTES = tuple(2**e for e in range(16, 31, 2))
# routed experts: tokens per expert from fine-grained routing of a short micro-batch to a long one,
# expert widths (in, out) of Mixtral-style (hidden x 2.75) and fine-grained (hidden x 0.7) experts
GPU_EXPERT_TOKENS = (128, 512, 2048, 8192)
GPU_EXPERT_WIDTHS = ((1024, 2816), (2816, 1024), (2048, 1408), (1408, 2048))


def kernel_detail(device: str, dtypes: list[str], *, quick: bool) -> dict:
    """The kernel-level measurements of kernels.py: a shape sweep on a GPU, a token one on the
    CPU or with --quick (enough to exercise every path)."""
    from . import kernels as pk
    from .host import executor_host
    gpu = device.startswith("cuda") and not quick
    tokens = GPU_TOKENS if gpu else (64,)
    widths = GPU_WIDTHS if gpu else ((32, 64),)
    heads = GPU_HEAD_WIDTHS if gpu else ()
    attn = GPU_ATTENTION if gpu else ((1, 4, 2, 64, 16),)
    dtype = "bf16" if "bf16" in dtypes else dtypes[0]
    return {"gemm": pk.gemm_sweep(device, dtype, list(tokens), list(widths), graph=gpu)
            + pk.gemm_sweep(device, dtype, list(tokens[:2]), list(heads), graph=gpu),
            # on a CPU at a size past its caches (8 MiB fp32 activations), as a training step streams them;
            # the logits too (1000 x 8192 fp32: 31 MiB, their log-softmax as much again, past a 32 MiB L3
            # and below glibc's 32 MiB mmap threshold, so no page faults: executor/launch.py HUGE_PAGES)
            "eager": pk.eager_kernels(device, tokens=8192 if gpu else 2048, hidden=2048 if gpu else 1024,
                                      vocab=50257 if gpu else 8192, logit_rows=None if gpu else 1000),
            "gap": pk.kernel_gap(device, kernels=200 if gpu else 20),
            "attention": pk.attention_backends(device, dtype, list(attn)),
            "dispatch": pk.dispatch_overhead(device, ops=200 if gpu else 20),
            "copy": pk.bandwidth_sweep(device, list(GPU_COPY_BYTES if gpu else (2**16, 2**20))),
            "adam": pk.adam_variants(device, tensors=150 if gpu else 4, params_per_tensor=2**20 if gpu else 2**10),
            # FP8 (torch._scaled_mm) over the bf16 sweep's shapes, the casts around it, grouped expert
            # GEMMs, host copies beside compute, host time per operator
            "fp8_gemm": pk.fp8_gemm_sweep(device, list(tokens), list(widths), graph=gpu),
            "fp8_cast": pk.fp8_casts(device, tokens=8192 if gpu else 256, hidden=4096 if gpu else 64, compiled=gpu),
            "grouped_gemm": pk.grouped_gemm_sweep(device, [8, 32] if gpu else [4], list(GPU_EXPERT_TOKENS if gpu else (16,)),
                                                  list(GPU_EXPERT_WIDTHS if gpu else ((32, 64),))),
            "host_copy_overlap": pk.host_copy_overlap(device),
            "host_per_op": pk.host_per_op(device, ops=100 if gpu else 10, compiled=gpu),
            # the executor's own host time per block by regime; on a CPU the step is the cores' compute
            **({"executor_host": executor_host(device)} if gpu else {})}
