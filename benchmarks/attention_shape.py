"""Causal attention's rate against its sequence length, from the attention kernels `meshplan profile` timed.

    python benchmarks/attention_shape.py [--kernels profiles/measured/h100-sxm5.kernels.json]

The cost model prices a FlashAttention-style kernel at one fraction of the device's peak whatever the shape
(planner/cost/compute.py ``flash_attention_s``: the profile's ``attention_efficiency``). The profile's own
timings say otherwise: on one H100 (``meshplan profile --device cuda``, causal SDPA forward and backward in
bf16) the cuDNN kernels ran 316, 387 and 480 TFLOP/s at head dim 128 and 2048, 4096 and 8192 tokens, and
torch's FlashAttention-2 175, 213 and 261: both about 1.5 times faster at 8192 than at 2048.

A mechanism that says why: such a kernel walks one row of 128-query tiles at a time over the key tiles at or
below the diagonal, s / 256 of them on average (n = s / 128 tiles a row, causal: half), and each row also pays
a fixed cost (loading its queries, the final rescale and write of its output; in backward its dQ) worth ``c``
tiles of work. The achieved rate is then

    rate(s) = r_max * (n / 2) / (n / 2 + c),      n = s / 128

This script fits r_max and c for each backend and head dimension by least squares over the timed shapes (c on
a grid, r_max in closed form) and prints the measured and fitted rates. It prints; it changes nothing: the cost
model does not use ``c`` yet (see the closing note of issue 26 for what it would move).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TILE = 128          # query rows per tile: FlashAttention-2's Br for head dims 64 and 128 on sm80/sm90 (Dao 2023,
                    # FlashAttention-2, Sec 3.3 and its kernel traits); cuDNN's sm90 kernels also tile 128 rows


def attention_rows(kernels: dict) -> list[dict]:
    """The timed causal SDPA rows (``executor/profile/kernels.py attention_backends``) of a kernels.json."""
    rows = (kernels.get("device") or {}).get("kernels", {}).get("attention") or []
    return [r for r in rows if r.get("tflops") and not r.get("error")]


def shape_factor(seq: float, c: float) -> float:
    """(n / 2) / (n / 2 + c) with n = seq / TILE: the share of a causal kernel's time spent on useful tiles."""
    half = seq / TILE / 2
    return half / (half + c)


def fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(r_max, c, rms relative residual) minimising the squared relative error over (seq, TFLOP/s) points."""
    best = None
    for step in range(0, 4001):
        c = step / 100
        f = [shape_factor(s, c) for s, _ in points]
        # relative residual (r f / y - 1): least squares in r gives r = sum(f / y) / sum((f / y)^2)
        u = [fi / y for fi, (_, y) in zip(f, points)]
        r = sum(u) / sum(x * x for x in u)
        err = (sum((r * x - 1) ** 2 for x in u) / len(u)) ** 0.5
        if best is None or err < best[2]:
            best = (r, c, err)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=Path, default=ROOT / "profiles/measured/h100-sxm5.kernels.json")
    args = parser.parse_args()
    try:
        kernels = json.loads(args.kernels.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"attention_shape: cannot read {args.kernels}: {e}", file=sys.stderr)
        return 2
    rows = attention_rows(kernels)
    if not rows:
        print(f"attention_shape: {args.kernels} holds no timed attention rows (meshplan profile --device cuda "
              "writes them)", file=sys.stderr)
        return 2
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        if r["backend"] in ("math", "efficient"):
            continue            # not FlashAttention-style kernels: they do not tile the queries this way
        groups.setdefault((r["backend"], r["head_dim"]), []).append(r)
    print(f"{args.kernels.relative_to(ROOT) if args.kernels.is_relative_to(ROOT) else args.kernels}: causal "
          f"SDPA, forward + backward, {rows[0].get('dtype', '?')}")
    print(f"{'backend':<8} {'hd':>3} {'b':>2} {'h':>3} {'kv':>3} {'seq':>5}  {'TFLOP/s':>7}  {'fitted':>7}  {'err':>6}")
    for (backend, hd), group in sorted(groups.items()):
        points = sorted((r["seq"], r["tflops"]) for r in group)
        if len({s for s, _ in points}) < 2:
            continue            # one length: nothing to fit
        r_max, c, rms = fit(points)
        for r in sorted(group, key=lambda r: (r["seq"], r["batch"])):
            y = r_max * shape_factor(r["seq"], c)
            print(f"{backend:<8} {hd:>3} {r['batch']:>2} {r['heads']:>3} {r['kv_heads']:>3} {r['seq']:>5}  "
                  f"{r['tflops']:>7.0f}  {y:>7.0f}  {100 * (y / r['tflops'] - 1):>+5.1f}%")
        ratio = shape_factor(8192, c) / shape_factor(4096, c)
        print(f"  {backend} hd {hd}: r_max {r_max:.0f} TFLOP/s, c = {c:.1f} tiles a row, rms {100 * rms:.1f}%; "
              f"the rate at 8192 tokens over 4096: {ratio:.2f}, at 2048 over 4096: "
              f"{shape_factor(2048, c) / shape_factor(4096, c):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
