"""Count the elementwise traffic of the executor's reference models as torch runs them eagerly.

    python -m executor.eager_counts            # print the table planner/eager_table.py holds
    python -m executor.eager_counts --check    # exit 1 if the table differs from a fresh count

Everything in a step that is neither a matrix multiply nor the attention kernel (norms,
activations, RoPE, residual adds, dtype casts, dropout, bias-gradient sums, the loss) is
memory-bound: its time is the bytes it moves over the memory bandwidth (the roofline,
Williams et al. 2009). How many bytes depends on how the runtime runs the model, not on the
model alone: under autocast the residual stream stays fp32 and every linear casts its input
(torch.amp's op lists); torch launches one kernel per operator (no fusion). This module
traces one training step of ``executor.models`` (planner.trace.capture: every aten operator
with the bytes it reads and writes) and sums those bytes per token, for three regimes:

- ``autocast``: fp32 parameters, ``torch.autocast`` bf16 (ZeRO-0/1 without FSDP on a GPU);
- ``bf16``: parameters cast to bf16 by FSDP2's MixedPrecisionPolicy, no autocast (ZeRO-2/3,
  and ZeRO-0 under TP/PP through ``replicate``);
- ``fp32``: everything fp32 (the CPU).

The trace runs on the CPU, so two CUDA kernels are substituted by what they move on a GPU
(in the ``autocast`` and ``bf16`` regimes): RMSNorm, which torch 2.13 decomposes on the CPU but
runs as one fused kernel on CUDA (``aten._fused_rms_norm``: read x, write y and rstd; backward
read dy, x, rstd, write dx, then a gamma-gradient pass reading dy and x), and LayerNorm's
backward, which CUDA splits into an input-gradient kernel and a gamma/beta kernel that reads
dy and x again (the kernels named in benchmarks/results/gpu_runs.json). The attention core
runs without dropout in the trace (on a GPU the fused kernel applies dropout inside).

Per token the bytes of a block are linear in its widths (h, q, kv, f): each operator streams
tensors of one of those widths. The coefficients are solved exactly from traces at several
widths and written, with the kernel counts, to planner/eager_table.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from planner.eager_bytes import FUSED_RMS_NORM, fused_rms_norm_bytes

ATTENTION_OPS = ("_scaled_dot_product", "flash_attention")
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
# (hidden, heads, kv heads, head dim, ffn): widths that make the linear system well determined
WIDTHS = ((64, 4, 4, 16, 256), (96, 4, 2, 16, 160), (128, 4, 2, 48, 384), (80, 10, 5, 8, 224),
          (112, 8, 1, 16, 288), (144, 6, 3, 12, 336))
TABLE = Path(__file__).resolve().parent.parent / "planner" / "eager_table.py"
REGIMES = ("autocast", "bf16", "fp32")


def _spec(base: dict, h: int, heads: int, kv: int, hd: int, f: int, vocab: int = 512, seq: int = 32):
    from planner.model import ModelSpec
    return ModelSpec(name="count", num_layers=1, hidden=h, num_heads=heads, num_kv_heads=kv, head_dim=hd,
                     ffn_hidden=f, vocab_size=vocab, seq_len=seq, max_positions=seq if base["learned"] else 0,
                     mlp=base["mlp"], norm=base["norm"], linear_bias=base["bias"], qkv_bias=base["qkv_bias"],
                     tied_embeddings=False, dropout=base["dropout"])


def _trace(spec, regime: str, batch: int):
    """The capture of one training step of the executor's model of ``spec`` in ``regime``."""
    from planner.trace.capture import capture

    from . import models
    model = models.build_model(spec, device="meta")
    if regime == "bf16":
        model = model.to(torch.bfloat16)
    ids = torch.zeros(batch, spec.seq_len, dtype=torch.long)

    def loss_fn(out, inputs):
        return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), inputs[0][0].flatten(),
                                                 reduction="sum")

    def no_dropout_core(q, k, v, dropout_p):      # a GPU's fused kernel drops inside the kernel
        return models.sdpa(q, k, v, 0.0)
    for block in model.layers.values():
        block.attn.core = no_dropout_core
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast")
    with autocast:
        return capture(model, (ids,), loss_fn=loss_fn, device="cpu")


def _bytes(r) -> int:
    return r.bytes_read + r.bytes_written


CLASSES = ("stream", "cast_up", "cast_down", "strided", "reduce", "softmax", "norm")
_STRIDED = {"clone", "contiguous", "stack", "cat", "slice_backward", "select_backward", "index", "index_put",
            "gather", "scatter", "scatter_add", "embedding", "embedding_dense_backward", "index_select",
            "_unsafe_index", "index_add", "new_zeros_like"}
_REDUCE = {"sum", "mean", "amax", "amin", "var", "norm", "linalg_vector_norm"}
_SOFTMAX = {"_log_softmax", "_log_softmax_backward_data", "_softmax", "_softmax_backward_data",
            "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward"}


def kernel_class(r) -> str:
    """The bandwidth class of an elementwise record (executor/profile/kernels.py eager_kernels measures each):
    dtype casts up and down, strided copies and gathers (and products over a strided half, as
    RoPE's), reductions, the loss's softmax, and plain streaming kernels."""
    if r.name in ("_to_copy", "copy_", "copy", "to") and r.inputs and r.outputs:
        ins, out = r.inputs[0].itemsize, r.outputs[0].itemsize
        return "cast_up" if out > ins else "cast_down" if out < ins else "strided"
    if r.name in _STRIDED:
        return "strided"
    if r.name in _REDUCE:
        return "reduce"
    if r.name in _SOFTMAX:
        return "softmax"
    out_bytes = sum(o.addressed_bytes for o in r.outputs)
    if any(0 < t.addressed_bytes * 2 <= t.storage_bytes and t.addressed_bytes * 4 >= out_bytes for t in r.inputs):
        return "strided"
    return "stream"


def _norm_bytes(records, h: int, regime: str, kind: str, tokens: int) -> dict[str, float]:
    """The bytes a GPU moves for one norm module's records (see the module docstring)."""
    fwd = [r for r in records if r.phase == "fwd"]
    bwd = [r for r in records if r.phase == "bwd"]
    if regime == "fp32" or (kind == "layernorm" and not bwd):
        return {"fwd": sum(map(_bytes, fwd)), "bwd": sum(map(_bytes, bwd))}
    e = 4 if regime == "autocast" else 2          # autocast runs norms in fp32 (torch.amp fp32 list)
    if kind == "rmsnorm":
        fwd_b, bwd_b = fused_rms_norm_bytes(h, 1, e)
        return {"fwd": tokens * fwd_b, "bwd": tokens * bwd_b}
    # LayerNorm: the input-gradient kernel is what the trace saw; the gamma/beta kernel reads dy and x
    return {"fwd": sum(map(_bytes, fwd)), "bwd": sum(map(_bytes, bwd)) + tokens * 2 * e * h}


def count(spec, regime: str, batch: int) -> dict[str, dict]:
    """{part: {"fwd": {class: bytes}, "bwd": {...}, "fwd_kernels", "bwd_kernels"}} for parts block,
    embed, head (final norm, LM head, loss); bytes summed over the step (not per token), elementwise
    operators only, by bandwidth class (``kernel_class``; norms are "norm")."""
    cap = _trace(spec, regime, batch)
    tokens = batch * spec.seq_len
    out = {part: {"fwd": dict.fromkeys(CLASSES, 0.0), "bwd": dict.fromkeys(CLASSES, 0.0), "fwd_kernels": 0,
                  "bwd_kernels": 0, "fwd_ops": 0, "bwd_ops": 0} for part in ("block", "embed", "head")}
    norms: dict[str, list] = {}
    for r in cap.records:
        part = "block" if r.module.startswith("layers.") else "embed" if r.module.startswith("embed") else "head"
        out[part][f"{r.phase}_ops"] += 1       # every operator the dispatcher runs, views and GEMMs included
        if r.view or r.name in MATMUL_OPS or any(a in r.name for a in ATTENTION_OPS):
            continue
        out[part][f"{r.phase}_kernels"] += 1
        if r.module.endswith("norm"):
            norms.setdefault(r.module, []).append(r)
            continue
        out[part][r.phase][kernel_class(r)] += _bytes(r)
    for module, records in norms.items():
        part = "block" if module.startswith("layers.") else "head"
        b = _norm_bytes(records, spec.hidden, regime, spec.norm, tokens)
        out[part]["fwd"]["norm"] += b["fwd"]
        out[part]["bwd"]["norm"] += b["bwd"]
        if regime != "fp32" and spec.norm == "rmsnorm":       # CUDA's fused kernels and operators (FUSED_RMS_NORM)
            for phase in ("fwd", "bwd"):                       # where the CPU decomposes it
                seen = sum(r.phase == phase for r in records)
                out[part][f"{phase}_kernels"] += FUSED_RMS_NORM[f"{phase}_kernels"] - seen
                out[part][f"{phase}_ops"] += FUSED_RMS_NORM[f"{phase}_ops"] - seen
    return out


FAMILIES = {   # the feature combinations of the reference models (planner.cost.eager.feature_key)
    "layernorm-gelu-bias-learned": dict(norm="layernorm", mlp="gelu", bias=True, qkv_bias=False, dropout=False,
                                        learned=True),
    "layernorm-gelu-bias-learned-dropout": dict(norm="layernorm", mlp="gelu", bias=True, qkv_bias=False,
                                                dropout=True, learned=True),
    "rmsnorm-swiglu-rope": dict(norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=False, dropout=False,
                                learned=False),
    "rmsnorm-swiglu-rope-qkvbias": dict(norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True, dropout=False,
                                        learned=False),
}


def _solve(rows: list[tuple[list[float], float]]) -> list[float]:
    """Least squares (exact here: the system is consistent) of coefficients of (h, q, kv, f, 1)."""
    import numpy as np
    a = np.array([r[0] for r in rows], dtype=float)
    b = np.array([r[1] for r in rows], dtype=float)
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    return [round(float(c), 3) + 0.0 for c in coef]      # + 0.0: a -0.0 that rounding leaves is written 0.0


def table(families: list[str] | None = None) -> dict:
    """{family: {regime: {"block_fwd": [c_h, c_q, c_kv, c_f, c_1], "block_bwd": ..., "head_fwd":
    [c_h, c_v], ..., "kernels": {...}, "param_bytes": ...}}}: bytes per token (and per parameter
    for what does not scale with tokens), from traces at batch 1 and 2 (their difference is per token)."""
    out = {}
    for family, base in FAMILIES.items():
        if families and family not in families:
            continue
        out[family] = {}
        for regime in REGIMES:
            keys = [f"{part}_{phase}" for part in ("block", "head", "embed") for phase in ("fwd", "bwd")]
            rows = {k: {c: [] for c in CLASSES} for k in keys}
            kernels = {}
            for h, heads, kvh, hd, f in WIDTHS:
                spec = _spec(base, h, heads, kvh, hd, f)
                one, two = count(spec, regime, 1), count(spec, regime, 2)
                tokens = spec.seq_len
                x = [h, heads * hd, kvh * hd, f, 1.0]
                for part in ("block", "head", "embed"):
                    for phase in ("fwd", "bwd"):
                        for c in CLASSES:
                            per_token = (two[part][phase][c] - one[part][phase][c]) / tokens
                            rows[f"{part}_{phase}"][c].append(
                                (x if part == "block" else [h, spec.vocab_size, 1.0], per_token))
                kernels = {f"{part}_{phase}": one[part][f"{phase}_kernels"] for part in ("block", "head", "embed")
                           for phase in ("fwd", "bwd")}
                ops = {f"{part}_{phase}": one[part][f"{phase}_ops"] for part in ("block", "head", "embed")
                       for phase in ("fwd", "bwd")}
            solved = {k: {c: _solve(v) for c, v in by_class.items()} for k, by_class in rows.items()}
            out[family][regime] = {k: {c: coef for c, coef in by_class.items() if any(abs(x) > 1e-9 for x in coef)}
                                   for k, by_class in solved.items()}
            out[family][regime]["kernels"] = kernels
            out[family][regime]["ops"] = ops
    return out


def render(data: dict) -> str:
    return ('"""Elementwise bytes per token of the executor\'s reference models, as torch runs them eagerly.\n\n'
            "Written by `python -m executor.eager_counts --write` (which says how they are counted); checked\n"
            "by tests/test_eager_counts.py. Do not edit by hand. Per bandwidth class (executor.eager_counts.\n"
            "kernel_class), block coefficients multiply (h, q, kv, f, 1), head and embedding coefficients\n"
            "(h, vocab, 1); kernels (elementwise) and ops (every dispatched operator, views and GEMMs included)\n"
            "are per micro-batch.\n"
            '"""\n\nTABLE = ' + _compact(data) + "\n")


def _compact(data: dict) -> str:
    """The table as Python, one line per (family, regime, part)."""
    lines = ["{"]
    for family in sorted(data):
        lines.append(f"    {json.dumps(family)}: {{")
        for regime in sorted(data[family]):
            lines.append(f"        {json.dumps(regime)}: {{")
            for key in sorted(data[family][regime]):
                lines.append(f"            {json.dumps(key)}: {json.dumps(data[family][regime][key], sort_keys=True)},")
            lines.append("        },")
        lines.append("    },")
    return "\n".join(lines + ["}"])




def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m executor.eager_counts", description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"write {TABLE}")
    p.add_argument("--check", action="store_true", help="exit 1 if the committed table differs")
    p.add_argument("--family", action="append", choices=sorted(FAMILIES),
                   help="with --check: count and compare only these families (repeatable; default: all)")
    args = p.parse_args(argv)
    if args.family and not args.check:
        p.error("--family goes with --check (--write and the printed table always hold every family)")
    fresh = table(args.family)
    if args.write:
        TABLE.write_text(render(fresh))
        print(f"wrote {TABLE}")
    elif args.check:
        if not TABLE.is_file():
            same = False
        elif args.family:       # the committed families, as data, against their fresh count
            committed = _committed()
            same = all(committed.get(family) == json.loads(json.dumps(fresh[family])) for family in fresh)
        else:
            same = TABLE.read_text() == render(fresh)
        print("the table is current" if same else f"{TABLE} differs from a fresh count")
        return 0 if same else 1
    else:
        sys.stdout.write(render(fresh))
    return 0


def _committed() -> dict:
    """The committed table, read as data."""
    namespace: dict = {}
    exec(compile(TABLE.read_text(), str(TABLE), "exec"), namespace)
    return namespace["TABLE"]


if __name__ == "__main__":
    sys.exit(main())
