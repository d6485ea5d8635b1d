"""Which linears tensor parallelism splits, found on the traced dataflow (Megatron's pattern).

Shoeybi et al. 2019 (Megatron-LM, Sec 3): a column-parallel linear takes a
replicated input and leaves its output split across ranks; everything up to
the next row-parallel linear works on the split tensor (activation, attention
by heads); the row-parallel linear takes the split input and all-reduces to a
replicated output. The trace finds that pattern by propagating a state over
every forward tensor in op order:

  R  replicated activations (the residual stream; what sequence parallelism shards)
  S  split by tensor parallelism, remembering the column linears it came from
  N  not an activation of the tokens (integers, masks, position tables)

A linear reading R is a column candidate, reading S a row. A candidate is
demoted to ``replicate`` (and the propagation rerun) when its split output would
meet a replicated activation in one op (attention included: its queries, keys
and values are split by the same heads or not at all), enter a normalisation
that reduces over the split features (one within a head, as Qwen3's query and
key norms, does not), leave its layer, or never reach a row linear; only
in the head may it reach the loss unreduced (the vocabulary-parallel
cross-entropy of Megatron-LM). Convolutions, embeddings and opaque modules are
never split by this rule (embeddings are vocabulary-parallel, as in the
analytical graph), nor is a weight product run by a module torch's TP styles
do not take (anything but ``nn.Linear``: GPT-2's ``Conv1D``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .classify import Classified
from .records import OpRecord

R, S, N = "R", "S", "N"


@dataclass(frozen=True, kw_only=True)
class TPResult:
    style: dict[int, str]          # linear op index -> column | row | replicate
    state: dict[int, str]          # forward op index -> state of its floating outputs
    tp_layers: frozenset[int]      # layers with something tensor parallelism splits


def _inputs(rec: OpRecord, state: dict, anc: dict):
    """(state, ancestry) of each activation input: parameters and buffers are not activations."""
    out = []
    for m in rec.inputs:
        if m.param or m.buffer:
            continue
        if not m.is_float:
            out.append((N, frozenset()))
        elif m.producer < 0:
            out.append((R if m.model_input else N, frozenset()))   # a floating-point model input is R
        else:
            out.append((state.get(m.producer, N), anc.get(m.producer, frozenset())))
    return out


def _per_head(rec: OpRecord, state: dict, anc: dict, records) -> bool:
    """Whether a normalisation of split tensors reduces within one head: over a last dimension that
    divides, and is narrower than, the output of every column linear the tensors came from (Qwen3's and
    OLMo2's query/key norms over head_dim). TP splits whole heads, so each rank holds whole groups."""
    for m in rec.inputs:
        if m.param or m.buffer or m.producer < 0 or state.get(m.producer) != S or not m.shape:
            continue
        width = m.shape[-1]
        for a in anc.get(m.producer, ()):
            out = records[a].outputs[0].shape[-1] if records[a].outputs and records[a].outputs[0].shape else 0
            if not (width < out and out % width == 0):
                return False
    return True


def _step(rec, kind, layer_of, norm_modules, state, anc, style, demoted, conflicts, records):
    ins = _inputs(rec, state, anc)
    split = [a for s, a in ins if s == S]
    has_r = any(s == R for s, _ in ins)
    split_anc = frozenset().union(*split) if split else frozenset()
    layer = layer_of.get(rec.index)
    for m in rec.inputs:        # a split tensor must not leave its layer (except into the head's loss)
        if m.producer >= 0 and state.get(m.producer) == S and layer_of.get(m.producer) != layer:
            conflicts |= anc.get(m.producer, frozenset())
    i = rec.index
    if kind == "linear":
        if split:
            style[i], state[i] = "row", R
            if has_r:
                conflicts |= split_anc
        elif has_r and i not in demoted:
            style[i], state[i], anc[i] = "column", S, frozenset({i})
        else:
            style[i], state[i] = "replicate", R if has_r else N
        return
    if kind in ("conv", "opaque", "embedding"):
        conflicts |= split_anc
        state[i] = R if (has_r or split or kind == "embedding") else N
        return
    if kind == "norm" or rec.module in norm_modules:
        if split and _per_head(rec, state, anc, records):
            state[i], anc[i] = S, split_anc
            return
        conflicts |= split_anc
        state[i] = R if (has_r or split) else N
        return
    if split and has_r:     # attention too: queries, keys and values split by the same heads, or none
        conflicts |= split_anc
    if split:
        state[i], anc[i] = S, split_anc
    else:
        state[i] = R if has_r else N
    if not any(o.is_float for o in rec.outputs):
        state[i] = N


def infer_tp(records: tuple[OpRecord, ...], cls: Classified, layer_of: dict[int, int], head_layers: set[int],
             norm_modules: set[str], linears: frozenset[str] | None = None) -> TPResult:
    """``linears``: the module paths whose weights TP's styles can split (``Capture.linears``); a weight
    product run by another module (GPT-2's Conv1D) is never split, as a convolution (None: any)."""
    forward = [r for r in records if r.phase == "fwd"]
    kinds = dict(cls.kind)
    if linears is not None:
        for i, k in cls.kind.items():
            if k == "linear" and records[i].module not in linears:
                kinds[i] = "conv"
    demoted: set[int] = set()
    for _ in range(64):
        state, anc, style = {}, {}, {}
        conflicts: set[int] = set()
        for rec in forward:
            _step(rec, kinds.get(rec.index), layer_of, norm_modules, state, anc, style, demoted, conflicts,
                  records)
        paired = set()
        for i, s in style.items():
            if s == "row":
                paired |= _ancestry_of_row(records[i], anc)
        for i, s in style.items():
            if s == "column" and i not in paired and layer_of.get(i) not in head_layers:
                conflicts.add(i)
        new = {i for i in conflicts if style.get(i) == "column"} - demoted
        if not new:
            break
        demoted |= new
    tp_layers = frozenset(layer_of[i] for i, s in style.items() if s in ("column", "row")) | frozenset(
        layer_of[i] for i, k in cls.kind.items() if k in ("embedding", "attention") and i in layer_of)
    return TPResult(style=style, state=state, tp_layers=tp_layers)


def _ancestry_of_row(rec: OpRecord, anc: dict) -> frozenset[int]:
    out = frozenset()
    for m in rec.inputs:
        if m.producer >= 0 and not m.param:
            out |= anc.get(m.producer, frozenset())
    return out
