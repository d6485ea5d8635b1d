"""``trace(module, example_inputs) -> LayerGraph`` and ``trace_module`` with everything it saw."""
from __future__ import annotations

from dataclasses import dataclass, replace

import networkx as nx

from ..layers import LayerGraph
from .records import Capture


@dataclass(frozen=True, kw_only=True)
class TraceResult:
    """A traced module: its layer graph, its operator graph and what the trace recorded."""

    graph: LayerGraph
    op_graph: nx.DiGraph
    capture: Capture
    tokens: int                   # tokens (or samples) of the example input: the per-token divisor
    # (layer name, op name) -> (forward op indices, backward op indices) in capture.records
    op_records: dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]]

    @property
    def warnings(self) -> tuple[str, ...]:
        return self.graph.warnings

    @property
    def saved_activation_bytes(self) -> int:
        """Bytes autograd keeps for backward over one forward (each storage once, no parameters)."""
        return sum(s.storage_bytes for s in self.capture.activation_saves())

    @property
    def fwd_flops(self) -> float:
        return sum(r.flops for r in self.capture.records if r.phase == "fwd")

    @property
    def bwd_flops(self) -> float:
        return sum(r.flops for r in self.capture.records if r.phase == "bwd")


def trace_module(module, example_inputs, *, name: str | None = None, loss_fn=None, device: str = "cpu",
                 dtype=None, keep_replays: bool = False, real_budget_bytes: float = 2**30,
                 source: str = "", runnable: bool = False) -> TraceResult:
    """Trace one training step of ``module`` on fake tensors (see capture.py) and build its graphs.

    ``example_inputs``: a tensor, a tuple of tensors (positional) or a dict (keyword) for one
    micro-batch; real, meta or fake tensors all work (only shapes and dtypes are read).
    ``loss_fn(output, (args, kwargs))``: the training loss (default: loss.default_loss).
    ``dtype``: trace with floating-point parameters and inputs cast to it (default: as they are).
    ``runnable``: describe the module as ``auto_parallelize`` runs it, not as Megatron-LM would: tensor
    parallelism splits only the weights of ``nn.Linear`` modules (torch's styles take no other), and the
    graph says whether the module can be cut into pipeline stages (``cut.pipeline_cuts``). False (a
    module only costed): any weight product of Megatron's pattern splits, and any layer boundary cuts.
    """
    from .build import build_graph, count_tokens
    from .capture import capture
    from .cut import pipeline_cuts
    from .experts import expert_split
    from .classify import classify, is_norm_class
    from .opgraph import build_op_graph
    from .structure import assign_ops, layer_spans
    from .tp import infer_tp

    cap = capture(module, example_inputs, loss_fn=loss_fn, device=device, dtype=dtype, keep_replays=keep_replays,
                  real_budget_bytes=real_budget_bytes)
    cls = classify(cap.records, cap.batch, cap.windows)
    spans = layer_spans(cap)
    layer_of = assign_ops(cap, spans)
    norm_modules = {p for p, c in cap.classes.items() if is_norm_class(c)}
    heads = {i for i, s in enumerate(spans) if s.kind == "head"} or {len(spans) - 1}
    tp = infer_tp(cap.records, cls, layer_of, heads, norm_modules, cap.linears if runnable else None)
    tokens = count_tokens(cap, cls)
    model_name = name or type(module).__name__
    shapes = ", ".join("x".join(map(str, s)) + ":" + d.replace("torch.", "") for s, d in cap.input_shapes)
    graph, builder = build_graph(cap, cls, spans, layer_of, tp, tokens, norm_modules, name=model_name,
                                 source=source or f"traced: {model_name} on example inputs {shapes}")
    if runnable:
        can, why = pipeline_cuts(module, [layer.name for layer in graph.layers],
                                 [layer.is_block for layer in graph.layers])
        graph = replace(graph, pipelines=can, pipeline_why=why)
    if graph.num_experts:
        can, why = expert_split(module, [op.name for layer in graph.layers for op in layer.ops
                                         if op.expert and op.kind == "linear" and op.num_gemms > 1])
        graph = replace(graph, splits_experts=can, experts_why=why)
    layer_names = {i: spans[li].path for i, li in layer_of.items()}
    group_names = {i: builder.names[key] for i, key in builder.group_of.items()}
    op_graph = build_op_graph(cap, cls.kind, layer_names, group_names)
    op_records = {(spans[g.layer].path, builder.names[key]): (tuple(g.records), tuple(g.bwd))
                  for key, g in builder.groups.items()}
    return TraceResult(graph=graph, op_graph=op_graph, capture=cap, tokens=tokens.tokens, op_records=op_records)


def trace(module, example_inputs, **kwargs) -> LayerGraph:
    """The layer graph of ``module`` (see ``trace_module`` for the arguments)."""
    return trace_module(module, example_inputs, **kwargs).graph
