"""The rate of FP8 rowwise scaling's strided reductions on an H100, from round 3's measured trace.

    python benchmarks/fp8_strided_rate.py [--cluster h100-80g] [--raw benchmarks/results/gpu_round3_fp8_runs.json]

torchao's rowwise recipe scales the operands of the backward GEMMs along the other dimension: the weight
gradient takes the input and the output gradient transposed, one scale per column of a (tokens, features)
tensor, and the input gradient takes the weight transposed. Compiled, inductor fuses each such scaling into one
kernel that reduces along the tensor's strided dimension (the amax over the tokens) and writes the cast; on one
H100 (round 3, docs/validation.md) the slowest of them ran 640 us a call, far below the contiguous reduction
rate of the profile's ``reduce`` class. planner/precision.py names those bytes (``Recipe.amax_strided``) and the
cost model prices them at the profile's ``[gpu.kernels] strided_reduce_GBps``.

This script measures that rate from the one trace that has it: on the same H100, the same plan (Llama 3.2 3B,
one micro-batch of 4096 tokens, compiled) ran with tensorwise and with rowwise FP8 linears at the same GEMM time;
the rowwise casts' kernels (the trace's "other" kind) took ``delta`` seconds more. The cost model, asked for both
plans with the strided bytes at two trial rates, gives how many strided bytes rowwise reads (its step time is
linear in 1 / rate) and what else it already charges rowwise over tensorwise; the rate is the one at which the
two differences agree. It prints the rate and the check: the predicted rowwise-over-tensorwise step difference
at that rate against the measured one.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner import api  # noqa: E402
from planner.search import search  # noqa: E402

RAW = ROOT / "benchmarks" / "results" / "gpu_round3_fp8_runs.json"
RECIPES = ("fp8-tensorwise", "fp8-rowwise")


def measured_rows(raw: dict) -> dict[str, dict]:
    """The trace's tensorwise and rowwise rows, by recipe (the ones whose flags name it)."""
    out = {}
    for row in raw["rows"]:
        flags = row.get("plan_flags", [])
        for recipe in RECIPES:
            if recipe in flags:
                out[recipe] = row
    missing = [r for r in RECIPES if r not in out]
    if missing:
        raise SystemExit(f"{RAW.name}: no measured row for {', '.join(missing)}")
    return out


def other_kernels_s(row: dict) -> float:
    """GPU seconds of the run's kernels that are neither GEMMs, attention nor the optimizer (gpu_validate.py
    kernel_kind): the casts, norms and activations."""
    return row["kernels"]["by_kind"]["other"]["s"]


def step_s(row: dict, recipe: str, cluster: str, rate: float) -> float:
    """The planner's step time of ``row``'s plan under ``recipe`` with the strided reductions at ``rate`` B/s."""
    with tempfile.TemporaryDirectory(prefix="meshplan-strided-") as tmp:
        config = Path(tmp) / "model.json"
        config.write_text(json.dumps(row["model_config"]))
        job = api.load_job(str(config), cluster=cluster, gpus=1, global_batch=row["micro_batch"]
                           * row["num_microbatches"], seq_len=row["seq_len"], precision=recipe, compile=True)
    cl = replace(job.cluster, device=replace(job.cluster.device, strided_reduce_bytes_per_s=rate))
    knobs = api.Knobs(dp=1, tp=1, pp=1, cp=1, zero=row["zero"], micro_batch=row["micro_batch"],
                      recompute=row["recompute"], optimizer_offload=False)
    result = search(job.graph, cl, job.workload, knobs, top_k=1, solver="uniform")
    return result.best.estimate.step_time_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="h100-80g", help="the profile whose other rates price the casts")
    parser.add_argument("--raw", default=str(RAW), help="round 3's measured runs")
    args = parser.parse_args()
    rows = measured_rows(json.loads(Path(args.raw).read_text()))
    delta = other_kernels_s(rows["fp8-rowwise"]) - other_kernels_s(rows["fp8-tensorwise"])
    # two trial rates: the step is linear in 1 / rate, so they give the strided bytes and the rest
    r1, r2 = 1.0e12, 0.5e12
    diff = {r: step_s(rows["fp8-rowwise"], "fp8-rowwise", args.cluster, r)
            - step_s(rows["fp8-tensorwise"], "fp8-tensorwise", args.cluster, r) for r in (r1, r2)}
    strided_bytes = (diff[r2] - diff[r1]) / (1 / r2 - 1 / r1)
    rest = diff[r1] - strided_bytes / r1
    rate = strided_bytes / (delta - rest)
    check = step_s(rows["fp8-rowwise"], "fp8-rowwise", args.cluster, rate) - step_s(
        rows["fp8-tensorwise"], "fp8-tensorwise", args.cluster, rate)
    print(f"measured (round 3, one H100): rowwise's cast kernels {1e3 * delta:.1f} ms more than tensorwise's")
    print(f"cost model ({args.cluster}): rowwise reads {strided_bytes / 1e9:.2f} GB along strided dimensions; "
          f"besides them it charges rowwise {1e3 * rest:+.1f} ms over tensorwise")
    print(f"strided_reduce_GBps = {rate / 1e9:.0f}   (check: predicted difference {1e3 * check:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
