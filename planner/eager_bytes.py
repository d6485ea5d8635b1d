"""How many bytes torch eager moves per token in a layer's elementwise kernels, by bandwidth class: a
property of the model's operators (like their FLOPs), counted from the executor's own models
(planner/eager_table.py, written by ``python -m executor.eager_counts --write``). The layer graph
carries these bytes (planner/layers.py); the cost model prices them (planner/cost/eager.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from .eager_table import TABLE

# the bandwidth classes of eager kernels (executor.eager_counts.kernel_class); a profile measures
# each (executor.profile.kernels.eager_kernels), else every class streams at the HBM rate
CLASSES = ("stream", "cast_up", "cast_down", "strided", "reduce", "softmax", "norm")


@dataclass(frozen=True, kw_only=True)
class EagerBytes:
    """Elementwise bytes per token of one layer in one regime, by bandwidth class: (class, fwd_h,
    fwd_tp, bwd_h, bwd_tp) where ``*_h`` is split by tensor parallelism only with sequence
    parallelism (hidden-sized tensors) and ``*_tp`` always; kernels per micro-batch."""

    by_class: tuple[tuple[str, float, float, float, float], ...]
    fwd_kernels: int
    bwd_kernels: int
    fwd_ops: int = 0            # every operator the dispatcher runs (views and GEMMs included), per micro-batch
    bwd_ops: int = 0


def feature_key(spec) -> str | None:
    """The family of ``spec`` in TABLE (what decides a block's operator sequence; the families are
    executor.eager_counts.FAMILIES), None if none fits. Qwen3's q/k norms take the family of the block without
    them; ``layer_eager_bytes`` adds the norms (``qk_norm_bytes``, ``QK_NORM_KERNELS``)."""
    if spec.is_moe or (spec.sliding_window and spec.sliding_window < spec.seq_len):   # a window no shorter than
        return None                                     # the sequence is full causal attention (runtimes.unbuilt)
    if spec.norm == "layernorm" and spec.mlp == "gelu" and spec.linear_bias and spec.max_positions:
        return "layernorm-gelu-bias-learned" + ("-dropout" if spec.dropout else "")
    if spec.norm == "rmsnorm" and spec.mlp == "swiglu" and not spec.linear_bias and not spec.max_positions \
            and not spec.dropout:
        return "rmsnorm-swiglu-rope" + ("-qkvbias" if spec.qkv_bias else "")
    return None


def layer_eager_bytes(spec, kind: str) -> tuple[tuple[str, EagerBytes], ...]:
    """(regime, bytes) pairs for a layer of ``kind`` ('block', 'embedding', 'head'; the final
    norm's bytes are counted with the head) of a config model, () when TABLE has no family for it."""
    family = feature_key(spec)
    if family is None:
        return ()
    h, q, kv, f, v = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn_hidden, spec.vocab_size
    part = {"block": "block", "embedding": "embed", "head": "head"}.get(kind)
    out = []
    for regime in ("autocast", "bf16", "fp32"):
        t = TABLE[family][regime]
        if part is None:
            out.append((regime, EagerBytes(by_class=(), fwd_kernels=0, bwd_kernels=0)))
            continue
        fwd, bwd = t[f"{part}_fwd"], t[f"{part}_bwd"]
        qk = qk_norm_bytes(spec, regime) if part == "block" and spec.qk_norm else (0.0, 0.0)
        rows = []
        for c in CLASSES:
            if c not in fwd and c not in bwd and not (c == "norm" and any(qk)):
                continue
            (fh, ft), (bh, bt) = (_split_coef(part, x.get(c), h, q, kv, f, v) for x in (fwd, bwd))
            if c == "norm":
                ft, bt = ft + qk[0], bt + qk[1]
            rows.append((c, fh, ft, bh, bt))
        extra = QK_NORM_KERNELS if part == "block" and spec.qk_norm else {}
        out.append((regime, EagerBytes(
            by_class=tuple(rows), fwd_kernels=t["kernels"][f"{part}_fwd"] + extra.get("fwd_kernels", 0),
            bwd_kernels=t["kernels"][f"{part}_bwd"] + extra.get("bwd_kernels", 0),
            fwd_ops=t["ops"][f"{part}_fwd"] + extra.get("fwd_ops", 0),
            bwd_ops=t["ops"][f"{part}_bwd"] + extra.get("bwd_ops", 0))))
    return tuple(out)


# An RMSNorm as CUDA runs it (aten._fused_rms_norm): one kernel forward, two backward (the input gradient, then
# gamma's), one operator each way; executor/eager_counts.py counts the block norms so, where the CPU decomposes them
FUSED_RMS_NORM = {"fwd_kernels": 1, "bwd_kernels": 2, "fwd_ops": 1, "bwd_ops": 1}
# Qwen3's q and k norms (executor/models.py QKNorm), which the families of TABLE do not have: two of them a block
QK_NORM_KERNELS = {key: 2 * n for key, n in FUSED_RMS_NORM.items()}


def fused_rms_norm_bytes(width: float, rows: float, e: int) -> tuple[float, float]:
    """(forward, backward) bytes per token of a fused RMSNorm over ``width`` elements a token in ``rows`` rows of its
    own (one rstd each): forward reads x and writes y at e bytes an element and rstd in fp32; backward reads dy, x
    and rstd and writes dx, then gamma's pass reads dy and x again."""
    return 2 * e * width + 4 * rows, 3 * e * width + 4 * rows + 2 * e * width


def qk_norm_bytes(spec, regime: str) -> tuple[float, float]:
    """(forward, backward) bytes per token of a block's q and k norms, over widths q and kv (split by tensor
    parallelism with the heads), one row a head: ``fused_rms_norm_bytes``, as executor/eager_counts.py prices the
    block norms. e is 4 under autocast (torch.amp runs norms in fp32) and in fp32, 2 in bf16. Every regime is priced
    as fused kernels (the CPU's decomposition of RMSNorm moves more; the fp32 regime's block norms are traced as it
    runs)."""
    width = spec.q_dim + spec.kv_dim
    return fused_rms_norm_bytes(width, width / spec.head_dim, 2 if regime == "bf16" else 4)


def _split_coef(part: str, coef, h, q, kv, f, v) -> tuple[float, float]:
    """(bytes of hidden-sized tensors, bytes of tensor-parallel ones) per token."""
    if coef is None:
        return 0.0, 0.0
    if part == "block":
        ch, cq, ckv, cf, c1 = coef
        return ch * h + c1, cq * q + ckv * kv + cf * f
    ch, cv, c1 = coef
    return ch * h + c1, cv * v
