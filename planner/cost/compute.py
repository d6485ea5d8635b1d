"""Kernel times on one device. Each formula names its source.

GEMM: the tile/wave-quantization model of NVIDIA's Matrix Multiplication
Background User's Guide (DU-09799): a GEMM's output is cut into tiles; tiles run
in waves of ``sm_count``; the last partial tile and the last partial wave do full
work. The library picks the tile shape (``gemm_tiles``) that wastes least. On top, a roofline (Williams et al. 2009):
time is the larger of math at the achieved GEMM rate and bytes at HBM speed.
"""
from __future__ import annotations

import math

from ..cluster import DTYPE_BYTES, Device
from ..layers import attention_flops


# split-K: when the output has fewer tiles than the device has SMs, the library cuts the inner
# dimension into this many slices run in parallel and reduces their fp32 partial sums (NVIDIA
# CUTLASS docs, 'Parallelized Reductions: split-K'; cuBLAS 'splitKreduce_kernel' in the H100 traces
# of benchmarks/results/gpu_runs.json). A slice keeps at least SPLIT_K_MIN_K of the inner dimension.
SPLIT_K = (1, 2, 3, 4, 6, 8, 12, 16)
SPLIT_K_MIN_K = 256
GEMM_ALIGN_ELEMS = 8          # 16-byte rows in 16-bit types: the alignment tensor-core kernels need


# the kernel-time functions are pure and the search asks for the same shapes in many contexts: results per
# device and function (the device object itself is kept with them, so its id cannot be reused while they live);
# also per layer, for what the cost model reads off a layer's ops in every context (planner/cost/layer.py)
_MEMO: dict[tuple[int, str], tuple[object, dict]] = {}


def device_memo(device: object, name: str) -> dict:
    """The memo of function ``name``'s results on ``device`` (a Device, or another immutable object: a Layer)."""
    held = _MEMO.get((id(device), name))
    if held is None or held[0] is not device:
        if len(_MEMO) > 128:
            _MEMO.clear()
        held = _MEMO[(id(device), name)] = (device, {})
    return held[1]


def gemm_s(m: float, n: float, k: float, device: Device, precision: str, batch: int = 1) -> float:
    """Time of ``batch`` products (m x k) @ (k x n)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    memo, key = device_memo(device, "gemm_s"), (m, n, k, precision, batch)
    out = memo.get(key)
    if out is None:
        out = memo[key] = _gemm_s(m, n, k, device, precision, batch)
    return out


def _gemm_s(m: float, n: float, k: float, device: Device, precision: str, batch: int) -> float:
    """``precision``: the operands' dtype, a compute dtype or an FP8 recipe's "fp8" / "mxfp8" (``operand_bytes``)."""
    sms = device.sm_count
    rate = device.gemm_peak(precision) * device.gemm_efficiency * device.shape_efficiency(m, n, k)
    if device.gemm_unaligned_efficiency < 1.0 and (n % GEMM_ALIGN_ELEMS or k % GEMM_ALIGN_ELEMS):
        rate *= device.gemm_unaligned_efficiency
    # tile and wave quantization: every wave runs sms full tiles, m n batch of them useful;
    # math time = waves x (tile's 2 k tm tn at 1/sms of the rate + the wave's fixed time)
    math_s = math.inf
    for tm, tn in device.gemm_tiles:
        tiles = -(-m // tm) * -(-n // tn) * batch                  # ceilings in integer arithmetic
        for split in SPLIT_K if tiles < sms else (1,):
            if split > 1 and k / split < SPLIT_K_MIN_K:
                break
            waves = -(-(tiles * split) // sms)
            t = waves * (2.0 * (k / split) * tm * tn * sms / rate + device.gemm_wave_latency_s)
            if split > 1:       # fp32 partial sums written and read back by the reduction
                t += 8.0 * m * n * batch * split / (device.hbm_bytes_per_s * device.hbm_efficiency)
            math_s = min(math_s, t)
    a, out = operand_bytes(precision)
    memory_s = (a * (m * k + k * n) + out * m * n) * batch / (device.hbm_bytes_per_s * device.hbm_efficiency)
    return (math_s if math_s > memory_s else memory_s) + device.gemm_latency_s


def operand_bytes(precision: str) -> tuple[float, float]:
    """(bytes per input element, per output element) of a GEMM. FP8 GEMMs read 1-byte operands and write
    bf16; MXFP8 reads an e8m0 scale per 32 operand values besides (torchao/testing/training/roofline_utils.py
    ``get_individual_gemm_time_sympy``)."""
    if precision == "fp8":
        return 1.0, 2.0
    if precision == "mxfp8":
        return 1.0 + 1.0 / 32, 2.0
    return DTYPE_BYTES[precision], DTYPE_BYTES[precision]


def memory_bound_s(nbytes: float, device: Device) -> float:
    """An elementwise or reduction kernel that streams ``nbytes`` through HBM."""
    return nbytes / (device.hbm_bytes_per_s * device.hbm_efficiency) if nbytes > 0 else 0.0


def flash_attention_s(batch: float, heads: float, q_len: float, kv_len: float, head_dim: int, device: Device,
                      precision: str, *, causal: bool = True, window: int = 0, fused: bool = False,
                      dropout: bool = False) -> tuple[float, float]:
    """(forward, backward) of a FlashAttention-style kernel.

    Backward does 2.5x the forward's matmul FLOPs (5 matmuls against 2, the
    scores recomputed): Dao 2023, FlashAttention-2, Sec 3.2. ``fused``: cuDNN's fused
    flash kernel where the profile characterises it (``fused_attention_s``), with
    attention ``dropout`` or without; else one rate, the profile's attention_efficiency
    (dropout not priced).
    """
    flops = attention_flops(batch, heads, q_len, kv_len, head_dim, causal=causal, window=window)
    latency = device.attention_latency_s          # one call, split as the work is (1 : 2.5)
    if fused and device.fused_attention_efficiency:
        fwd, bwd = fused_attention_s(flops, batch * heads * q_len, head_dim, device, precision, dropout=dropout)
    else:
        rate = device.peak(precision) * device.attention_efficiency
        fwd, bwd = flops / rate, 2.5 * flops / rate
    return fwd + latency / 3.5, bwd + 2.5 * latency / 3.5


QUERY_TILE = 128        # query rows a tile of a flash kernel: FlashAttention-2's Br at head dims 64 and 128 (Dao 2023,
                        # Sec 3.3); cuDNN's sm90 flash kernels too (their names: 64x128x..., 4 warps)
HEAD_DIM_TILE = 64      # cuDNN's sm90 flash kernels tile the head dimension by 64 (their names: ...x64 at head dim 64,
                        # ...x128 at 128, and at 96 too: gpt3-760m's runs in benchmarks/results/gpu_holdout_runs.json)


def attention_row_share(keys_per_query: float, row_tiles: float) -> float:
    """t / (t + c): the share of a flash kernel's time on useful tiles, when each row of query tiles walks t =
    ``keys_per_query`` / QUERY_TILE key tiles and pays a fixed cost worth c = ``row_tiles`` of them (its queries loaded,
    its output rescaled and written, in backward its dQ)."""
    t = keys_per_query / QUERY_TILE
    return t / (t + row_tiles) if row_tiles > 0 else 1.0


def fused_attention_element_s(head_dim: float, matmul_rate: float, sfu_rate: float) -> tuple[float, float]:
    """(forward, backward) seconds per score element (one query against one key it meets) of a flash kernel on long
    sequences: its matmuls, 2 d FLOPs each of the forward's two (QK^T, PV) and the backward's five (S and dP
    recomputed, dV, dQ, dK), at ``matmul_rate`` on the head dimension padded to HEAD_DIM_TILE, and one exponential each
    (the forward's softmax, the backward's P recomputed) on the special-function units at ``sfu_rate`` (Shah et al.
    2024, FlashAttention-3, Sec 3: the exponentials run on the SFUs, at a small fraction of the tensor cores' rate)."""
    d = HEAD_DIM_TILE * math.ceil(head_dim / HEAD_DIM_TILE)
    return 4.0 * d / matmul_rate + 1.0 / sfu_rate, 10.0 * d / matmul_rate + 1.0 / sfu_rate


def fused_attention_score_s(head_dim: float, keys_per_query: float, matmul_rate: float, sfu_rate: float,
                            row_tiles: float) -> tuple[float, float]:
    """(forward, backward) seconds per score element of a flash kernel whose queries meet ``keys_per_query`` keys each:
    ``fused_attention_element_s`` stretched by the rows' fixed work (``attention_row_share``)."""
    f, b = fused_attention_element_s(head_dim, matmul_rate, sfu_rate)
    stretch = 1.0 / attention_row_share(keys_per_query, row_tiles)
    return f * stretch, b * stretch


def fused_attention_s(flops: float, queries: float, head_dim: int, device: Device, precision: str, *,
                      dropout: bool) -> tuple[float, float]:
    """(forward, backward) of cuDNN's fused flash kernel over the score elements of ``flops`` forward FLOPs
    (4 d each) of ``queries`` queries: ``fused_attention_score_s`` at the profile's numbers, plus what dropout adds a
    score element (a random number drawn forward and again backward). The profile's numbers are fitted by
    benchmarks/attention_shape.py from the kernels of training steps."""
    elements = flops / (4.0 * head_dim)
    if elements <= 0:
        return 0.0, 0.0
    f, b = fused_attention_score_s(head_dim, elements / queries,
                                   device.peak(precision) * device.fused_attention_efficiency, device.sfu_ops_per_s,
                                   device.fused_attention_row_tiles)
    extra_f, extra_b = device.fused_attention_dropout_s if dropout else (0.0, 0.0)
    return elements * (f + extra_f), elements * (b + extra_b)


def unfused_attention_s(batch: float, heads: float, q_len: float, kv_len: float, head_dim: int, device: Device,
                        precision: str, *, dropout: bool) -> tuple[float, float]:
    """(forward, backward) of attention with materialised scores (Megatron-LM 2021).

    Batched GEMMs QK^T and PV over b x heads, a fused scale-mask-softmax and a
    dropout over the s_q x s_kv scores (Shoeybi et al. 2019; Korthikanti et al.
    2022 Sec 4.1 count the same tensors). Bytes per score element: softmax reads
    and writes 2+2, dropout reads 2 and writes 2 plus a 1-byte mask; backward:
    softmax reads grad and probs, writes grad (6), dropout 5.
    """
    b = int(round(batch * heads)) or 1
    dt = DTYPE_BYTES[precision]
    scores = batch * heads * q_len * kv_len
    fwd = gemm_s(q_len, kv_len, head_dim, device, precision, b) + gemm_s(q_len, head_dim, kv_len, device, precision, b)
    fwd += memory_bound_s(scores * (2 * dt + (2 * dt + 1 if dropout else 0)), device)
    bwd = (gemm_s(q_len, head_dim, kv_len, device, precision, b) + gemm_s(kv_len, head_dim, q_len, device, precision, b)
           + gemm_s(q_len, kv_len, head_dim, device, precision, b) + gemm_s(kv_len, head_dim, q_len, device, precision, b))
    bwd += memory_bound_s(scores * (3 * dt + (2 * dt + 1 if dropout else 0)), device)
    return fwd, bwd
