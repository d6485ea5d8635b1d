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


# -- FP8, grouped expert GEMMs, host copies under load, host time per operator ---------------------

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_MAX = 448.0             # largest finite float8_e4m3fn (OCP 8-bit floating point spec, E4M3)


def _fp8_operands(m: int, n: int, k: int, recipe: str, device: str):
    """``torch._scaled_mm``'s operands of an (m x k)(k x n) product as torchao's float8 linears pass
    them: ``a`` row-major, ``b`` column-major, both e4m3, with one fp32 scale per tensor
    ("tensorwise") or per row of ``a`` and column of ``b`` ("rowwise")."""
    import torch
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    if recipe == "tensorwise":
        return a, b, torch.tensor(1.0, device=device), torch.tensor(1.0, device=device)
    return a, b, torch.ones(m, 1, device=device), torch.ones(1, n, device=device)


def fp8_gemm_sweep(device: str, tokens: list[int], widths: list[tuple[int, int]], recipes=FP8_RECIPES,
                   repeat: int = 5, graph: bool = False) -> list[dict]:
    """The three GEMMs of a linear (as ``gemm_sweep``: forward (m, n, k), input gradient (m, k, n),
    weight gradient (n, k, m)) as ``torch._scaled_mm`` runs them in FP8 (e4m3 operands, bf16 output)
    under each scaling recipe. The casts that make the operands are timed by ``fp8_casts``. A shape
    or recipe the device refuses is a row with its error."""
    import torch
    rows = []
    for m in tokens:
        for k, n in widths:
            for kind, (mm, nn, kk) in {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}.items():
                for recipe in recipes:
                    row = {"kind": kind, "recipe": recipe, "m": mm, "n": nn, "k": kk, "dtype": "fp8_e4m3"}
                    try:
                        a, b, sa, sb = _fp8_operands(mm, nn, kk, recipe, device)
                        t = time_per_call(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb,
                                                                   out_dtype=torch.bfloat16),
                                          device, repeat, graph=graph)
                        row.update(seconds=t, tflops=2.0 * mm * nn * kk / t / 1e12)
                    except RuntimeError as err:
                        row["error"] = str(err).strip().splitlines()[0][:200]
                    rows.append(row)
    return rows


def _to_fp8_tensorwise(x):
    import torch
    scale = FP8_MAX / x.abs().amax().float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _to_fp8_rowwise(x, dim: int = -1):
    import torch
    scale = FP8_MAX / x.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _to_fp8_colwise(x):
    """Row-wise scaling of ``x``'s transpose, as a backward GEMM takes a (tokens, features) operand: one scale per
    column (the amax over the tokens, a reduction along the strided dimension), written feature-major."""
    q, scale = _to_fp8_rowwise(x, dim=0)
    return q.t().contiguous(), scale


def fp8_casts(device: str, tokens: int, hidden: int, repeat: int = 3, compiled: bool = False) -> list[dict]:
    """What FP8 training adds around each GEMM: the amax of a bf16 tensor (per tensor, per row, and per
    column: row-wise scaling of the transposed operands of the backward GEMMs) and its scaled cast to e4m3,
    as eager torch runs them (several kernels each: abs, amax, the fp32 scale, multiply, clamp, cast) and,
    with ``compiled``, as one ``torch.compile``d function (what torchao's float8 linears run under
    torchtitan's compiled blocks; on one H100 a compiled backward kernel fusing a column-wise amax and cast
    took 640 us where the row-wise ones took tens: docs/validation.md, FP8 with torchao). ``bytes``: the
    least traffic of the operation (read bf16, write e4m3; amax reads only), so ``GBps`` is the fraction of
    the copy rate it reaches."""
    import torch
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    n = tokens * hidden
    cases = {"amax_tensorwise": (lambda: x.abs().amax(), n * 2),
             "amax_rowwise": (lambda: x.abs().amax(dim=-1, keepdim=True), n * 2),
             "amax_colwise": (lambda: x.abs().amax(dim=0, keepdim=True), n * 2),
             "cast_tensorwise": (lambda: _to_fp8_tensorwise(x), n * 3),
             "cast_rowwise": (lambda: _to_fp8_rowwise(x), n * 3),
             "cast_colwise": (lambda: _to_fp8_colwise(x), n * 3),
             "cast_transpose_tensorwise": (lambda: _to_fp8_tensorwise(x)[0].t().contiguous(), n * 3)}
    if compiled:
        for name, fn in (("cast_tensorwise_compiled", _to_fp8_tensorwise), ("cast_rowwise_compiled", _to_fp8_rowwise),
                         ("cast_colwise_compiled", _to_fp8_colwise)):
            try:
                cfn = torch.compile(fn)
                cases[name] = ((lambda f=cfn: f(x)), n * 3)
            except Exception as err:               # compile is optional: a failure is a row, not a crash
                cases[name] = (None, str(err).strip().splitlines()[0][:200])
    rows = []
    for name, (fn, nbytes) in cases.items():
        if fn is None:
            rows.append({"kernel": name, "error": nbytes})
            continue
        try:
            t = time_per_call(fn, device, repeat)
            rows.append({"kernel": name, "tokens": tokens, "hidden": hidden, "bytes": int(nbytes), "seconds": t,
                         "GBps": nbytes / t / 1e9})
        except Exception as err:
            rows.append({"kernel": name, "error": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"})
    return rows


def grouped_gemm_sweep(device: str, experts: list[int], tokens_per_expert: list[int],
                       widths: list[tuple[int, int]], repeat: int = 3) -> list[dict]:
    """Routed experts as the executor runs them (executor/moe.py): ``torch._grouped_mm`` of the
    tokens sorted by expert, (E * t, k), against the experts' (E, n, k) weights, t tokens per expert
    (balanced), forward and forward + backward, beside one dense GEMM of the same FLOPs (all E * t
    tokens through one (k, n) weight): the grouped kernel's loss by tokens per expert."""
    import torch
    bf = torch.bfloat16
    rows = []
    for e in experts:
        for t in tokens_per_expert:
            for k, n in widths:
                row = {"experts": e, "tokens_per_expert": t, "k": k, "n": n, "dtype": "bf16",
                       "flops_fwd": 2.0 * e * t * k * n}
                try:
                    x = torch.randn(e * t, k, device=device, dtype=bf, requires_grad=True)
                    w = torch.randn(e, n, k, device=device, dtype=bf, requires_grad=True)
                    offs = torch.arange(1, e + 1, device=device, dtype=torch.int32) * t
                    dense = w[0].detach()

                    def grouped():
                        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
                    out = grouped()
                    grad = torch.randn_like(out)

                    def both():
                        torch.autograd.grad(grouped(), (x, w), grad)
                    row["fwd_s"] = time_per_call(lambda: torch._grouped_mm(x.detach(), w.detach().transpose(-2, -1),
                                                                           offs=offs), device, repeat)
                    row["fwd_bwd_s"] = time_per_call(both, device, repeat)
                    row["dense_fwd_s"] = time_per_call(lambda: x.detach() @ dense.t(), device, repeat)
                    row["tflops_fwd"] = row["flops_fwd"] / row["fwd_s"] / 1e12
                    row["tflops_fwd_bwd"] = 3 * row["flops_fwd"] / row["fwd_bwd_s"] / 1e12
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
                rows.append(row)
                x = w = None
    return rows


def host_copy_overlap(device: str, nbytes: int = 256 * 2**20, gemm: int = 8192, repeat: int = 5) -> dict | None:
    """Pinned host-device copies (activation and optimizer offload) alone and while the compute
    stream runs bf16 GEMMs: each direction's rate (CUDA events on the copy stream), and the GEMMs'
    time alone and beside the copy (what a copy steals from compute: memory traffic, copy
    engines). The median of ``repeat``. None on a CPU-only run."""
    import torch
    if not device.startswith("cuda"):
        return None
    host_in = torch.empty(nbytes // 4, pin_memory=True)
    host_out = torch.empty(nbytes // 4, pin_memory=True)
    dev = torch.empty(nbytes // 4, device=device)
    a = torch.randn(gemm, gemm, device=device, dtype=torch.bfloat16)
    b = torch.randn(gemm, gemm, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    out: dict = {"bytes": nbytes, "gemm": [gemm, gemm, gemm]}

    def timed(copy: str | None, gemms: int) -> tuple[float, float]:
        """(copy seconds, seconds per GEMM) of one copy on ``side`` and ``gemms`` GEMMs on the
        current stream, started together."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            ev[0].record(side)
            if copy == "h2d":
                dev.copy_(host_in, non_blocking=True)
            elif copy == "d2h":
                host_out.copy_(dev, non_blocking=True)
            ev[1].record(side)
        ev[2].record()
        for _ in range(gemms):
            a @ b
        ev[3].record()
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]) * 1e-3, ev[2].elapsed_time(ev[3]) * 1e-3 / max(gemms, 1)

    timed(None, 3)
    gemm_alone = statistics.median(timed(None, 10)[1] for _ in range(repeat))
    out["gemm_alone_s"] = gemm_alone
    for direction in ("h2d", "d2h"):
        alone = statistics.median(timed(direction, 0)[0] for _ in range(repeat))
        # enough GEMMs to outlast the copy
        gemms = max(2, int(2 * alone / gemm_alone) + 1)
        both = [timed(direction, gemms) for _ in range(repeat)]
        copy_s = statistics.median(c for c, _ in both)
        out[direction] = {"alone_s": alone, "alone_GBps": nbytes / alone / 1e9, "with_gemm_s": copy_s,
                          "with_gemm_GBps": nbytes / copy_s / 1e9, "gemms": gemms,
                          "gemm_with_copy_s": statistics.median(g for _, g in both)}
    return out


def host_per_op(device: str, ops: int = 100, repeat: int = 5, compiled: bool = False) -> dict:
    """Host seconds per operator where the GPU waits on the host: a chain of ``ops`` tiny linears,
    forward and backward, in bf16 and under ``torch.autocast`` (bf16, fp32 weights: each linear also
    casts its input and weight); and one transformer block (executor/models.py, hidden 256, 64
    tokens: every kernel tiny) forward and backward, eager and, with ``compiled``, as one
    ``torch.compile``d module (torchtitan's per-block compile), with the kernels each launches."""
    import torch
    import torch.nn.functional as F
    out: dict = {"ops": ops}
    x = torch.randn(16, 16, device=device)
    w32 = torch.randn(16, 16, device=device, requires_grad=True)
    w16 = torch.randn(16, 16, device=device, dtype=torch.bfloat16, requires_grad=True)

    def chain(w, autocast: bool):
        def run():
            ctx = torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if autocast else nullcontext()
            with ctx:
                y = x.to(w.dtype)
                for _ in range(ops):
                    y = F.linear(y, w)
            y.float().sum().backward()
        return run
    out["linear_bf16_s"] = time_per_call(chain(w16, False), device, repeat) / ops
    out["linear_autocast_s"] = time_per_call(chain(w32, True), device, repeat) / ops
    out["block"] = _block_host(device, repeat, compiled)
    return out


def _block_host(device: str, repeat: int, compiled: bool) -> dict:
    import torch

    from planner.cost.host import probe_spec

    from ..models import build_model
    spec = probe_spec(1)
    dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
    block = build_model(spec, device=device).layers["0"].to(dt)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, spec.seq_len, spec.hidden, device=device, dtype=dt, requires_grad=True)
    out: dict = {"hidden": spec.hidden, "tokens": spec.seq_len}

    def step(module):
        def run():
            module(x).float().sum().backward()
        return run
    variants = {"eager": block}
    if compiled:
        try:
            variants["compiled"] = torch.compile(block)
        except Exception as err:
            out["compiled_error"] = str(err).strip().splitlines()[0][:200]
    for name, module in variants.items():
        try:
            fn = step(module)
            for _ in range(3):                          # compile, autotune, warm caches
                fn()
            out[f"{name}_s"] = time_per_call(fn, device, repeat)
            out[f"{name}_kernels"] = _kernels_launched(fn, device)
        except Exception as err:
            out[f"{name}_error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
    return out


def _kernels_launched(fn, device: str) -> int | None:
    """GPU kernels one call of ``fn`` runs (torch.profiler); None on a CPU."""
    import torch
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
