"""Causal attention's rate against its sequence length: the cuDNN kernels of real training steps on one H100.

    python benchmarks/attention_shape.py [--runs benchmarks/results/gpu_runs.json ...] [--kernels K.kernels.json]

A FlashAttention-style kernel walks one row of 128-query tiles at a time over the key tiles a query meets (causal:
s / 2 keys on average, t = s / 256 tiles), and each row also pays a fixed cost (its queries loaded, its output
rescaled and written, in backward its dQ) worth ``c`` tiles of work. The rate is then

    rate(s) = r * t / (t + c)

and r, the rate on long sequences, a fraction of the dense peak. The cost model prices attention at one fraction
of the peak whatever the length (planner/cost/compute.py ``flash_attention_s``, the profile's
``attention_efficiency``: FlashAttention-2's 0.30 on H100), for every runtime; TransformerEngine, which
Megatron-LM runs, calls cuDNN's kernels on Hopper instead. docs/cost-model.md (FP8 recipes) says what pricing
Megatron-LM's attention with the r and c fitted here does to the published runs, and why it is not done yet.

The evidence: the kernel traces of meshplan's executor on one H100 SXM (``python benchmarks/gpu_validate.py
--measure``: benchmarks/results/gpu_runs.json, gpu_holdout_runs.json), whose attention ran cuDNN's sm90 flash
kernels (``cudnn_generated_fort_native_sdpa_sm90_flash_fprop`` / ``bprop``): each row's forward and backward
kernel time over the calls it counts, against the causal FLOPs of one call (4 b h s^2 d / 2, backward 2.5x).
Rows with attention dropout are left out (their kernels draw random numbers besides). The script fits r and c
(least squared relative error: c on a grid and shared, r in closed form for each head dimension: the profile's
rate is the head dimension 128 one, the published models') over the forward + backward rate of each row and
prints measured against fitted.

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
QUERY_TILE = 128        # query rows per tile: FlashAttention-2's Br for head dims 64 and 128 (Dao 2023, FlashAttention-2,
                        # Sec 3.3); cuDNN's sm90 flash kernels also tile 128 query rows (their names: 64x128x..., 4 warps)
RUNS = ("benchmarks/results/gpu_runs.json", "benchmarks/results/gpu_holdout_runs.json")
ROW_TILES = tuple(x / 10 for x in range(0, 401))      # the grid of c


def attention_shape_factor(keys_per_query: float, row_tiles: float) -> float:
    """t / (t + c): the share of the kernel's time on useful tiles, t = ``keys_per_query`` / QUERY_TILE key tiles a row
    of query tiles walks, c = ``row_tiles`` the fixed cost of the row."""
    t = keys_per_query / QUERY_TILE
    return t / (t + row_tiles) if row_tiles > 0 else 1.0


def _config(mc: dict) -> tuple[int, int, float]:
    """(heads, head dim, attention dropout) of a Hugging Face config.json (GPT-2 or Llama-style names)."""
    heads = mc.get("n_head", mc.get("num_attention_heads"))
    hidden = mc.get("n_embd", mc.get("hidden_size"))
    head_dim = mc.get("head_dim") or hidden // heads
    return heads, head_dim, float(mc.get("attn_pdrop", mc.get("attention_dropout", 0.0)) or 0.0)


def trace_points(paths) -> list[dict]:
    """One point per training run whose trace holds cuDNN's forward and backward flash kernels: its shape, and the
    forward, backward and combined (3.5 x forward FLOPs over both) rates of one call."""
    out = []
    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            heads, d, dropout = _config(r["model_config"])
            kernels = (r.get("kernels") or {}).get("kernels") or []
            fwd = [k for k in kernels if "sdpa" in k["name"] and "fprop" in k["name"]]
            bwd = [k for k in kernels if "sdpa" in k["name"] and "bprop" in k["name"]]
            if dropout or not fwd or not bwd:
                continue
            b, s = r["micro_batch"], r["seq_len"]
            flops = 4.0 * b * heads * s * s * d / 2
            f_s = sum(k["s"] for k in fwd) / sum(k["count"] for k in fwd)
            b_s = sum(k["s"] for k in bwd) / sum(k["count"] for k in bwd)
            out.append({"name": r["name"], "batch": b, "heads": heads, "seq": s, "head_dim": d,
                        "fwd": flops / f_s / 1e12, "bwd": 2.5 * flops / b_s / 1e12,
                        "both": 3.5 * flops / (f_s + b_s) / 1e12})
    return out


def fit(groups: dict[int, list[tuple[float, float]]]) -> tuple[float, dict[int, float], float]:
    """(c, {group: r}, rms relative residual) of r * attention_shape_factor(keys, c) through each group's (keys per
    query, rate) points, c shared by the groups (head dimensions), r each its own: with u = f / y the relative
    residual r u - 1 is least at r = sum(u) / sum(u^2)."""
    best = None
    for c in ROW_TILES:
        rates, sq, n = {}, 0.0, 0
        for key, points in groups.items():
            u = [attention_shape_factor(keys, c) / y for keys, y in points]
            rates[key] = sum(u) / sum(x * x for x in u)
            sq += sum((rates[key] * x - 1) ** 2 for x in u)
            n += len(u)
        rms = math.sqrt(sq / n)
        if best is None or rms < best[2] - 1e-12:
            best = (c, rates, rms)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=[str(ROOT / p) for p in RUNS])
    parser.add_argument("--kernels", type=Path, help="also print a kernels.json's one-call SDPA timings")
    parser.add_argument("--peak", type=float, default=989.4, help="dense bf16 TFLOP/s (default H100 SXM's)")
    args = parser.parse_args()
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
        y = rates[p["head_dim"]] * attention_shape_factor(p["seq"] / 2, c)
        print(f"{p['name']:<28} {p['batch']:>2} {p['heads']:>3} {p['head_dim']:>4} {p['seq']:>5}  {p['fwd']:>5.0f} "
              f"{p['bwd']:>5.0f} {p['both']:>5.0f}  {y:>6.0f}  {100 * (y / p['both'] - 1):+5.1f}%")
    print(f"fit: c = {c:.1f} tiles a row (rms {100 * rms:.1f}% over {len(points)} runs); at 2048 tokens "
          f"{attention_shape_factor(1024, c):.2f} of r, at 4096 {attention_shape_factor(2048, c):.2f}, at 8192 "
          f"{attention_shape_factor(4096, c):.2f}")
    for d, r in sorted(rates.items()):
        print(f"  head dim {d:>3}: r = {r:.0f} TFLOP/s = {r / args.peak:.3f} of the dense peak "
              f"({len(groups[d])} runs)")
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
