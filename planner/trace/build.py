"""From recorded operators to the layer graph the cost model and the search consume.

One ``Op`` per unit the planner reasons about, named by module path (what the
executor shards by):

- a weight (``nn.Linear``, GPT-2's ``Conv1D``, a 3-D expert tensor used by
  ``_grouped_mm``, a convolution): a ``linear`` named by its module (by its
  parameter path when a module holds several, as Mixtral's experts do), with
  in/out features from the product's shapes, ``tokens_factor`` = rows / tokens
  and ``num_gemms`` = experts;
- an embedding table: ``embedding``; an attention kernel: ``attention``
  (``<module>:attention``), keeping what it saves per token but not the
  kernel's internals (scores, log-sum-exp), which the cost model adds for the
  kernel it prices (``--attention flash|unfused``);
- the remaining work of a module: ``elementwise`` with the bytes its operators
  read and write forward and backward (at 2-byte activations), one op per
  tensor-parallel state (``split``); a normalisation module keeps its path as
  the name (the executor's sequence-parallel plan).

An op is ``frozen`` where it uses parameters and the module gave every one of
them ``requires_grad=False`` (those it owns, and the weight it multiplies by: a
tied head's is the embedding's). One that mixes frozen and trainable
parameters (a frozen weight beside a bias that trains, as BitFit does) is not
frozen: it is planned as training all of them, and the graph warns.

Quantities are per token: tokens = batch x the query length of the attention
(x the sequence of integer inputs when there is no attention), or per sample
for a model without either (an MLP, a CNN); ``seq_len`` is 1 then.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from ..layers import Layer, LayerGraph, Op, Saved, replicated_params
from .classify import Classified
from .records import Capture, OpRecord, TensorMeta
from .structure import LayerSpan, layer_of_module, parent
from .tp import N, R, S, TPResult


@dataclass(frozen=True, kw_only=True)
class Tokens:
    tokens: int          # what quantities are divided by
    seq_len: int         # the LayerGraph's default sequence length


def count_tokens(cap: Capture, cls: Classified) -> Tokens:
    if cls.attention:
        info = cls.attention[min(cls.attention)]
        return Tokens(tokens=max(1, info.batch * info.q_len), seq_len=info.q_len)
    if cap.input_shapes:
        shape, dtype = cap.input_shapes[0]
        if len(shape) == 2 and ("int" in dtype):
            return Tokens(tokens=shape[0] * shape[1], seq_len=shape[1])
    return Tokens(tokens=max(1, cap.batch), seq_len=1)


@dataclass
class _Group:
    key: tuple
    layer: int
    first: int
    kind: str                      # linear | attention | embedding | elementwise
    module: str
    records: list[int] = field(default_factory=list)
    bwd: list[int] = field(default_factory=list)
    params: int = 0
    split: str = "none"
    weight: str = ""


def _scaled_bytes(m: TensorMeta, act_dtype: str) -> float:
    """Bytes at 2-byte activations: floats of the activation dtype scaled, others as they are."""
    if m.is_float and m.dtype == act_dtype:
        return m.addressed_bytes * 2.0 / m.itemsize
    return float(m.addressed_bytes)


def _rec_bytes(rec: OpRecord, act_dtype: str) -> float:
    if rec.view:
        return 0.0
    return sum(_scaled_bytes(m, act_dtype) for m in rec.inputs + rec.outputs)


class Builder:
    """Turns one capture into a LayerGraph (state kept only while building)."""

    def __init__(self, cap: Capture, cls: Classified, spans: list[LayerSpan], layer_of: dict[int, int],
                 tp: TPResult, tokens: Tokens, norm_modules: set[str]):
        self.cap, self.cls, self.spans, self.layer_of, self.tp, self.t = cap, cls, spans, layer_of, tp, tokens
        self.norm_modules = norm_modules
        self.records = cap.records
        self.groups: dict[tuple, _Group] = {}
        self.group_of: dict[int, tuple] = {}
        self.tied_params = 0
        self.tied_layers = False
        self.names: dict[tuple, str] = {}
        self._by_module: dict[str, tuple] = {}
        self.owned: dict[tuple, list[str]] = {}      # group key -> the parameter paths it owns
        self.tied_weights: set[str] = set()          # parameters used by a group other than their owner

    # -- grouping ------------------------------------------------------------------------------
    def split_of(self, state: str) -> str:
        """How tensor parallelism splits a tensor of this state (the layer graph's ``Split``)."""
        if state == S:
            return "tp"
        if state == R and self.tp.tp_layers:     # sequence parallelism shards every replicated activation
            return "sp"
        return "none"

    def _key(self, rec: OpRecord) -> tuple[tuple, str]:
        kind = self.cls.kind.get(rec.index, "elementwise")
        if kind in ("linear", "conv", "embedding"):
            return ("w", rec.module, self.cls.weight[rec.index]), "embedding" if kind == "embedding" else "linear"
        if kind == "attention":
            return ("attn", self.cls.attention_of[rec.index]), "attention"
        if kind in ("matmul", "opaque"):
            return (kind, rec.index), "linear"
        return ("ew", rec.module, self.split_of(self.tp.state.get(rec.index, N)), rec.in_loss), "elementwise"

    def _add(self, key: tuple, kind: str, rec: OpRecord) -> None:
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = _Group(key=key, layer=self.layer_of[rec.index], first=rec.index, kind=kind,
                                          module=rec.module, weight=key[2] if key[0] == "w" else "",
                                          split=key[2] if key[0] == "ew" else "none")
        g.first = min(g.first, rec.index)
        g.records.append(rec.index)
        self.group_of[rec.index] = key

    def group(self) -> None:
        forward = [(rec, *self._key(rec)) for rec in self.records if rec.phase == "fwd"]
        for rec, key, kind in forward:           # the weights, attention kernels and products first
            if key[0] != "ew":
                self._add(key, kind, rec)
        # a module that is one weight (nn.Linear, Conv1D, nn.Embedding): its reshapes and bias adds join it
        weights: dict[str, set[tuple]] = {}
        for key, g in self.groups.items():
            if key[0] == "w":
                weights.setdefault(g.module, set()).add(key)
        for rec, key, kind in forward:
            if key[0] != "ew":
                continue
            mine = weights.get(rec.module, ())
            if len(mine) == 1 and not rec.in_loss:
                key = next(iter(mine))
                kind = self.groups[key].kind
            self._add(key, kind, rec)
        for g in self.groups.values():
            g.records.sort()
        for rec in self.records:
            if rec.phase == "bwd":
                key = self.group_of.get(rec.fwd_op) or self._module_group(rec.module)
                self.groups[key].bwd.append(rec.index)

    def _module_group(self, module: str) -> tuple:
        """A backward op no forward op claimed: the module's elementwise work (the head's for the root)."""
        if module in self._by_module:
            return self._by_module[module]
        mine = [key for key, g in self.groups.items() if g.module == module]
        key = next((k for k in mine if k[0] == "ew"), mine[0] if mine else None)
        if key is None:
            layer = layer_of_module(module, self.spans) if module else None
            key = ("ew", module, "none", False)
            self.groups[key] = _Group(key=key, layer=len(self.spans) - 1 if layer is None else layer,
                                      first=len(self.records), kind="elementwise", module=module)
        self._by_module[module] = key
        return key

    # -- parameters ------------------------------------------------------------------------------
    def own_params(self) -> list[tuple[str, int]]:
        """Give each parameter to one group; return the parameters no op used."""
        numel = {name: math.prod(shape) for name, shape in self.cap.params.items()}
        weight_groups: dict[str, list[tuple]] = {}
        for key, g in self.groups.items():
            if key[0] == "w" and parent(g.weight) == g.module:
                weight_groups.setdefault(g.module, []).append(key)
        owner: dict[str, tuple] = {}
        for key, g in self.groups.items():          # (1) a weight belongs to the first op multiplying by it
            if key[0] == "w" and g.weight not in owner:
                owner[g.weight] = key
        for rec in self.records:                    # (2) biases to their module's weight, (3) else first user
            if rec.phase != "fwd":
                continue
            for m in rec.inputs:
                if m.param and m.param not in owner:
                    mine = weight_groups.get(parent(m.param), [])
                    owner[m.param] = mine[0] if len(mine) == 1 else self.group_of[rec.index]
        for name, key in owner.items():
            self.groups[key].params += numel.get(name, 0)
            self.owned.setdefault(key, []).append(name)
        for key, g in self.groups.items():          # a shared weight used again elsewhere: tied
            if key[0] == "w" and owner.get(g.weight) != key:
                self.tied_params += numel.get(g.weight, 0)
                self.tied_layers |= self.groups[owner[g.weight]].layer != g.layer
                self.tied_weights.add(g.weight)
        return [(name, n) for name, n in numel.items() if name not in owner]

    def frozen(self, g: _Group) -> bool:
        """Whether ``g``'s op is ``frozen`` (module docstring): it uses parameters, none with requires_grad."""
        used = self._used(g)
        return bool(used) and all(name in self.cap.frozen_params for name in used)

    def mixed(self, g: _Group) -> bool:
        """Whether ``g``'s op uses both frozen parameters and ones that train (planned as training all)."""
        frozen = sum(name in self.cap.frozen_params for name in self._used(g))
        return 0 < frozen < len(self._used(g))

    def _used(self, g: _Group) -> list[str]:
        """The parameter paths ``g``'s op uses: those it owns and the weight it multiplies by."""
        owned = self.owned.get(g.key, [])
        return owned + [g.weight] if g.weight and g.weight not in owned else owned

    # -- saved activations ---------------------------------------------------------------------------
    def saved_by_group(self) -> dict[tuple, list[Saved]]:
        out: dict[tuple, dict[tuple, float]] = {}
        savers: dict[int, set] = {}          # storage -> layers whose ops saved it
        for s in self.cap.saved:
            savers.setdefault(s.storage, set()).add(self.layer_of.get(min(s.op, len(self.records) - 1)))
        for s in self.cap.activation_saves():
            if s.storage in self.cls.internal_storages:
                continue
            op = min(s.op, len(self.records) - 1)
            if len(savers[s.storage]) > 1 and s.producer >= 0:
                op = s.producer          # shared by several layers (RoPE tables): held once, where it was made
            key = self.group_of.get(op) or self._module_group(s.module)
            g = self.groups[key]
            state = self.tp.state.get(s.producer, N) if s.producer >= 0 else (R if s.is_float else N)
            split = self.split_of(state)
            dtype = 0 if (s.is_float and s.dtype == self.cap.activation_dtype) else s.itemsize
            gathered = (g.kind == "linear" and self.tp.style.get(op) == "column"
                        and any(m.storage == s.storage for m in self.records[op].inputs))
            bucket = out.setdefault(key, {})
            k = (split, dtype, gathered)
            bucket[k] = bucket.get(k, 0.0) + s.storage_bytes / s.itemsize / self.t.tokens
        return {key: [Saved(elems=_round(e), split=k[0], dtype_bytes=k[1], gathered_input=k[2])
                      for k, e in sorted(b.items())] for key, b in out.items()}


def _round(x: float) -> float:
    """Six significant digits: equal blocks give equal numbers whatever the summation order."""
    return float(f"{x:.6g}") if x else 0.0


def signature(layer: Layer) -> str:
    """Equal for layers that cost the same: ops with names relative to the layer, and its totals."""
    def rel(name: str) -> str:
        if name == layer.name:
            return "."
        inside = layer.name and name.startswith(layer.name) and name[len(layer.name):][:1] in (".", ":")
        return name[len(layer.name):] if inside else name
    ops = tuple((rel(op.name), *(getattr(op, f) for f in _OP_FIELDS)) for op in layer.ops)
    text = repr((layer.kind, ops, layer.tp_allreduce_fwd_elems, layer.tp_allreduce_bwd_elems, layer.output_elems,
                 layer.params_replicated))
    return f"{layer.kind}:{hashlib.sha1(text.encode()).hexdigest()[:12]}"


_OP_FIELDS = ("kind", "params", "in_features", "out_features", "tp", "tokens_factor", "num_gemms", "heads",
              "kv_heads", "head_dim", "causal", "window", "attn_dropout", "bytes_fwd", "bytes_bwd", "split",
              "saved", "workspace", "norm", "frozen")


def _label(module: str) -> str:
    return module or "(root)"


def _gemm_dims(rec: OpRecord, kind: str) -> tuple[float, int, int, int]:
    """(rows M, in features K, out features N, GEMMs) of one weight or matmul call."""
    ins = [m for m in rec.inputs]
    if kind == "opaque":
        out = rec.outputs[0]
        n = max(1, out.shape[-1] if out.shape else 1)
        k = max(1, round(rec.flops / (2.0 * max(1, out.numel // n)) / n))
        return rec.flops / (2.0 * k * n), k, n, 1
    if rec.name in ("addmm", "baddbmm"):
        ins = ins[1:]
    a, b = ins[0], ins[1]
    gemms = 1
    if rec.name == "_grouped_mm":
        k, n = a.shape[-1], b.shape[-1]
        gemms = b.shape[0] if len(b.shape) == 3 else rec.outputs[0].shape[0]
    elif rec.name in ("mm", "addmm", "bmm", "baddbmm") and len(a.shape) >= 2:
        if a.param and not b.param:          # W @ x: features are W's rows, tokens x's columns
            k, n = a.shape[-1], a.shape[-2]
        else:
            k, n = a.shape[-1], b.shape[-1]
        if rec.name in ("bmm", "baddbmm") and (a.param or b.param):
            gemms = a.shape[0]
    else:                                    # convolutions: out channels x (in channels per group x kernel)
        w = max((m for m in rec.inputs if m.param), key=lambda m: m.numel, default=b)
        n = w.shape[0]
        k = max(1, w.numel // max(1, n))
    m = rec.flops / (2.0 * k * n) if k and n else 0.0
    return m, int(k), int(n), int(gemms)


def _linear_op(b: Builder, g: _Group, name: str, saved: list[Saved]) -> tuple[Op, float, list]:
    """The linear op of a weight (or parameter-free product) group; its forward all-reduce elements and
    the (input storage, elements) its column-parallel backward all-reduces."""
    rows = 0.0
    k = n = gemms = 1
    column_inputs = []
    kind = "linear"
    for i in g.records:
        if b.cls.kind.get(i) not in ("linear", "conv", "matmul", "opaque"):
            continue               # the weight module's reshapes and bias adds
        kind = b.cls.kind[i]
        m, k, n, gemms = _gemm_dims(b.records[i], kind)
        rows += m
        if b.tp.style.get(i) == "column":
            act = [x for x in b.records[i].inputs if not x.param and x.is_float]
            if act:
                share = 1.0 if gemms > 1 else m / b.t.tokens
                column_inputs.append((act[0].storage, k * share))
    style = next((b.tp.style[i] for i in g.records if i in b.tp.style), "replicate")
    tf = rows / b.t.tokens
    op = Op(name=name, kind="linear", params=g.params, in_features=k, out_features=n, tp=style,
            tokens_factor=_round(tf), num_gemms=gemms, saved=tuple(saved), expert=gemms > 1, frozen=b.frozen(g))
    # Megatron (Shoeybi et al. 2019, Sec 3): a row-parallel linear all-reduces its output; grouped expert
    # GEMMs combine their top-k rows per token first (Megatron-Core MoE token unpermute): one width
    allreduce_fwd = n * (1.0 if gemms > 1 else tf) if style == "row" else 0.0
    return op, allreduce_fwd, column_inputs


def _attention_op(b: Builder, g: _Group, name: str, saved: list[Saved]) -> Op:
    info = b.cls.attention[g.key[1]]
    return Op(name=name, kind="attention", heads=info.heads, kv_heads=info.kv_heads, head_dim=info.head_dim,
              causal=info.causal, window=info.window, attn_dropout=info.dropout, saved=tuple(saved))


def _bytes(b: Builder, indices) -> float:
    return _round(sum(_rec_bytes(b.records[i], b.cap.activation_dtype) for i in indices) / b.t.tokens)


def _workspace(b: Builder, g: _Group) -> tuple[Saved, ...]:
    """The largest tensor the group's backward writes (freed once its backward is done)."""
    best = None
    for i in g.bwd:
        rec = b.records[i]
        if rec.view or not rec.outputs:
            continue
        out = max(rec.outputs, key=lambda m: m.addressed_bytes)
        if best is None or out.addressed_bytes > best.addressed_bytes:
            best = out
    if best is None or not best.is_float:
        return ()
    dtype = 0 if best.dtype == b.cap.activation_dtype else best.itemsize
    return (Saved(elems=_round(best.addressed_bytes / best.itemsize / b.t.tokens), split=g.split, dtype_bytes=dtype),)


def _elementwise_op(b: Builder, g: _Group, name: str, saved: list[Saved], has_backward: bool) -> Op:
    fwd = _bytes(b, g.records)
    bwd = _bytes(b, g.bwd) if has_backward else fwd
    if g.kind == "embedding":
        # backward scatters the output gradient into the table's rows: read it, update the rows
        grads = sum(_scaled_bytes(b.records[i].outputs[0], b.cap.activation_dtype) for i in g.records
                    if b.records[i].outputs)
        return Op(name=name, kind="embedding", params=g.params, bytes_fwd=fwd, bytes_bwd=_round(2 * grads / b.t.tokens),
                  split="sp", saved=tuple(saved), frozen=b.frozen(g))
    return Op(name=name, kind="elementwise", params=g.params, bytes_fwd=fwd, bytes_bwd=bwd, split=g.split,
              saved=tuple(saved), workspace=_workspace(b, g),
              norm=g.module in b.norm_modules and not g.key[3], frozen=b.frozen(g))


def _names(b: Builder) -> dict[tuple, str]:
    """Op names: module paths where an op is one module (see the module docstring)."""
    per_module: dict[tuple, int] = {}
    for g in b.groups.values():
        k = ("loss" if g.key[0] == "ew" and g.key[3] else g.key[0], g.module)
        per_module[k] = per_module.get(k, 0) + 1
    names = {}
    matmuls = 0
    for g in b.groups.values():
        kind, mod = g.key[0], g.module
        if kind == "w":
            owned = parent(g.weight) == mod
            names[g.key] = (mod if owned and per_module[("w", mod)] == 1 else g.weight if owned else mod or g.weight)
        elif kind == "attn":
            names[g.key] = f"{_label(mod)}:attention"
        elif kind == "opaque":
            names[g.key] = _label(mod)
        elif kind == "matmul":
            matmuls += 1
            names[g.key] = f"{_label(mod)}:matmul.{matmuls}"
        elif g.key[3]:
            names[g.key] = "loss" if per_module[("loss", mod)] == 1 else f"loss.{g.split}"
        elif mod in b.norm_modules and per_module[("ew", mod)] == 1:
            names[g.key] = mod
        elif per_module[("ew", mod)] == 1:
            names[g.key] = f"{_label(mod)}:elementwise"
        else:
            names[g.key] = f"{_label(mod)}:elementwise.{g.split}"
    return names


def _layer(b: Builder, span: LayerSpan, groups: list[_Group], saved: dict, names: dict,
           unused: list[tuple[str, tuple[int, bool]]], has_backward: bool) -> Layer:
    ops, fwd_elems, column_inputs, expert_elems, experts = [], 0.0, {}, 0.0, set()
    for g in groups:
        mine = saved.get(g.key, [])
        if g.kind == "linear":
            op, ar, cols = _linear_op(b, g, names[g.key], mine)
            fwd_elems += ar
            expert_elems += ar if op.expert else 0.0
            experts |= {g.module} if op.expert else set()
            for storage, elems in cols:
                column_inputs[storage] = max(column_inputs.get(storage, 0.0), elems)
        elif g.kind == "attention":
            op = _attention_op(b, g, names[g.key], mine)
        else:
            op = _elementwise_op(b, g, names[g.key], mine, has_backward)
            if g.kind == "embedding":        # vocabulary-parallel lookup: all-reduce its output
                fwd_elems += op_out_width(b, g)
        if op.params or op.bytes_fwd or op.bytes_bwd or op.saved or op.kind != "elementwise":
            ops.append(op)
    for module, (n, frozen) in unused:
        ops.append(Op(name=f"{module}:unused", kind="elementwise", params=n, frozen=frozen))
    # Megatron's f operator: backward all-reduces the input gradient of each column-parallel region once
    bwd_elems = sum(column_inputs.values())
    call = b.cap.modules.get(span.path)
    out = call.output.numel / b.t.tokens if call and call.output else 0.0
    ops = _mark_routed(ops, experts)
    # the routed experts' share of the TP collectives (their row-parallel output, one width per token each way):
    # under expert parallelism an all-to-all moves their tokens instead (Layer.tp_allreduce_expert_elems), unless
    # the layer also has dense (shared) experts, which keep the pair
    shared = any(op.kind == "linear" and not op.expert and op.tp == "row" and ".mlp" in op.name for op in ops)
    layer = Layer(name=span.path, kind=span.kind, signature="", ops=tuple(ops),
                  tp_allreduce_fwd_elems=_round(fwd_elems), tp_allreduce_bwd_elems=_round(bwd_elems),
                  output_elems=_round(out), params_replicated=replicated_params(ops),
                  tp_allreduce_expert_elems=0.0 if shared else _round(expert_elems))
    from dataclasses import replace
    return replace(layer, signature=signature(layer))


def _mark_routed(ops: list[Op], modules: set[str]) -> list[Op]:
    """Grouped expert GEMMs (``num_gemms`` > 1: a MoE layer's routed experts, one weight of E matrices, held by
    ``modules``) run on the tokens routed to experts, and so does the elementwise work recorded inside their module
    (the activation between them): each is ``Op.expert``."""
    from dataclasses import replace
    if not modules:
        return ops
    inside = tuple(m + sep for m in modules for sep in (".", ":"))
    return [replace(op, expert=True) if not op.expert and op.name.startswith(inside) else op for op in ops]


def _mixed_warning(b: Builder) -> tuple[str, ...]:
    """One warning naming the ops whose parameters are partly frozen (module docstring), or none."""
    mixed = [b.names[key] for key, g in b.groups.items() if b.mixed(g)]
    if not mixed:
        return ()
    named = ", ".join(mixed[:3]) + (f" and {len(mixed) - 3} more" if len(mixed) > 3 else "")
    return (f"{named}: some of the parameters have requires_grad=False and others train; planned as training all "
            "of them (an op is planned as frozen where none of its parameters trains)",)


def op_out_width(b: Builder, g: _Group) -> float:
    return sum(b.records[i].outputs[0].numel for i in g.records if b.records[i].outputs) / b.t.tokens


def _heads(graph_ops: list[Op]) -> tuple[int, int]:
    """The smallest head count (tp must divide it); without attention, what the split linears allow."""
    attn = [op for op in graph_ops if op.kind == "attention"]
    if attn:
        return min(op.heads for op in attn), min(op.kv_heads for op in attn)
    dims = [op.out_features if op.tp == "column" else op.in_features for op in graph_ops
            if op.kind == "linear" and op.tp in ("column", "row")]
    g = 0
    for d in dims:
        g = math.gcd(g, d)
    return (g or 1), (g or 1)


def build_graph(cap: Capture, cls: Classified, spans: list[LayerSpan], layer_of: dict[int, int], tp: TPResult,
                tokens: Tokens, norm_modules: set[str], *, name: str, source: str) -> tuple[LayerGraph, Builder]:
    b = Builder(cap, cls, spans, layer_of, tp, tokens, norm_modules)
    b.group()
    unused = b.own_params()
    saved = b.saved_by_group()
    has_backward = any(r.phase == "bwd" for r in cap.records)
    names = b.names = _names(b)
    by_layer: dict[int, list[_Group]] = {}
    for g in sorted(b.groups.values(), key=lambda g: g.first):
        by_layer.setdefault(g.layer, []).append(g)
    unused_by_layer: dict[int, dict[str, tuple[int, bool]]] = {}    # module -> (parameters, all of them frozen)
    for pname, n in unused:
        li = layer_of_module(parent(pname), spans)
        li = 0 if li is None else li
        count, frozen = unused_by_layer.setdefault(li, {}).get(parent(pname), (0, True))
        unused_by_layer[li][parent(pname)] = (count + n, frozen and pname in cap.frozen_params)
    layers = [_layer(b, span, by_layer.get(i, []), saved, names, sorted(unused_by_layer.get(i, {}).items()),
                     has_backward) for i, span in enumerate(spans)]
    all_ops = [op for layer in layers for op in layer.ops]
    heads, kv_heads = _heads(all_ops)
    blocks = [layer.output_elems for layer in layers if layer.is_block] or [layer.output_elems for layer in layers]
    embeds = [g for g in b.groups.values() if g.kind == "embedding"]
    vocab = cap.params.get(embeds[0].weight, (0,))[0] if embeds else 0
    graph = LayerGraph(name=name, layers=tuple(layers), seq_len=tokens.seq_len, hidden=int(round(max(blocks or [0]))),
                       vocab_size=int(vocab), num_heads=heads, num_kv_heads=kv_heads,
                       tied_embeddings=b.tied_layers and b.tied_params > 0,
                       tied_params=b.tied_params if b.tied_layers else 0, source=source,
                       tied_frozen=bool(b.tied_weights) and b.tied_weights <= cap.frozen_params,
                       warnings=tuple(cap.warnings) + _mixed_warning(b),
                       num_experts=max((op.num_gemms for op in all_ops if op.expert), default=0))
    return graph, b
