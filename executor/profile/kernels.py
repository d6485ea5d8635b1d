"""Kernel-level measurements behind the cost model's mechanisms, for ``meshplan profile``.

Each function times one mechanism the cost model prices, on shapes a training
step really runs, and returns plain rows (written under ``[measured]`` of the
profile TOML and in ``--json``):

- ``gemm_sweep``: the three GEMMs of a linear layer (forward ``x W^T``, input
  gradient ``dy W``, weight gradient ``dy^T x``) over token counts and widths,
  the data for GEMM efficiency by shape (tile and wave quantisation, small-GEMM
  latency: NVIDIA DU-09799, 'Matrix Multiplication Background');
- ``attention_backends``: causal SDPA forward and forward + backward under each
  backend torch has (flash, memory-efficient, math), with grouped key/value heads
  where the shape has them; a backend that refuses a shape is recorded with its
  error, not skipped;
- ``dispatch_overhead``: what one eager operator costs the host (launch and
  dispatcher), alone and with autograd recording it and running its backward:
  the floor under a step made of many small kernels;
- ``bandwidth_sweep``: device-to-device copies by size (bandwidth against
  message size: small copies do not reach the streaming rate);
- ``adam_variants``: one AdamW step over the same parameters as one tensor per
  parameter (for-loop) and as torch's multi-tensor (foreach) kernels, with the
  peak memory the step adds.

Timings are ``time_per_call``: the best of ``repeat`` runs of back-to-back calls, synchronised
on CUDA. Imports torch lazily, like the rest of ``meshplan profile``.
"""
from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

from planner.trace.measured import PRECISION_DTYPES

# passes over the eager kernels on a CPU, each timing every kernel (eager_kernels)
CPU_EAGER_PASSES = 5


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def time_per_call(fn, device: str, repeat: int, min_s: float = 2e-3, graph: bool = False) -> float:
    """Seconds per call of ``fn``: the best of ``repeat`` timings, each of enough back-to-back calls
    to last ``min_s`` between two synchronisations, so that a short kernel is timed as it runs in a
    training step (queued behind the previous one) and not as one launch plus one synchronisation.
    ``graph`` (CUDA): the calls are captured in a CUDA graph and replayed, so that what is timed is
    the GPU's own time per call (kernel and issue gap), not the host's time to launch it."""
    if graph and device.startswith("cuda"):
        return _graph_time_per_call(fn, repeat, min_s)
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    calls = max(1, min(1000, int(min_s / max(time.perf_counter() - t0, 1e-9))))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _dtype(name: str):
    import torch
    return getattr(torch, PRECISION_DTYPES[name])


def _graph_time_per_call(fn, repeat: int, min_s: float) -> float:
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):             # warm-up outside the graph (cuBLAS workspaces, plans)
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    calls = max(1, min(200, int(min_s / max(time.perf_counter() - t0, 1e-9))))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls)
    del g
    return best


def gemm_sweep(device: str, dtype: str, tokens: list[int], widths: list[tuple[int, int]], repeat: int = 5,
               graph: bool = False) -> list[dict]:
    """For each token count m and (in, out) width of a linear: the forward (m x k)(k x n), the input
    gradient (m x n)(n x k) and the weight gradient (n x m)(m x k), with the memory layouts
    ``F.linear`` and its backward use. 2 m n k FLOPs each."""
    import torch
    import torch.nn.functional as F
    dt = _dtype(dtype)
    rows = []
    for m in tokens:
        for k, n in widths:
            x = torch.randn(m, k, device=device, dtype=dt)
            w = torch.randn(n, k, device=device, dtype=dt)
            dy = torch.randn(m, n, device=device, dtype=dt)
            cases = {"fwd": lambda: F.linear(x, w), "dgrad": lambda: dy @ w, "wgrad": lambda: dy.t() @ x}
            for kind, fn in cases.items():
                t = time_per_call(fn, device, repeat, graph=graph)
                rows.append({"kind": kind, "m": m, "n": n, "k": k, "dtype": dtype, "seconds": t,
                             "tflops": 2.0 * m * n * k / t / 1e12})
    return rows


def attention_backends(device: str, dtype: str, shapes: list[tuple[int, int, int, int, int]], repeat: int = 3
                       ) -> list[dict]:
    """Causal SDPA over (batch, heads, kv_heads, seq, head_dim) shapes under each backend ("default":
    the one torch picks, as a training step runs it).
    ``flops_fwd`` counts as planner.cost.compute.attention_flops does (causal: half of 4 b h s^2 d)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from planner.layers import attention_flops
    dt = _dtype(dtype)
    backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    rows = []
    for b, h, kvh, s, d in shapes:
        flops = attention_flops(b, h, s, s, d, causal=True)
        for name, backend in backends.items():
            row = {"backend": name, "batch": b, "heads": h, "kv_heads": kvh, "seq": s, "head_dim": d,
                   "dtype": dtype, "flops_fwd": flops}
            try:
                q = torch.randn(b, h, s, d, device=device, dtype=dt, requires_grad=True)
                k = torch.randn(b, kvh, s, d, device=device, dtype=dt, requires_grad=True)
                v = torch.randn(b, kvh, s, d, device=device, dtype=dt, requires_grad=True)
                gqa = kvh != h

                def fwd():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

                with sdpa_kernel([backend]) if backend is not None else nullcontext():
                    grad = torch.randn_like(fwd())
                    row["fwd_s"] = time_per_call(fwd, device, repeat)
                    row["fwd_bwd_s"] = time_per_call(lambda: fwd().backward(grad), device, repeat)
                row["tflops"] = 3.5 * flops / row["fwd_bwd_s"] / 1e12
            except (RuntimeError, torch.OutOfMemoryError) as e:
                row["error"] = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            finally:
                q = k = v = None
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            rows.append(row)
    return rows


def dispatch_overhead(device: str, ops: int = 200, repeat: int = 5) -> dict:
    """Host seconds per eager operator: ``ops`` tiny in-place adds (no grad), and a chain of ``ops``
    tiny multiplies recorded by autograd then run backward (forward + backward per operator). On a
    GPU both are bound by the host, not by the kernels (a 256-element tensor)."""
    import torch
    x = torch.zeros(256, device=device)

    def plain():
        for _ in range(ops):
            x.add_(1.0)
    leaf = torch.ones(256, device=device, requires_grad=True)

    def autograd():
        y = leaf
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()
    return {"ops": ops, "op_s": time_per_call(plain, device, repeat) / ops,
            "autograd_op_s": time_per_call(autograd, device, repeat) / ops}


def bandwidth_sweep(device: str, sizes_bytes: list[int], repeat: int = 5) -> list[dict]:
    """Device copy ``y.copy_(x)`` by size: read + write bytes over time."""
    import torch
    rows = []
    for nbytes in sizes_bytes:
        x = torch.empty(nbytes // 4, device=device)
        y = torch.empty_like(x)
        t = time_per_call(lambda: y.copy_(x), device, repeat)
        rows.append({"bytes": nbytes, "seconds": t, "GBps": 2 * nbytes / t / 1e9})
    return rows


def adam_variants(device: str, tensors: int, params_per_tensor: int, repeat: int = 3) -> list[dict]:
    """One AdamW step over ``tensors`` fp32 parameters of ``params_per_tensor`` each, for-loop and
    foreach; ``extra_peak_bytes``: what the step allocates beyond the parameters, gradients and
    states it updates (CUDA only: torch.cuda.max_memory_allocated)."""
    import torch
    rows = []
    for foreach in (False, True):
        params = [torch.nn.Parameter(torch.randn(params_per_tensor, device=device)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
        opt.step()                                       # states allocated
        extra = None
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before
        t = time_per_call(opt.step, device, repeat)
        n = tensors * params_per_tensor
        rows.append({"foreach": foreach, "tensors": tensors, "params": n, "seconds": t,
                     "s_per_tensor": t / tensors, "GBps_at_28B": 28.0 * n / t / 1e9, "extra_peak_bytes": extra})
        del params, opt
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def eager_kernels(device: str, tokens: int, hidden: int, vocab: int, repeat: int = 3,
                  logit_rows: int | None = None) -> list[dict]:
    """The elementwise kernels torch eager runs in a transformer step, at one training size, each
    with the bytes it reads and writes (as planner.trace counts them) and the bandwidth it reached:
    dtype casts both ways, fp32 and mixed adds, a bf16 product, RoPE's strided products and stack,
    a bias-gradient sum, LayerNorm and RMSNorm forward and backward, GELU, SiLU, and the fp32
    log-softmax of the loss over the vocabulary, forward and backward, on ``logit_rows`` rows
    (default tokens / 8)."""
    import torch
    import torch.nn.functional as F
    t, h = tokens, hidden
    bf, f32 = torch.bfloat16, torch.float32
    x32 = torch.randn(t, h, device=device, dtype=f32)
    y32 = torch.randn(t, h, device=device, dtype=f32)
    x16 = torch.randn(t, h, device=device, dtype=bf)
    y16 = torch.randn(t, h, device=device, dtype=bf)
    rope = torch.randn(t // 64, 64, h // 64, 64, device=device, dtype=f32)      # (S, nh, hd) style
    cos = torch.randn(t // 64, 1, 1, 32, device=device, dtype=f32)
    w = torch.ones(h, device=device, dtype=f32)
    logits = torch.randn(logit_rows or t // 8, vocab, device=device, dtype=f32)
    log_probs = torch.log_softmax(logits, -1)
    grad_log_probs = torch.randn_like(log_probs)
    e = {f32: 4, bf: 2}
    n = t * h
    cases = {
        "cast_up": (lambda: x16.float(), n * (2 + 4)),
        "cast_down": (lambda: x32.to(bf), n * (4 + 2)),
        "add_fp32": (lambda: x32 + y32, n * 12),
        "add_fp32_bf16": (lambda: x32 + y16, n * 10),
        "mul_bf16": (lambda: x16 * y16, n * 6),
        "strided_mul": (lambda: rope[..., 0::2] * cos, n // 2 * 8),
        "stack": (lambda: torch.stack((rope[..., 0::2], rope[..., 1::2]), dim=-1), n * 8),
        "sum_rows_bf16": (lambda: x16.sum(0), n * 2),
        "gelu_bf16": (lambda: F.gelu(x16, approximate="tanh"), n * 4),
        "silu_bf16": (lambda: F.silu(x16), n * 4),
        "layer_norm_fp32": (lambda: F.layer_norm(x32, (h,), w, w), n * 8),
        "rms_norm_fp32": (lambda: F.rms_norm(x32, (h,), w), n * 8),
        "log_softmax_fp32": (lambda: torch.log_softmax(logits, -1), logits.numel() * 8),
        # backward: read the output gradient and the output, write the input gradient
        "log_softmax_fp32_bwd": (lambda: torch._log_softmax_backward_data(grad_log_probs, log_probs, -1, f32),
                                 logits.numel() * 12),
    }
    rows = []
    # a GPU repeats a kernel to within a percent: the best of ``repeat``. A CPU shared with other
    # processes swings by tens of percent within seconds (executor/profile/collectives.py
    # _concurrent_gemm), which the best of three 2 ms timings in a row sampled at one moment (one
    # class's rate ranged 4.5-23 GB/s over four quick profiles in a row): there every
    # kernel's best of ``repeat`` is taken once per pass over all of them, and its figure is the
    # median over the passes, spread across the whole measurement.
    passes = 1 if device.startswith("cuda") else CPU_EAGER_PASSES
    times: dict[str, list[float]] = {name: [] for name in cases}
    errors: dict[str, str] = {}
    for _ in range(passes):
        for name, (fn, _nbytes) in cases.items():
            if name in errors:
                continue
            try:
                times[name].append(time_per_call(fn, device, repeat, graph=True))
            except RuntimeError as err:
                errors[name] = str(err).strip().splitlines()[0][:200]
    for name, (fn, nbytes) in cases.items():
        if name in errors:
            rows.append({"kernel": name, "error": errors[name]})
            continue
        s_ = statistics.median(times[name])
        rows.append({"kernel": name, "bytes": int(nbytes), "seconds": s_, "GBps": nbytes / s_ / 1e9})
    for name, norm in (("layer_norm_fp32_bwd", lambda a: F.layer_norm(a, (h,), wg, wg)),
                       ("rms_norm_fp32_bwd", lambda a: F.rms_norm(a, (h,), wg))):
        wg = torch.ones(h, device=device, dtype=f32, requires_grad=True)
        a = x32.clone().requires_grad_()
        out = norm(a)
        g = torch.randn_like(out)
        fwd_s = time_per_call(lambda: norm(a), device, repeat)
        both = time_per_call(lambda: torch.autograd.grad(norm(a), (a, wg), g), device, repeat)
        # backward: read dy, x (and statistics), write dx; the weight gradient reads dy and x again
        nbytes = n * e[f32] * 5
        rows.append({"kernel": name, "bytes": int(nbytes), "seconds": max(both - fwd_s, 1e-9),
                     "GBps": nbytes / max(both - fwd_s, 1e-9) / 1e9})
    return rows


def kernel_gap(device: str, kernels: int = 200, repeat: int = 5) -> dict:
    """GPU seconds per tiny kernel when kernels are queued back to back (a CUDA graph of ``kernels``
    adds on 256 elements): the issue gap plus the shortest kernel, what every kernel of a step costs
    at least. On the CPU: the host time per tiny operator."""
    import torch
    x = torch.zeros(256, device=device)

    def chain():
        for _ in range(kernels):
            x.add_(1.0)
    return {"kernels": kernels, "s_per_kernel": time_per_call(chain, device, repeat, graph=True) / kernels}
