"""Causal attention's rate against its sequence length: the cuDNN kernels of real training steps on one H100.

    python benchmarks/attention_shape.py [--runs benchmarks/results/gpu_runs.json ...] [--profile h100-80g]
                                         [--kernels K.kernels.json]

A FlashAttention-style kernel walks one row of 128-query tiles at a time over the key tiles a query meets (causal:
s / 2 keys on average, t = s / 256 tiles), and each row also pays a fixed cost (its queries loaded, its output
rescaled and written, in backward its dQ) worth ``c`` tiles of work. The rate is then

    rate(s) = r * t / (t + c)

and r, the rate on long sequences, a fraction of the dense peak. The script fits it two ways:

- one r for each head dimension (c shared): least squared relative error, r in closed form;
- the mechanism the cost model prices (planner/cost/compute.py ``fused_attention_s``): per score element the
  kernel's matmuls at one rate on the head dimension padded to a multiple of 64, plus one exponential forward and
  one backward at the profile's special-function rate (``sfu_Tops``), stretched by (t + c) / t; the matmul rate and
  c on grids. Then what attention dropout adds a score element, forward and backward, over the runs with dropout
  against that mechanism without it.

The profile's ``fused_attention_*`` fields (h100-80g.toml, h200.toml; b200.toml and gb200-nvl72.toml assume the
H100's) are the mechanism's numbers; Megatron-LM and meshplan's executor are priced with them on Hopper and Blackwell, where TransformerEngine and torch 2.13's SDPA run cuDNN's fused
kernel (planner/runtimes.py ``attention_kernel``; docs/cost-model.md, FP8 recipes, says what it did to the published
runs).

The evidence: the kernel traces of meshplan's executor on one H100 SXM (``python benchmarks/gpu_validate.py
--measure``: benchmarks/results/gpu_runs.json, gpu_holdout_runs.json), whose attention ran cuDNN's sm90 flash
kernels (``cudnn_generated_fort_native_sdpa_sm90_flash_fprop`` / ``bprop``): each row's forward and backward
kernel time over the calls it counts, against the causal FLOPs of one call (4 b h s^2 d / 2, backward 2.5x).
Rows with attention dropout are left out of both fits and give the dropout cost.

``--kernels`` also prints the SDPA calls ``meshplan profile`` timed one at a time (executor/profile/kernels.py
``attention_backends``), which are not used: their forwards agree with the training steps', but their backwards
at 2048 tokens run a third slower than the same kernels inside a step (281 against 427-432 TFLOP/s at head dim
128), so a fit over them finds a fixed cost twice as large.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from planner.cost.compute import attention_row_share, fused_attention_score_s  # noqa: E402
RUNS = ("benchmarks/results/gpu_runs.json", "benchmarks/results/gpu_holdout_runs.json")
ROW_TILES = tuple(x / 10 for x in range(0, 401))      # the grid of c


def _config(mc: dict) -> tuple[int, int, float]:
    """(heads, head dim, attention dropout) of a Hugging Face config.json (GPT-2 or Llama-style names)."""
    heads = mc.get("n_head", mc.get("num_attention_heads"))
    hidden = mc.get("n_embd", mc.get("hidden_size"))
    head_dim = mc.get("head_dim") or hidden // heads
    return heads, head_dim, float(mc.get("attn_pdrop", mc.get("attention_dropout", 0.0)) or 0.0)


def traced_calls(paths) -> list[dict]:
    """One entry per training run whose trace holds cuDNN's forward and backward flash kernels: its shape, its
    attention dropout, the score elements of one call and its forward and backward kernel seconds per call."""
    out = []
    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            heads, d, dropout = _config(r["model_config"])
            kernels = (r.get("kernels") or {}).get("kernels") or []
            fwd = [k for k in kernels if "sdpa" in k["name"] and "fprop" in k["name"]]
            bwd = [k for k in kernels if "sdpa" in k["name"] and "bprop" in k["name"]]
            if not fwd or not bwd:
                continue
            b, s = r["micro_batch"], r["seq_len"]
            out.append({"name": r["name"], "batch": b, "heads": heads, "seq": s, "head_dim": d, "dropout": dropout,
                        "elements": b * heads * s * s / 2,
                        "fwd_s": sum(k["s"] for k in fwd) / sum(k["count"] for k in fwd),
                        "bwd_s": sum(k["s"] for k in bwd) / sum(k["count"] for k in bwd)})
    return out


def trace_points(paths) -> list[dict]:
    """The runs without attention dropout, each with the forward, backward and combined (3.5 x forward FLOPs over
    both) rates of one call in TFLOP/s."""
    out = []
    for c in traced_calls(paths):
        if c["dropout"]:
            continue
        flops = 4.0 * c["elements"] * c["head_dim"]
        out.append({**c, "fwd": flops / c["fwd_s"] / 1e12, "bwd": 2.5 * flops / c["bwd_s"] / 1e12,
                    "both": 3.5 * flops / (c["fwd_s"] + c["bwd_s"]) / 1e12})
    return out


def fit(groups: dict[int, list[tuple[float, float]]]) -> tuple[float, dict[int, float], float]:
    """(c, {group: r}, rms relative residual) of r * attention_row_share(keys, c) through each group's (keys per
    query, rate) points, c shared by the groups (head dimensions), r each its own: with u = f / y the relative
    residual r u - 1 is least at r = sum(u) / sum(u^2)."""
    best = None
    for c in ROW_TILES:
        rates, sq, n = {}, 0.0, 0
        for key, points in groups.items():
            u = [attention_row_share(keys, c) / y for keys, y in points]
            rates[key] = sum(u) / sum(x * x for x in u)
            sq += sum((rates[key] * x - 1) ** 2 for x in u)
            n += len(u)
        rms = math.sqrt(sq / n)
        if best is None or rms < best[2] - 1e-12:
            best = (c, rates, rms)
    return best


def mechanism_rate(point: dict, matmul_rate: float, row_tiles: float, sfu_rate: float) -> float:
    """TFLOP/s (forward + backward, causal FLOPs, backward 2.5x) the mechanism gives a run of ``point``'s shape."""
    f, b = fused_attention_score_s(point["head_dim"], point["seq"] / 2, matmul_rate, sfu_rate, row_tiles)
    return 14.0 * point["head_dim"] / (f + b) / 1e12


def fit_mechanism(points: list[dict], sfu_rate: float) -> tuple[float, float, float]:
    """(matmul rate, c, rms relative residual) of ``mechanism_rate`` through every run, whatever its head dimension:
    c on ROW_TILES, the matmul rate on a grid of 1 TFLOP/s."""
    best = None
    for c in ROW_TILES:
        for tf in range(200, 2001):
            res = [mechanism_rate(p, tf * 1e12, c, sfu_rate) / p["both"] - 1 for p in points]
            rms = math.sqrt(sum(r * r for r in res) / len(res))
            if best is None or rms < best[2] - 1e-12:
                best = (tf * 1e12, c, rms)
    return best


def dropout_cost(points: list[dict], matmul_rate: float, row_tiles: float, sfu_rate: float) -> tuple[float, float]:
    """(forward, backward) seconds per score element that attention dropout adds to the ``traced_calls`` with it (the
    kernel draws a random number per element, and backward draws it again to rebuild the mask): each run's kernel
    time over what the mechanism prices without dropout, pooled over the runs' elements (least squares through the
    origin, weighted as the elements are)."""
    extra_f = extra_b = elements = 0.0
    for p in points:
        f, b = fused_attention_score_s(p["head_dim"], p["seq"] / 2, matmul_rate, sfu_rate, row_tiles)
        extra_f += p["fwd_s"] - p["elements"] * f
        extra_b += p["bwd_s"] - p["elements"] * b
        elements += p["elements"]
    return extra_f / elements, extra_b / elements


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=[str(ROOT / p) for p in RUNS])
    parser.add_argument("--kernels", type=Path, help="also print a kernels.json's one-call SDPA timings")
    parser.add_argument("--profile", default="h100-80g",
                        help="the cluster profile whose dense bf16 peak and special-function rate (sfu_Tops) the fits use "
                             "(default h100-80g; h200 for the H200's runs)")
    args = parser.parse_args()
    from planner.cluster import load_cluster
    from planner.errors import UserError
    try:
        device = load_cluster(args.profile, 1).device
    except UserError as e:
        print(f"attention_shape: {e}", file=sys.stderr)
        return 2
    peak, sfu = device.peak("bf16") / 1e12, device.sfu_ops_per_s
    if not sfu:
        print(f"attention_shape: profile {args.profile} has no [gpu] sfu_Tops", file=sys.stderr)
        return 2
    try:
        points = trace_points(args.runs)
    except (OSError, json.JSONDecodeError, KeyError) as e:
        print(f"attention_shape: cannot read the runs: {e}", file=sys.stderr)
        return 2
    if len({p["seq"] for p in points}) < 2:
        print("attention_shape: the runs hold cuDNN attention kernels at fewer than two lengths", file=sys.stderr)
        return 2
    groups: dict[int, list[tuple[float, float]]] = {}
    for p in points:
        groups.setdefault(p["head_dim"], []).append((p["seq"] / 2, p["both"]))
    c, rates, rms = fit(groups)
    print("cuDNN flash kernels in training steps (TFLOP/s of one call; causal FLOPs, backward 2.5x):")
    print(f"{'run':<28} {'b':>2} {'h':>3} {'d':>4} {'seq':>5}  {'fwd':>5} {'bwd':>5} {'both':>5}  {'fitted':>6}  err")
    for p in sorted(points, key=lambda p: (p["seq"], p["head_dim"], p["name"])):
        y = rates[p["head_dim"]] * attention_row_share(p["seq"] / 2, c)
        print(f"{p['name']:<28} {p['batch']:>2} {p['heads']:>3} {p['head_dim']:>4} {p['seq']:>5}  {p['fwd']:>5.0f} "
              f"{p['bwd']:>5.0f} {p['both']:>5.0f}  {y:>6.0f}  {100 * (y / p['both'] - 1):+5.1f}%")
    print(f"fit: c = {c:.1f} tiles a row (rms {100 * rms:.1f}% over {len(points)} runs); at 2048 tokens "
          f"{attention_row_share(1024, c):.2f} of r, at 4096 {attention_row_share(2048, c):.2f}, at 8192 "
          f"{attention_row_share(4096, c):.2f}")
    for d, r in sorted(rates.items()):
        print(f"  head dim {d:>3}: r = {r:.0f} TFLOP/s = {r / peak:.3f} of the dense peak "
              f"({len(groups[d])} runs)")
    matmul, c2, rms2 = fit_mechanism(points, sfu)
    print(f"\nthe mechanism (one rate for the matmuls of every head dimension, one exponential per score element forward "
          f"and backward at the SFUs' {sfu / 1e12:.2f} T/s):")
    for p in sorted(points, key=lambda p: (p["seq"], p["head_dim"], p["name"])):
        y = mechanism_rate(p, matmul, c2, sfu)
        print(f"  {p['name']:<28} d{p['head_dim']:<4} s{p['seq']:<5} {p['both']:>5.0f}  {y:>5.0f}  "
              f"{100 * (y / p['both'] - 1):+5.1f}%")
    print(f"fit: matmuls at {matmul / 1e12:.0f} TFLOP/s = {matmul / 1e12 / peak:.3f} of the dense peak, "
          f"c = {c2:.1f} tiles a row (rms {100 * rms2:.1f}% over {len(points)} runs)")
    dropped = [call for call in traced_calls(args.runs) if call["dropout"]]
    if dropped:
        e_f, e_b = dropout_cost(dropped, matmul, c2, sfu)
        print(f"attention dropout adds {e_f * 1e12:.2f} ps forward and {e_b * 1e12:.2f} ps backward a score element "
              f"({len(dropped)} runs: " + ", ".join(
                  f"{p['name']} {p['fwd_s'] * 1e3:.3f} + {p['bwd_s'] * 1e3:.3f} ms a call" for p in dropped) + ")")
    if args.kernels:
        rows = json.loads(args.kernels.read_text()).get("device", {}).get("kernels", {}).get("attention") or []
        print(f"\none call at a time ({args.kernels.name}; not fitted):")
        for row in rows:
            if row.get("backend") in ("cudnn", "flash") and "fwd_s" in row and "fwd_bwd_s" in row:
                f = row["flops_fwd"]
                print(f"  {row['backend']:<6} b{row['batch']} h{row['heads']}/{row['kv_heads']} d{row['head_dim']} "
                      f"s{row['seq']}: fwd {f / row['fwd_s'] / 1e12:.0f}, bwd "
                      f"{2.5 * f / (row['fwd_bwd_s'] - row['fwd_s']) / 1e12:.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
