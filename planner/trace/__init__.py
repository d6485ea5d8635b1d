"""The tracer: any nn.Module into an operator graph and a layer graph, which the planner plans.

    from planner.trace import trace, trace_module
    graph = trace(module, example_inputs)            # LayerGraph, as config models have
    result = trace_module(module, example_inputs)    # + networkx operator graph, capture, warnings

``planner.trace(module, example_inputs)`` works too: this package is callable.
Importing it does not import torch; tracing does (and only tracing needs it).

Modules:
  capture.py    run forward + loss + backward on fake tensors, record every aten op (records.py)
  opaque.py     an untraceable module runs for real (or is estimated) instead of crashing
  loss.py       the training loss appended to the module's output
  flops.py      FLOPs and bytes per aten op, from shapes
  classify.py   which ops are linears, attention, embeddings, norms, elementwise
  structure.py  layers from module structure; repeated blocks
  tp.py         column/row/replicate per linear and each tensor's split (Megatron's pattern)
  build.py      per-token Ops, Layers and the LayerGraph
  opgraph.py    the networkx operator graph
  tracer.py     trace / trace_module / TraceResult
  experts.py    which routed experts the executor can split over ep ranks (transformers' grouped experts)
  load.py       --model file.py:factory / package.module:factory and --example-input
  measured.py   per-op measured times (meshplan profile --ops): storage and attachment (no torch);
                the timing itself is the profiler's (executor/profile/ops.py)
  zoo.py        a zoo model or config.json as a transformers module to trace

`meshplan trace` is planner/cli/trace.py; the hardware profiler (`meshplan profile`) is executor/profile/.
"""
from __future__ import annotations

import sys
import types

__all__ = ["trace", "trace_module", "TraceResult"]


def __getattr__(name: str):
    if name in __all__:
        from . import tracer
        return getattr(tracer, name)
    raise AttributeError(f"module 'planner.trace' has no attribute {name!r}")


class _CallablePackage(types.ModuleType):
    """``planner.trace(module, example_inputs)``: the package named trace is also the function."""

    def __call__(self, module, example_inputs, **kwargs):
        from .tracer import trace
        return trace(module, example_inputs, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
