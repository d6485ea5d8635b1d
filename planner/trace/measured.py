"""Measured per-op times (``meshplan profile --ops``): where they are kept and how they reach a graph.

Storage: ``meshplan profile --out NAME.toml --ops MODEL`` writes ``NAME.ops.json``
next to the cluster profile::

    {"schema": 1, "command": "meshplan profile ...", "device": "...", "dtype": "float32",
     "model": "model.py:factory", "seq_len": 512, "tokens": 512,
     "ops": {"<op signature>": {"fwd_s_per_token": ..., "bwd_s_per_token": ..., "example": "op name"}}}

An op signature hashes everything the cost model reads from an ``Op`` except its
name and measured times, so identical operators of identical blocks share one
entry and one measurement.

Attachment: ``meshplan plan --model MODEL --cluster NAME.toml`` looks for
``NAME.ops.json`` beside the TOML; when its dtype is the plan's precision and its
sequence length the plan's, every traced op whose signature it holds gets
``measured_fwd_s`` / ``measured_bwd_s`` (seconds per token), which the cost model
prefers to its roofline (``planner.cost.layer.layer_cost``: per token x tokens /
the op's tensor-parallel divisor). Ops it does not hold keep the roofline.
This file imports no torch.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import fields, replace
from pathlib import Path

from ..errors import UserError
from ..layers import LayerGraph, Op

OPS_SCHEMA = 1
PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_SKIP = {"name", "measured_fwd_s", "measured_bwd_s"}


def best_of(fn, repeat: int = 3) -> float:
    """The least wall time of ``repeat`` calls of ``fn`` (the usual guard against noise)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def op_signature(op: Op) -> str:
    """Stable across runs: the op's fields but its name and measurements."""
    text = repr(tuple((f.name, getattr(op, f.name)) for f in fields(op) if f.name not in _SKIP))
    return f"{op.kind}:{hashlib.sha1(text.encode()).hexdigest()[:16]}"


def ops_path_for(profile: str | Path) -> Path:
    """NAME.toml -> NAME.ops.json (same folder)."""
    path = Path(profile)
    return path.with_name(path.name[:-5] + ".ops.json" if path.name.endswith(".toml") else path.name + ".ops.json")


def write_ops_profile(path: Path, *, command: str, device: str, dtype: str, model: str, seq_len: int, tokens: int,
                      entries: dict[str, dict]) -> None:
    doc = {"schema": OPS_SCHEMA, "command": command, "device": device, "dtype": dtype, "model": model,
           "seq_len": seq_len, "tokens": tokens, "ops": entries}
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def read_ops_profile(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"cannot read: {e.strerror}", source=str(path)) from None
    except json.JSONDecodeError as e:
        raise UserError(f"not valid JSON at line {e.lineno}: {e.msg}", source=str(path)) from None
    if not isinstance(doc, dict) or doc.get("schema") != OPS_SCHEMA:
        raise UserError(f"unsupported schema {doc.get('schema') if isinstance(doc, dict) else None!r}; "
                        f"this meshplan reads schema {OPS_SCHEMA}", source=str(path), field="schema")
    ops = doc.get("ops")
    if not isinstance(ops, dict):
        raise UserError("must be a table of op signatures", source=str(path), field="ops")
    for sig, entry in ops.items():
        for key in ("fwd_s_per_token", "bwd_s_per_token"):
            value = entry.get(key) if isinstance(entry, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise UserError(f"must be a non-negative number, got {value!r}", source=str(path),
                                field=f"ops.{sig}.{key}")
    return doc


def attach_measured_ops(graph: LayerGraph, profile: str | Path, precision: str, seq_len: int) -> LayerGraph:
    """The graph with measured op times from the profile's NAME.ops.json (unchanged when there is none)."""
    path = ops_path_for(profile) if profile else None
    if path is None or not path.is_file():
        return graph
    doc = read_ops_profile(path)
    if doc.get("dtype") != PRECISION_DTYPES.get(precision) or doc.get("seq_len") != seq_len:
        note = (f"{path}: measured for {doc.get('dtype')} at sequence length {doc.get('seq_len')}, not "
                f"{PRECISION_DTYPES.get(precision)} at {seq_len}: op times are estimated, not measured")
        return replace(graph, warnings=graph.warnings + (note,))
    ops = doc["ops"]
    used = 0
    layers = []
    for layer in graph.layers:
        new_ops = []
        for op in layer.ops:
            entry = ops.get(op_signature(op))
            if entry is not None:
                used += 1
                op = replace(op, measured_fwd_s=float(entry["fwd_s_per_token"]),
                             measured_bwd_s=float(entry["bwd_s_per_token"]))
            new_ops.append(op)
        layers.append(replace(layer, ops=tuple(new_ops)))
    total = sum(len(layer.ops) for layer in graph.layers)
    note = f"{path}: measured times for {used} of {total} ops"
    return replace(graph, layers=tuple(layers), warnings=graph.warnings + (note,))
