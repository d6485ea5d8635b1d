"""``meshplan trace MODEL`` and ``meshplan profile``: their flags and what they do.

planner/cli.py registers them with ``add_parsers`` and calls ``run``; importing
this file does not import torch (the handlers do, when they run). ``meshplan profile``
is a call of the profiler's values API (executor/profile: profile_machine, rederive).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ..errors import UserError
from .load import trace_any
from .measured import PRECISION_DTYPES

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

EPILOG_PROFILE = """\
examples:
  meshplan profile --nproc 2                            # this machine: compute, memory, gloo/NCCL collectives
  meshplan profile --nproc 2 --out profiles/measured/myhost.toml --ops model.py:build
  meshplan plan --model model.py:build --cluster profiles/measured/myhost.toml --gpus 2

Writes a cluster profile TOML that --cluster accepts; every number in it is
measured by this command. With --ops MODEL it also times each traced operator
here and writes NAME.ops.json beside the TOML; `meshplan plan --cluster NAME.toml`
then uses those times for the ops it finds there (see planner/trace/measured.py).
"""


def add_example_input_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--example-input", metavar="SHAPE:DTYPE[,...]",
                   help="example input of a traced --model file.py:factory, e.g. 1x512:int64 (several: comma "
                        "separated); overrides the factory's own example inputs")


def add_parsers(sub) -> None:
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
    t.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p = sub.add_parser("profile", help="measure this machine and write a cluster profile TOML",
                       description="Measure this machine (GEMM, attention, memory bandwidth, collectives over "
                                   "torch.distributed) and write a cluster profile TOML.",
                       epilog=EPILOG_PROFILE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes for the collectives (default: the GPUs, or 2 on a CPU)")
    p.add_argument("--out", metavar="PATH.toml", help="where to write the profile (default ./<hostname>.toml)")
    p.add_argument("--name", help="profile name (default: measured-<hostname>)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="what to measure (default: cuda when present)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per process, as torchrun runs them (default 1)")
    p.add_argument("--ops", metavar="MODEL", help="also time each traced operator of MODEL here")
    add_example_input_arg(p)
    p.add_argument("--quick", action="store_true", help="fewer shapes and message sizes (seconds, not minutes)")
    p.add_argument("--json", action="store_true", help="also print the measurements as JSON")
    p.add_argument("--from", dest="from_json", metavar="NAME.kernels.json",
                   help="measure nothing: derive the profile again from the raw measurements an earlier "
                        "`meshplan profile` wrote (after meshplan's derivations improved)")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)


def run(args) -> int:
    if args.command == "trace":
        return trace_command(args)
    return profile_command(args)


# -- meshplan profile ----------------------------------------------------------------------------

def profile_command(args) -> int:
    """The flags as a call of the profiler (executor/profile: it measures with torch.distributed, so
    it is imported here, when the command runs, and nowhere else in the planner)."""
    from executor.profile import profile_machine, rederive
    if args.from_json:
        out = rederive(args.from_json, out=args.out, name=args.name)
        sys.stdout.write(f"wrote {out} (derived from {args.from_json})\n")
        return 0
    result = profile_machine(device=args.device, nproc=args.nproc, threads=args.threads, quick=args.quick,
                             out=args.out, name=args.name, ops_model=args.ops, example_input=args.example_input,
                             progress=lambda line: sys.stdout.write(line + "\n"))
    if args.json:
        json.dump({"device": result.device, "collectives": result.collectives}, sys.stdout)
        sys.stdout.write("\n")
    return 0


# -- meshplan trace ------------------------------------------------------------------------------

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


def trace_command(args) -> int:
    result, spec = trace_any(args.model, args.example_input, seq_len=args.seq_len, dtype=args.dtype)
    graph = result.graph
    summary = {"model": graph.name, "source": graph.source, "params": graph.num_params, "tokens": result.tokens,
               "seq_len": graph.seq_len, "blocks": graph.num_blocks,
               "distinct_layers": len({layer.signature for layer in graph.layers}),
               "fwd_flops": result.fwd_flops, "bwd_flops": result.bwd_flops,
               "model_flops_per_token": graph.model_flops_per_token(graph.seq_len),
               "saved_activation_bytes": result.saved_activation_bytes,
               "operators": result.op_graph.number_of_nodes(), "warnings": list(result.warnings)}
    if spec is not None:
        from ..layers import build_layer_graph
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
    lines = [f"{s['model']}: {_count(s['params'])} parameters, {s['tokens']} tokens per example "
             f"(sequence {s['seq_len']}), {s['operators']} forward operators",
             f"  forward {s['fwd_flops'] / 1e12:.3f} TFLOP, backward {s['bwd_flops'] / 1e12:.3f} TFLOP, "
             f"saved activations {s['saved_activation_bytes'] / 2**20:.1f} MiB (this runtime, trace dtype)",
             f"  {s['blocks']} blocks, {s['distinct_layers']} distinct layers costed"]
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
