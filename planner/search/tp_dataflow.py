"""A layer's operators as a dataflow graph: what the tensor-parallel sharding ILP (tp_ilp.py) reads.

Nodes are operators (``planner.layers.Op``), plus two virtual nodes: ``input`` (the
layer's input activation) and ``output`` (what it hands to the next layer). Edges
carry ``features``: the width of the activation (elements per token) flowing along
them. The tracer builds such graphs from real modules; ``block_graph`` builds one
from the analytical transformer block.
"""
from __future__ import annotations

import networkx as nx

from ..layers import Layer, Op

INPUT, OUTPUT = "input", "output"


def new_graph(hidden: int) -> nx.DiGraph:
    g = nx.DiGraph(hidden=hidden)
    g.add_node(INPUT, op=None)
    g.add_node(OUTPUT, op=None)
    return g


def add_op(g: nx.DiGraph, op: Op, *inputs: tuple[str, int]) -> str:
    """Add ``op`` consuming (node, features) pairs; returns its node name."""
    g.add_node(op.name, op=op)
    for src, features in inputs:
        g.add_edge(src, op.name, features=features)
    return op.name


def block_graph(layer: Layer, hidden: int) -> nx.DiGraph:
    """The dataflow of an analytical pre-norm transformer block (planner.layers._block)."""
    def find(*suffixes: str) -> Op | None:
        for op in layer.ops:
            if any(op.name.endswith(s) for s in suffixes):
                return op
        return None

    h = hidden
    g = new_graph(h)
    norm1, norm2 = find("attn_norm"), find("mlp_norm")
    q, k, v, o = find("q_proj"), find("k_proj"), find("v_proj"), find("o_proj")
    core, rope = find(".core"), find(".rope")
    res1, res2 = find("residual1"), find("residual2")
    n1 = add_op(g, norm1, (INPUT, h))
    qn = add_op(g, q, (n1, h))
    kn = add_op(g, k, (n1, h))
    vn = add_op(g, v, (n1, h))
    if rope is not None:
        # RoPE rotates q and k elementwise: model it on q's path, k joins the core directly
        qn = add_op(g, rope, (qn, q.out_features))
    c = add_op(g, core, (qn, q.out_features), (kn, k.out_features), (vn, v.out_features))
    on = add_op(g, o, (c, q.out_features))
    r1 = add_op(g, res1, (on, h), (INPUT, h))
    n2 = add_op(g, norm2, (r1, h))
    fc1, act, fc2 = find("fc1"), find(".gelu"), find("fc2")
    if fc1 is not None:
        a = add_op(g, fc1, (n2, h))
        a = add_op(g, act, (a, fc1.out_features))
        out = add_op(g, fc2, (a, fc1.out_features))
    else:
        gate, up, swiglu, down = find("gate_proj"), find("up_proj"), find(".act"), find("down_proj")
        gn = add_op(g, gate, (n2, h))
        un = add_op(g, up, (n2, h))
        a = add_op(g, swiglu, (gn, gate.out_features), (un, up.out_features))
        out = add_op(g, down, (a, down.in_features))
    r2 = add_op(g, res2, (out, h), (r1, h))
    g.add_edge(r2, OUTPUT, features=h)
    return g
