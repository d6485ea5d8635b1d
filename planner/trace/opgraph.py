"""The operator graph: a networkx DiGraph of the forward aten operators.

Nodes are the forward operators in the order they ran (integer ids = op
indices), with attributes:

  op, module, layer, group (the layer-graph op it belongs to), kind,
  fwd_flops, bwd_flops (of the backward operators its autograd node ran),
  bytes_read, bytes_written, bwd_bytes, params (parameter paths it read),
  param_elems, output_shapes, saved_bytes (activation bytes autograd kept,
  each storage once), opaque (the untraceable module it ran in for real), loss.

Edges are tensors from the op that wrote them to each op that read them:
``bytes`` (addressed bytes), ``shape``, ``dtype``.
"""
from __future__ import annotations

import math

import networkx as nx

from .records import Capture


def build_op_graph(cap: Capture, kinds: dict[int, str], layer_names: dict[int, str],
                   group_names: dict[int, str]) -> nx.DiGraph:
    g = nx.DiGraph(name="operators", tokens_batch=cap.batch)
    bwd_flops: dict[int, float] = {}
    bwd_bytes: dict[int, float] = {}
    for rec in cap.records:
        if rec.phase == "bwd" and rec.fwd_op >= 0:
            bwd_flops[rec.fwd_op] = bwd_flops.get(rec.fwd_op, 0.0) + rec.flops
            bwd_bytes[rec.fwd_op] = bwd_bytes.get(rec.fwd_op, 0.0) + rec.bytes_read + rec.bytes_written
    saved: dict[int, int] = {}
    for s in cap.activation_saves():
        saved[s.op] = saved.get(s.op, 0) + s.storage_bytes
    for rec in cap.records:
        if rec.phase != "fwd":
            continue
        params = sorted({m.param for m in rec.inputs if m.param})
        g.add_node(rec.index, op=rec.func, module=rec.module, layer=layer_names.get(rec.index, ""),
                   group=group_names.get(rec.index, ""), kind=kinds.get(rec.index, "elementwise"),
                   fwd_flops=rec.flops, bwd_flops=bwd_flops.get(rec.index, 0.0), bytes_read=rec.bytes_read,
                   bytes_written=rec.bytes_written, bwd_bytes=bwd_bytes.get(rec.index, 0.0), params=params,
                   param_elems=sum(math.prod(cap.params.get(p, ())) for p in params),
                   output_shapes=[m.shape for m in rec.outputs], saved_bytes=saved.get(rec.index, 0),
                   opaque=rec.opaque, loss=rec.in_loss)
        for m in rec.inputs:
            if m.producer >= 0:
                if g.has_edge(m.producer, rec.index):
                    g.edges[m.producer, rec.index]["bytes"] += m.addressed_bytes
                else:
                    g.add_edge(m.producer, rec.index, bytes=m.addressed_bytes, shape=m.shape, dtype=m.dtype)
    return g
