"""`meshplan trace MODEL`: trace an nn.Module into its operator graph and layer graph, print the layers.
Importing this file does not import torch (tracing does, when it runs)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ..errors import UserError
from ..layers import build_layer_graph
from ..trace.load import trace_any
from ..trace.measured import PRECISION_DTYPES
from .common import add_debug, add_example_input_arg

EPILOG_TRACE = """\
examples:
  meshplan trace path/to/model.py:build                 # the factory returns (module, example_inputs)
  meshplan trace mypkg.models:build --example-input 1x512:int64
  meshplan trace llama3-8b                              # a zoo model, as a transformers module (meta device)
  meshplan trace model.py:build --json --op-graph ops.json

Traces one training step (forward, loss, backward) on fake tensors: no weights
are allocated. A module that cannot be traced becomes an opaque leaf (run for
real when small, estimated otherwise) with a warning naming its path.
"""


def add_parser(sub) -> None:
    t = sub.add_parser("trace", help="trace an nn.Module into operator and layer graphs",
                       description="Trace an nn.Module (file.py:factory, package.module:factory, a zoo name or "
                                   "a config.json) into its operator graph and layer graph.",
                       epilog=EPILOG_TRACE, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("model", metavar="MODEL")
    add_example_input_arg(t)
    t.add_argument("--seq-len", type=int, help="sequence length of a zoo/config model's example input")
    t.add_argument("--dtype", choices=tuple(PRECISION_DTYPES.values()),
                   help="cast floating-point parameters and inputs (default: as the module has them)")
    t.add_argument("--json", action="store_true", help="print the layer graph and totals as one JSON object")
    t.add_argument("--op-graph", metavar="PATH", help="write the operator graph (networkx node-link JSON)")
    add_debug(t)


def _layer_rows(graph) -> list[dict]:
    rows, prev = [], None
    for layer in graph.layers:
        fwd = sum(op.fwd_flops_per_token for op in layer.ops)
        saved = sum(s.elems * (s.dtype_bytes or 2) for op in layer.ops for s in op.saved)
        if prev and prev["signature"] == layer.signature:
            prev["count"] += 1
            prev["last"] = layer.name
            continue
        prev = {"name": layer.name, "last": layer.name, "count": 1, "kind": layer.kind, "signature": layer.signature,
                "params": layer.params, "ops": len(layer.ops), "fwd_gflop_per_token": fwd / 1e9,
                "saved_bytes_per_token_bf16": saved}
        rows.append(prev)
    return rows


def run(args) -> int:
    result, spec = trace_any(args.model, args.example_input, seq_len=args.seq_len, dtype=args.dtype)
    graph = result.graph
    summary = {"model": graph.name, "source": graph.source, "params": graph.num_params,
               "frozen_params": sum(op.params for layer in graph.layers for op in layer.ops if op.frozen),
               "tokens": result.tokens,
               "seq_len": graph.seq_len, "blocks": graph.num_blocks,
               "distinct_layers": len({layer.signature for layer in graph.layers}),
               "fwd_flops": result.fwd_flops, "bwd_flops": result.bwd_flops,
               "model_flops_per_token": graph.model_flops_per_token(graph.seq_len),
               "saved_activation_bytes": result.saved_activation_bytes,
               "operators": result.op_graph.number_of_nodes(), "warnings": list(result.warnings)}
    if graph.num_experts:
        summary["experts"] = {"routed": graph.num_experts, "splits": graph.splits_experts, "why": graph.experts_why,
                              "per_token": max(op.tokens_factor for layer in graph.layers for op in layer.ops
                                               if op.expert and op.num_gemms > 1)}
    if spec is not None:
        analytical = build_layer_graph(spec)
        summary["analytical"] = {"params": analytical.num_params,
                                 "model_flops_per_token": analytical.model_flops_per_token(graph.seq_len)}
    if args.op_graph:
        import networkx as nx
        try:
            with open(args.op_graph, "w") as f:
                json.dump(nx.node_link_data(result.op_graph, edges="edges"), f, default=str)
        except OSError as e:
            raise UserError(f"cannot write: {e.strerror}", source=args.op_graph) from None
    if args.json:
        json.dump({**summary, "graph": asdict(graph)}, sys.stdout, default=str)
        sys.stdout.write("\n")
        return 0
    sys.stdout.write(format_trace(summary, _layer_rows(graph)))
    return 0


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3f}{unit}"
    return str(int(n))


def format_trace(s: dict, rows: list[dict]) -> str:
    frozen = f" ({_count(s['frozen_params'])} frozen: requires_grad=False)" if s['frozen_params'] else ""
    lines = [f"{s['model']}: {_count(s['params'])} parameters{frozen}, {s['tokens']} tokens per example "
             f"(sequence {s['seq_len']}), {s['operators']} forward operators",
             f"  forward {s['fwd_flops'] / 1e12:.3f} TFLOP, backward {s['bwd_flops'] / 1e12:.3f} TFLOP, "
             f"saved activations {s['saved_activation_bytes'] / 2**20:.1f} MiB (this runtime, trace dtype)",
             f"  {s['blocks']} blocks, {s['distinct_layers']} distinct layers costed"]
    if "experts" in s:
        e = s["experts"]
        lines.append(f"  mixture of experts: {e['routed']} routed experts a layer, {e['per_token']:g} a token; "
                     + ("meshplan's executor splits them over expert-parallel ranks (ep)" if e["splits"] else
                        f"meshplan's executor keeps them whole on every rank (ep 1): {e['why']}"))
    if "analytical" in s:
        a = s["analytical"]
        lines.append(f"  analytical graph: {_count(a['params'])} parameters; traced/analytical model FLOPs "
                     f"{s['model_flops_per_token'] / a['model_flops_per_token']:.4f}")
    lines += ["", f"{'layer':<36} {'kind':<9} {'x':>3} {'params':>12} {'GFLOP/tok':>10} {'saved B/tok':>11} "
                  f"{'ops':>4}  signature"]
    for r in rows:
        name = r["name"] if r["count"] == 1 else f"{r['name']} .. {r['last'].rsplit('.', 1)[-1]}"
        lines.append(f"{name[:36]:<36} {r['kind']:<9} {r['count']:>3} {r['params']:>12,} "
                     f"{r['fwd_gflop_per_token']:>10.4f} {r['saved_bytes_per_token_bf16']:>11,.0f} {r['ops']:>4}  "
                     f"{r['signature']}")
    if s["warnings"]:
        lines += ["", "warnings:"] + [f"  {w}" for w in s["warnings"]]
    return "\n".join(lines) + "\n"
