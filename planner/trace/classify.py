"""What each recorded forward operator is, for the layer graph's four op kinds.

- a product with a parameter operand is a ``linear`` (``mm``, ``addmm``, ``bmm``,
  ``_grouped_mm`` of experts), a ``conv`` or an ``embedding`` lookup;
- an SDPA kernel is ``attention``; so is the unfused pattern of two
  parameter-free products with the scores between them (QK^T, softmax, mask,
  dropout, PV), as eager and dropout paths run it;
- a parameter-free product that is not attention is a ``matmul``;
- normalisations (LayerNorm, RMSNorm, GroupNorm, BatchNorm kernels) are ``norm``;
- the rest (pointwise, reductions, copies, views, the loss) is ``elementwise``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .flops import CONVOLUTIONS, EMBEDDINGS, MATMULS, SDPA_FORWARD
from .records import OpRecord

NORM_KERNELS = {"native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "native_group_norm",
                "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                "_native_batch_norm_legit_no_training", "batch_norm"}
NORM_CLASSES = ("Norm",)          # LayerNorm, RMSNorm, LlamaRMSNorm, GroupNorm, BatchNorm2d...


def is_norm_class(class_name: str) -> bool:
    """A normalisation module, by its class name (see NORM_CLASSES)."""
    return any(n in class_name for n in NORM_CLASSES)


@dataclass(frozen=True, kw_only=True)
class AttentionInfo:
    heads: int
    kv_heads: int
    head_dim: int
    q_len: int
    kv_len: int
    batch: int
    causal: bool
    dropout: bool
    window: int = 0


@dataclass(frozen=True, kw_only=True)
class Classified:
    kind: dict[int, str]                      # forward op index -> kind
    weight: dict[int, str]                    # op index -> parameter path of its weight operand
    attention_of: dict[int, int]              # op index -> index of its attention group's leader
    attention: dict[int, AttentionInfo]       # leader -> shape
    internal_storages: frozenset[int] = field(default=frozenset())   # scores, probabilities, log-sum-exp


def _weight_param(rec: OpRecord) -> str:
    params = [m for m in rec.inputs if m.param]
    return max(params, key=lambda m: m.numel).param if params else ""


_COPIES = {"expand", "clone", "contiguous", "reshape", "view", "_unsafe_view", "_reshape_alias", "unsqueeze",
           "transpose", "permute"}


def _kv_heads(records, key) -> int:
    """Key/value heads before a repeat (``repeat_kv``: expand, then reshape to the query heads): the
    fewest elements along the chain of copies and views that made the key, per (batch, length, dim)."""
    b, h, s_kv, d = key.shape
    least, producer = key.numel, key.producer
    for _ in range(8):
        if producer < 0 or records[producer].name not in _COPIES:
            break
        src = records[producer].inputs[0]
        least = min(least, src.numel)
        producer = src.producer
    per_head = b * s_kv * d
    kv = least // per_head if per_head and least % per_head == 0 else h
    return kv if kv and h % kv == 0 else h


def _sdpa_info(records, rec: OpRecord) -> AttentionInfo:
    q, k = rec.inputs[0], rec.inputs[1]
    b, h, s_q, d = q.shape
    causal = bool(rec.attr("is_causal") or rec.attr("mask_causal") or rec.attr("causal_input"))
    return AttentionInfo(heads=h, kv_heads=_kv_heads(records, k), head_dim=d, q_len=s_q, kv_len=k.shape[2],
                         batch=b, causal=causal, dropout=(rec.attr("dropout_p") or 0.0) > 0)


def _descends(records, index: int, target: int, module: str, depth: int = 12) -> list[int] | None:
    """The chain of ops in ``module`` from op ``target``'s output to op ``index``'s first input."""
    frontier = [(index, [])]
    for _ in range(depth):
        nxt = []
        for i, path in frontier:
            for m in records[i].inputs[:1] if i == index else records[i].inputs:
                p = m.producer
                if p == target:
                    return path
                if p > target and records[p].module == module and records[p].name not in MATMULS:
                    nxt.append((p, path + [p]))
        frontier = nxt
        if not frontier:
            return None
    return None


def _unfused_attention(records, free: list[int], batch: int):
    """Pairs (scores product, output product) of parameter-free products in one module."""
    groups = {}
    used = set()
    for j in free:
        for i in reversed([i for i in free if i < j and i not in used and records[i].module == records[j].module]):
            chain = _descends(records, j, i, records[j].module)
            if chain is None:
                continue
            a, b = records[i].inputs[-2], records[i].inputs[-1]
            if len(a.shape) != 3 or len(b.shape) != 3:
                continue
            members = {i, j, *chain}
            # the dropout mask and scaling of the scores hang off the same scores: take every op
            # of the module between the two products that reads something the group wrote
            for k in range(i + 1, j):
                if records[k].module == records[i].module and any(m.producer in members for m in records[k].inputs):
                    members.add(k)
            bh, s_q, d = a.shape
            heads = bh // batch if batch and bh % batch == 0 else bh
            causal = any(records[k].attr("causal_input") for k in members)
            dropout = any(records[k].name in ("bernoulli_", "bernoulli", "native_dropout", "dropout")
                          for k in members)
            groups[i] = (sorted(members), AttentionInfo(heads=heads, kv_heads=heads, head_dim=d, q_len=s_q,
                                                         kv_len=b.shape[-1], batch=bh // max(1, heads),
                                                         causal=causal, dropout=dropout))
            used.update((i, j))
            break
    return groups


def classify(records: tuple[OpRecord, ...], batch: int, windows: dict[str, int] | None = None) -> Classified:
    kind, weight, attention_of, attention = {}, {}, {}, {}
    internal: set[int] = set()
    free = []
    for rec in records:
        if rec.phase != "fwd":
            continue
        i = rec.index
        param = _weight_param(rec)
        if rec.name == "opaque":
            kind[i] = "opaque"
        elif param and rec.name in MATMULS:
            kind[i], weight[i] = "linear", param
        elif param and rec.name in CONVOLUTIONS:
            kind[i], weight[i] = "conv", param
        elif param and rec.name in EMBEDDINGS:
            kind[i], weight[i] = "embedding", param
        elif rec.name in SDPA_FORWARD:
            kind[i] = "attention"
            attention_of[i] = i
            attention[i] = replace(_sdpa_info(records, rec), window=(windows or {}).get(rec.module, 0))
            internal.update(m.storage for m in rec.outputs[1:])
        elif rec.name in MATMULS:
            kind[i] = "matmul"
            free.append(i)
        elif rec.name in NORM_KERNELS:
            kind[i] = "norm"
        else:
            kind[i] = "elementwise"
    for leader, (members, info) in _unfused_attention(records, free, batch).items():
        attention[leader] = replace(info, window=(windows or {}).get(records[leader].module, 0))
        for k in members:
            kind[k] = "attention"
            attention_of[k] = leader
            if k != members[-1]:
                internal.update(m.storage for m in records[k].outputs)
    return Classified(kind=kind, weight=weight, attention_of=attention_of, attention=attention,
                      internal_storages=frozenset(internal))
