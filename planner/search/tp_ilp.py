"""Tensor-parallel sharding of one block as an ILP over its operator graph.

Alpa's intra-operator pass (Zheng et al. 2022, OSDI, Sec 4.1), written for the
layouts a transformer activation (tokens x features) can have on a TP group of t:

    R  replicated              F  split by features (columns)
    S  split by sequence       P  partial sums, awaiting a reduction

Each operator picks a strategy; a strategy fixes the layout it needs on its inputs,
the layout it produces, and the same two for gradients in backward:

    linear      column (R -> F; grad of input P)   row (F -> P; needs grad R)
                replicate (R -> R) only when neither split divides its dimensions: whether
                a TP group pays at all is the global search's decision
    attention   heads (F -> F)       replicate (R -> R)
    norm        replicate (R)        sequence (S)
    pointwise   replicate (R)        sequence (S)   feature (F)

Each edge pays to turn one layout into another (slice: free; F/S -> R: all-gather;
P -> R: all-reduce; P -> F/S: reduce-scatter; F <-> S: all-to-all), forward and
backward, priced by the cluster's collectives. A tensor read by several operators
is converted once per layout they need; gradients arriving in one layout are summed
before converting. The block's input and output share one layout (R: tensor
parallel; S: with sequence parallelism, as the global search decided), so identical
blocks chain.

Variables: x[v,s] (operator v uses strategy s), a[u,L] (u's output is materialised
in layout L), b[u,L] (some gradient of u's output arrives in layout L), c/d >= the
products x * a, x * b that carry conversion costs, y[L] the block boundary layout.
Constraints: (a) one strategy per operator; (b) a consumer's strategy needs its
input layout materialised; (c) and its gradient layout accounted; (d) conversion
costs switched on by the products; (e) the boundary is one layout, used by the
block's input and output. Objective: compute + conversions per micro-batch, plus a
tie-break of parameter bytes per rank (a nanosecond per GiB).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import networkx as nx
import pulp

from ..cluster import DTYPE_BYTES, Cluster
from ..cost.compute import flash_attention_s, memory_bound_s, unfused_attention_s
from ..cost.layer import linear_s
from ..layers import Op
from .tp_dataflow import INPUT, OUTPUT
from .. import network
from .ilp import make_solver

LAYOUTS = ("R", "F", "S", "P")
# strategy -> (input layout, output layout, input-gradient layout produced, output-gradient layout needed)
STRATEGIES = {
    "linear": {"replicate": ("R", "R", "R", "R"), "column": ("R", "F", "P", "F"), "row": ("F", "P", "F", "R")},
    "attention": {"heads": ("F", "F", "F", "F"), "replicate": ("R", "R", "R", "R")},
    "norm": {"replicate": ("R", "R", "R", "R"), "sequence": ("S", "S", "S", "S")},
    "pointwise": {"replicate": ("R", "R", "R", "R"), "sequence": ("S", "S", "S", "S"),
                  "feature": ("F", "F", "F", "F")},
}
BOUNDARIES = {"R": ("R", "R", "R", "R"), "S": ("S", "S", "S", "S")}
TIE_BREAK_S_PER_BYTE = 1e-9 / 2**30


@dataclass(frozen=True)
class Context:
    tp: int
    tokens: float             # tokens per micro-batch on one rank (before any sequence split)
    micro_batch: int
    seq_len: int
    precision: str
    attention: str            # "flash" | "unfused"
    sequence_parallel: bool   # the block boundary is S (Megatron's sequence parallelism) instead of R:
                              # decided by the global search, which sees activation memory too
    attention_kernel: str = "flash"   # the runtime's (planner/runtimes.py Runtime.attention_kernel)


@dataclass(frozen=True)
class Sharding:
    strategies: dict[str, str]     # operator name -> strategy
    boundary: str                  # "R" or "S"
    seconds: float                 # compute + conversions per micro-batch (forward + backward)
    param_bytes: float             # parameters per rank (bytes at the compute dtype)


def op_family(op: Op) -> str:
    if op.kind == "linear":
        return "linear"
    if op.kind == "attention":
        return "attention"
    return "norm" if op.norm else "pointwise"


def allowed(op: Op, ctx: Context) -> list[str]:
    """Strategies that can split this operator on ctx.tp ranks."""
    family = op_family(op)
    out = []
    for s in STRATEGIES[family]:
        if s == "sequence" and not (ctx.sequence_parallel and ctx.tp > 1):
            continue      # splitting norms and pointwise ops by sequence is sequence parallelism
        if s == "column" and op.out_features % ctx.tp:
            continue
        if s == "row" and op.in_features % ctx.tp:
            continue
        if s == "heads" and (op.heads % ctx.tp or (op.kv_heads % ctx.tp and ctx.tp % op.kv_heads)):
            continue
        out.append(s)
    if family == "linear" and len(out) > 1:
        # a TP group exists to split GEMMs: whether it pays at all is the global search's
        # question (priced by the cost model); here a splittable linear is split
        out.remove("replicate")
    return out


def compute_s(op: Op, strategy: str, ctx: Context, cluster: Cluster) -> float:
    """Forward + backward seconds of one operator under a strategy, for one micro-batch."""
    dev, prec, t = cluster.device, ctx.precision, ctx.tp
    if op.kind == "linear":
        fwd, bwd, _ = linear_s(op, strategy, t, ctx.tokens, cluster, prec)
        return fwd + bwd
    if op.kind == "attention":
        heads = op.heads / (t if strategy == "heads" else 1)
        if ctx.attention == "flash":
            f, b = flash_attention_s(ctx.micro_batch, heads, ctx.seq_len, ctx.seq_len, op.head_dim, dev, prec,
                                     causal=op.causal, window=op.window,
                                     fused=ctx.attention_kernel == "fused", dropout=op.attn_dropout)
        else:
            f, b = unfused_attention_s(ctx.micro_batch, heads, ctx.seq_len, ctx.seq_len, op.head_dim, dev, prec,
                                       dropout=op.attn_dropout)
        return f + b
    share = 1 if strategy == "replicate" else t
    scale = ctx.tokens * DTYPE_BYTES[prec] / 2 / share
    return memory_bound_s(op.bytes_fwd * scale, dev) + memory_bound_s(op.bytes_bwd * scale, dev)


def param_bytes(op: Op, strategy: str, ctx: Context) -> float:
    split = ctx.tp if strategy in ("column", "row") else 1
    return op.params * DTYPE_BYTES[ctx.precision] / split


def reshard_s(src: str, dst: str, features: int, ctx: Context, cluster: Cluster) -> float:
    """Seconds to turn an activation (or gradient) of ``features`` per token from one
    layout into another on the TP group."""
    if src == dst:
        return 0.0
    if dst == "P":
        return math.inf                       # nothing produces partial sums by converting
    grp = network.group(cluster, ctx.tp, 1)
    nbytes = features * ctx.tokens * DTYPE_BYTES[ctx.precision]
    if src == "R":
        return 0.0                            # keep a slice
    if src == "P":
        return network.all_reduce_s(cluster, nbytes, grp) if dst == "R" else \
            network.reduce_scatter_s(cluster, nbytes, grp)
    if dst == "R":
        return network.all_gather_s(cluster, nbytes, grp)
    return network.all_to_all_s(cluster, nbytes / ctx.tp, grp)        # F <-> S


class _Problem:
    """The strategies, layouts and costs of one graph, shared by the ILP and brute force."""

    def __init__(self, graph: nx.DiGraph, ctx: Context, cluster: Cluster):
        self.g, self.ctx, self.cluster = graph, ctx, cluster
        self.ops = [v for v in nx.topological_sort(graph) if v not in (INPUT, OUTPUT)]
        self.options = {v: allowed(graph.nodes[v]["op"], ctx) for v in self.ops}
        boundaries = ["S"] if ctx.sequence_parallel and ctx.tp > 1 else ["R"]
        self.options[INPUT] = boundaries
        self.options[OUTPUT] = boundaries
        self.features = {}
        for u in graph.nodes:
            widths = [d["features"] for _, _, d in graph.out_edges(u, data=True)]
            if widths:
                self.features[u] = widths[0]

    def spec(self, v: str, s: str) -> tuple[str, str, str, str]:
        if v in (INPUT, OUTPUT):
            return BOUNDARIES[s]
        return STRATEGIES[op_family(self.g.nodes[v]["op"])][s]

    def op_cost(self, v: str, s: str) -> float:
        if v in (INPUT, OUTPUT):
            return 0.0
        op = self.g.nodes[v]["op"]
        return compute_s(op, s, self.ctx, self.cluster) + TIE_BREAK_S_PER_BYTE * param_bytes(op, s, self.ctx)

    def conversion(self, u: str, su: str, layout: str, backward: bool) -> float:
        _, out, _, out_grad = self.spec(u, su)
        if backward:
            return reshard_s(layout, out_grad, self.features[u], self.ctx, self.cluster)
        return reshard_s(out, layout, self.features[u], self.ctx, self.cluster)

    def cost(self, choice: dict[str, str]) -> float:
        """The objective of one full assignment (used by brute force and to report)."""
        if choice[INPUT] != choice[OUTPUT]:
            return math.inf
        total = sum(self.op_cost(v, s) for v, s in choice.items())
        for u in self.features:
            need = {self.spec(v, choice[v])[0] for v in self.g.successors(u)}
            grads = {self.spec(v, choice[v])[2] for v in self.g.successors(u)}
            total += sum(self.conversion(u, choice[u], L, False) for L in need)
            total += sum(self.conversion(u, choice[u], L, True) for L in grads)
        return total


def solve_sharding(graph: nx.DiGraph, ctx: Context, cluster: Cluster, *, solver: str = "cbc",
                   time_limit_s: float = 20.0) -> Sharding:
    """The cheapest strategy per operator (an ILP, labelled as in the module docstring)."""
    pr = _Problem(graph, ctx, cluster)
    nodes = [INPUT, *pr.ops, OUTPUT]
    prob = pulp.LpProblem("tp_sharding", pulp.LpMinimize)
    x = {(v, s): pulp.LpVariable(f"x_{i}_{s}", cat="Binary") for i, v in enumerate(nodes) for s in pr.options[v]}
    name = {v: i for i, v in enumerate(nodes)}
    us = 1e6          # the objective in microseconds: per-block costs are 1e-6..1e-2 s, below solver tolerances
    objective = [us * pr.op_cost(v, s) * x[v, s] for v, s in x]
    for v in nodes:
        prob += pulp.lpSum(x[v, s] for s in pr.options[v]) == 1, f"a_one_strategy_{name[v]}"
    for b in pr.options[INPUT]:
        prob += x[INPUT, b] == x[OUTPUT, b], f"e_boundary_{b}"
    for u in pr.features:
        for backward, tag in ((False, "a"), (True, "b")):
            index = 2 if backward else 0
            layouts = {pr.spec(v, s)[index] for v in graph.successors(u) for s in pr.options[v]}
            for L in layouts:
                m = pulp.LpVariable(f"{tag}_{name[u]}_{L}", cat="Binary")
                for v in graph.successors(u):
                    for s in pr.options[v]:
                        if pr.spec(v, s)[index] == L:
                            prob += m >= x[v, s], f"{'c' if backward else 'b'}_{name[u]}_{L}_by_{name[v]}_{s}"
                for su in pr.options[u]:
                    cost = pr.conversion(u, su, L, backward)
                    if cost == math.inf:
                        prob += x[u, su] + m <= 1, f"d_{tag}_{name[u]}_{su}_cannot_make_{L}"
                    elif cost > 0:
                        link = pulp.LpVariable(f"{'d' if backward else 'c'}_{name[u]}_{su}_{L}", 0)
                        prob += link >= x[u, su] + m - 1, f"d_{tag}_{name[u]}_{su}_{L}"
                        objective.append(us * cost * link)
    prob += pulp.lpSum(objective)
    status = prob.solve(make_solver(solver, time_limit_s))
    if pulp.LpStatus[status] != "Optimal":
        raise RuntimeError(f"tensor-parallel sharding ILP: {pulp.LpStatus[status]}")
    choice = {v: max(pr.options[v], key=lambda s: x[v, s].value() or 0) for v in nodes}
    return Sharding(strategies={v: choice[v] for v in pr.ops}, boundary=choice[INPUT], seconds=pr.cost(choice),
                    param_bytes=sum(param_bytes(graph.nodes[v]["op"], choice[v], ctx) for v in pr.ops))


def brute_force(graph: nx.DiGraph, ctx: Context, cluster: Cluster) -> Sharding:
    """Every assignment, for small graphs: the reference the ILP is tested against."""
    pr = _Problem(graph, ctx, cluster)
    nodes = [INPUT, *pr.ops, OUTPUT]
    best = None
    for values in itertools.product(*(pr.options[v] for v in nodes)):
        choice = dict(zip(nodes, values))
        cost = pr.cost(choice)
        if best is None or cost < best[0]:
            best = (cost, choice)
    cost, choice = best
    return Sharding(strategies={v: choice[v] for v in pr.ops}, boundary=choice[INPUT], seconds=cost,
                    param_bytes=sum(param_bytes(graph.nodes[v]["op"], choice[v], ctx) for v in pr.ops))


def replicated(graph: nx.DiGraph, ctx: Context, cluster: Cluster) -> Sharding:
    """Everything replicated: what the ILP must never be worse than."""
    pr = _Problem(graph, ctx, cluster)
    choice = {v: "replicate" for v in pr.ops}
    choice[INPUT] = choice[OUTPUT] = "R"
    return Sharding(strategies={v: choice[v] for v in pr.ops}, boundary="R", seconds=pr.cost(choice),
                    param_bytes=sum(param_bytes(graph.nodes[v]["op"], "replicate", ctx) for v in pr.ops))
