"""Kernel-model parameters fitted to a GPU's measured kernel sweeps (``meshplan profile --device cuda``).

The cost model prices a GEMM with tile and wave quantisation, split-K and two fixed times
(planner.cost.compute.gemm_s), and a fused attention call as its FLOPs at one rate plus a fixed
time (flash_attention_s). These functions choose those parameters to fit the GEMMs and SDPA calls
the profile timed on this device (least mean absolute log error over a grid): device
constants measured on the device, never fitted to training runs. Pure Python, no torch.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import replace

from planner.cluster import Device
from planner.cost.compute import GEMM_ALIGN_ELEMS, gemm_s
from planner.layers import attention_flops

# Output tiles cuBLAS chooses among on Hopper and Ampere (NVIDIA DU-09799, 'Tile quantization';
# the nvjet/cutlass kernel names of benchmarks/results/gpu_runs.json carry 256x128, 128x256, 128x128,
# 128x64 and 64x128 tiles)
GPU_TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128))
RATES_TFLOPS = tuple(range(300, 1201, 25))
GEMM_LATENCIES_US = (0.0, 2.0, 4.0, 6.0, 8.0, 10.0)
WAVE_LATENCIES_US = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0)


def fit_device(sm_count: int, hbm_bytes_per_s: float, **fields) -> Device:
    """The device the fits price kernels on: this GPU's multiprocessors and HBM bandwidth, every
    efficiency 1, tiles ``GPU_TILES``, and ``fields`` (the parameters under trial) over that."""
    base = Device(name="fit", memory_bytes=1.0, hbm_bytes_per_s=hbm_bytes_per_s, peak_flops=(("bf16", 1e15),),
                  sm_count=sm_count, gemm_tiles=GPU_TILES, gemm_efficiency=1.0, hbm_efficiency=1.0,
                  attention_efficiency=1.0, reserved_bytes=0.0)
    return replace(base, **fields)


def gemm_dims(row: dict) -> tuple[int, int, int]:
    """(m, n, k) of the product a sweep row timed: forward x W^T (m x k)(k x n), input gradient
    (m x n)(n x k), weight gradient (n x m)(m x k)."""
    m, n, k = row["m"], row["n"], row["k"]
    return {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}[row["kind"]]


def aligned(row: dict) -> bool:
    return all(d % GEMM_ALIGN_ELEMS == 0 for d in gemm_dims(row)[1:])


def fit_gemm(rows: list[dict], *, sm_count: int, hbm_bytes_per_s: float) -> dict:
    """{rate_flops, latency_s, wave_latency_s, unaligned_efficiency, error} over the sweep's rows."""
    ok = [r for r in rows if aligned(r)]
    best = None
    for rate in RATES_TFLOPS:
        for lat in GEMM_LATENCIES_US:
            for wave in WAVE_LATENCIES_US:
                dev = fit_device(sm_count, hbm_bytes_per_s, peak_flops=(("bf16", rate * 1e12),),
                              gemm_latency_s=lat * 1e-6, gemm_wave_latency_s=wave * 1e-6)
                err = statistics.mean(abs(math.log(gemm_s(*gemm_dims(r), dev, "bf16") / r["seconds"])) for r in ok)
                if best is None or err < best[0]:
                    best = (err, rate, lat, wave, dev)
    err, rate, lat, wave, dev = best
    # the efficiency at which the model reproduces each misaligned GEMM's time
    slow = [_unaligned_efficiency(r, dev) for r in rows if not aligned(r)]
    return {"rate_flops": rate * 1e12, "latency_s": lat * 1e-6, "wave_latency_s": wave * 1e-6,
            "unaligned_efficiency": min(1.0, statistics.median(slow)) if slow else 1.0, "error": err,
            "rows": len(ok), "unaligned_rows": len(slow)}


def _unaligned_efficiency(row: dict, dev: Device) -> float:
    """Bisection on ``gemm_unaligned_efficiency`` so that gemm_s matches the measured time."""
    lo, hi = 1e-3, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        t = gemm_s(*gemm_dims(row), replace(dev, gemm_unaligned_efficiency=mid), "bf16")
        lo, hi = (lo, mid) if t < row["seconds"] else (mid, hi)
    return (lo + hi) / 2


def fit_attention(rows: list[dict], *, peak_flops: float) -> dict | None:
    """{efficiency, rate_flops, shape}: causal SDPA forward + backward (the backend torch picks) at
    the rate of the largest measured call (3.5 x forward FLOPs over its time). Smaller calls are
    slower per FLOP, but timed one by one they also carry the host's per-call cost (cuDNN plan
    lookup), which a training step hides behind the GPU's queue; the largest call carries least."""
    ok = [r for r in rows if r.get("backend") == "default" and "fwd_bwd_s" in r]
    if not ok:
        return None
    big = max(ok, key=_flops)
    rate = 3.5 * _flops(big) / big["fwd_bwd_s"]
    return {"efficiency": min(1.0, rate / peak_flops), "rate_flops": rate,
            "shape": f"b{big['batch']} h{big['heads']}/{big['kv_heads']} s{big['seq']} d{big['head_dim']}"}


def _flops(row: dict) -> float:
    return attention_flops(row["batch"], row["heads"], row["seq"], row["seq"], row["head_dim"], causal=True)


# which measured kernels stand for each bandwidth class (planner.cost.eager.CLASSES)
EAGER_CLASS_KERNELS = {
    "stream": ("add_fp32", "add_fp32_bf16", "mul_bf16", "gelu_bf16", "silu_bf16"),
    "cast_up": ("cast_up",), "cast_down": ("cast_down",), "strided": ("strided_mul", "stack"),
    "reduce": ("sum_rows_bf16",), "softmax": ("log_softmax_fp32", "log_softmax_fp32_bwd"),
    "norm": ("layer_norm_fp32", "rms_norm_fp32", "layer_norm_fp32_bwd", "rms_norm_fp32_bwd"),
}


def eager_bandwidths(rows: list[dict]) -> dict[str, float]:
    """{class: bytes per second}: the median of the measured kernels that stand for each class."""
    rate = {r["kernel"]: r["GBps"] * 1e9 for r in rows if "GBps" in r}
    out = {}
    for cls, names in EAGER_CLASS_KERNELS.items():
        got = [rate[n] for n in names if n in rate]
        if got:
            out[cls] = statistics.median(got)
    return out
