"""FLOPs and bytes of one aten operator, from the shapes alone.

Conventions (the same as the analytical layer graph, ``planner.layers``):

- a matrix product of (m x k) and (k x n) is 2 m k n FLOPs (one multiply and
  one add per term; Narayanan et al. 2021, arXiv:2104.04473, Sec 5.1);
- attention is its two products, 4 b h s_q s_kv d forward, with no causal
  halving (Korthikanti et al. 2022, Appendix A; PaLM, Chowdhery et al. 2022,
  Appendix B); its backward is five products of the same size, 2.5x the
  forward (Dao 2023, FlashAttention-2, Sec 3.2), as ``torch.utils.flop_counter``
  counts it;
- convolutions use ``torch.utils.flop_counter``'s formulas (2 x output
  elements x input channels per group x kernel size);
- elementwise work is counted in bytes, not FLOPs: what a kernel reads plus
  what it writes, each tensor counted once over the elements it addresses
  (a broadcast dimension of stride 0 costs nothing); views move no bytes.
"""
from __future__ import annotations

import torch

from ..layers import attention_flops

aten = torch.ops.aten

# attention kernels: query, key, value are their first tensors (after grad_out in backward)
SDPA_FORWARD = {
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward",
}
SDPA_BACKWARD = {name + "_backward" for name in SDPA_FORWARD} | {
    "_flash_attention_backward", "_efficient_attention_backward"}
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "addbmm", "matmul", "linear"}
CONVOLUTIONS = {"convolution", "_convolution", "convolution_overrideable", "cudnn_convolution",
                "_slow_conv2d_forward", "mkldnn_convolution"}
EMBEDDINGS = {"embedding", "_embedding_bag", "embedding_bag"}
# not counted at all: they only read metadata
METADATA_OPS = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_local_scalar_dense",
                "is_nonzero", "equal", "_has_compatible_shallow_copy_type", "set_", "record_stream"}
# aliasing ops that torch does not flag as views but that move no data
ALIASES = {"_unsafe_view", "lift_fresh", "lift_fresh_copy_", "_reshape_alias"}


def op_name(func) -> str:
    """'mm' for aten.mm.default: the operator's name without namespace or overload."""
    return func._opname if hasattr(func, "_opname") else str(func)


def is_view(func) -> bool:
    return bool(getattr(func, "is_view", False)) or op_name(func) in ALIASES


def addressed_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches when it streams ``t``: dimensions of stride 0 (broadcast) count once."""
    elems = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elems *= size
    return elems * t.element_size()


def _shape(t) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _grouped_mm_flops(a, b, out) -> float:
    """torch._grouped_mm: 2-D x 3-D (tokens grouped by expert), 2-D x 2-D (the weight gradient,
    groups along the reduction), 3-D x 3-D (batched): 2 x (outputs of one group set) x reduction."""
    k = a.shape[-1]
    if out.dim() == 3 and a.dim() == 2 and b.dim() == 2:
        return 2.0 * out.numel() / out.shape[0] * k     # each group reduces over its own rows
    return 2.0 * out.numel() * k


def _sdpa_shapes(name: str, args) -> tuple:
    """(query, key, value) of an attention kernel (its backward takes grad_out first)."""
    if name in SDPA_BACKWARD:
        return args[1], args[2], args[3]
    return args[0], args[1], args[2]


def attention_forward_flops(q_shape, k_shape) -> float:
    """4 b h s_q s_kv d: QK^T and PV (key/value heads broadcast to the query heads), no causal halving."""
    b, h, s_q, d = q_shape
    return attention_flops(b, h, s_q, k_shape[-2], d, causal=False)


def matmul_flops(func, args, out) -> float:
    """Matrix-multiply FLOPs of one aten call (0 for anything that is not a product)."""
    name = op_name(func)
    if name == "mm":
        (m, k), n = _shape(args[0]), args[1].shape[-1]
        return 2.0 * m * k * n
    if name == "addmm":
        (m, k), n = _shape(args[1]), args[2].shape[-1]
        return 2.0 * m * k * n
    if name in ("bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        batch, m, k = _shape(a)
        return 2.0 * batch * m * k * b.shape[-1]
    if name == "_grouped_mm":
        return _grouped_mm_flops(args[0], args[1], out)
    if name in SDPA_FORWARD:
        q, k, _ = _sdpa_shapes(name, args)
        return attention_forward_flops(_shape(q), _shape(k))
    if name in SDPA_BACKWARD:
        q, k, _ = _sdpa_shapes(name, args)
        return 2.5 * attention_forward_flops(_shape(q), _shape(k))
    if name in CONVOLUTIONS or name == "convolution_backward":
        from torch.utils.flop_counter import flop_registry
        formula = flop_registry.get(func._overloadpacket)
        if formula is None:
            formula = flop_registry[aten.convolution] if name != "convolution_backward" else None
        return float(formula(*args, out_val=out)) if formula else 0.0
    return 0.0


def storage_nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return addressed_bytes(t)
