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
    executor.eager_counts.FAMILIES), None if none fits."""
    if spec.is_moe or spec.sliding_window:
        return None
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
        rows = []
        for c in CLASSES:
            if c not in fwd and c not in bwd:
                continue
            (fh, ft), (bh, bt) = (_split_coef(part, x.get(c), h, q, kv, f, v) for x in (fwd, bwd))
            rows.append((c, fh, ft, bh, bt))
        out.append((regime, EagerBytes(by_class=tuple(rows), fwd_kernels=t["kernels"][f"{part}_fwd"],
                                       bwd_kernels=t["kernels"][f"{part}_bwd"], fwd_ops=t["ops"][f"{part}_fwd"],
                                       bwd_ops=t["ops"][f"{part}_bwd"])))
    return tuple(out)


def _split_coef(part: str, coef, h, q, kv, f, v) -> tuple[float, float]:
    """(bytes of hidden-sized tensors, bytes of tensor-parallel ones) per token."""
    if coef is None:
        return 0.0, 0.0
    if part == "block":
        ch, cq, ckv, cf, c1 = coef
        return ch * h + c1, cq * q + ckv * kv + cf * f
    ch, cv, c1 = coef
    return ch * h + c1, cv * v
