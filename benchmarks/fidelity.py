"""Predicted vs published throughput for the public validation cases.

    python benchmarks/fidelity.py [--cases ../shared/validation/public_cases.json]

For every throughput case: the published degrees (tp, pp, dp) and what the
source states about its runtime are fixed; what it does not publish (micro-
batch, virtual stages, and for Megatron-Core also recompute and sequence
parallelism) is searched by meshplan's planner. The prediction is converted to
the source's own FLOP convention (see ../shared/validation/README.md):

- NAR21-T1 (Narayanan et al. SC'21, Table 1): F = 96 B s l h^2 (1 + s/6h + V/16lh)
  per step, full recompute counted; TFLOP/s = F / (t n). Runtime: Megatron-LM of
  2021: fp16, full recompute, materialised attention scores (no FlashAttention yet),
  gradient all-reduce after backward (no overlap; local DDP), interleaved 1F1B.
- MLM24-H100 (Megatron-Core r0.8 README table): model FLOPs without recompute,
  72 B s l h^2 (1 + s/6h + V/12lh) (Megatron's num_floating_point_operations),
  TFLOP/s per GPU. Runtime flags published: --overlap-grad-reduce,
  --overlap-param-gather, --tp-comm-overlap; distributed optimizer (ZeRO-1);
  bf16; FlashAttention (TransformerEngine).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.cluster import load_cluster  # noqa: E402
from planner.config import Workload  # noqa: E402
from planner.layers import build_layer_graph  # noqa: E402
from planner.model import ModelSpec  # noqa: E402
from planner.search import search  # noqa: E402
from planner.search.space import Knobs  # noqa: E402

DEFAULT_CASES = Path(__file__).resolve().parents[2] / "shared" / "validation" / "public_cases.json"


def case_model(case: dict) -> ModelSpec:
    m = case["model"]
    h, heads = m["hidden"], m["heads"]
    nar = case["id"].startswith("NAR21")
    return ModelSpec(name=case["id"], num_layers=m["layers"], hidden=h, num_heads=heads, num_kv_heads=heads,
                     head_dim=h // heads, ffn_hidden=m.get("ffn_hidden") or 4 * h, vocab_size=m["vocab"],
                     seq_len=m["seq_len"], max_positions=m["seq_len"], mlp="gelu", norm="layernorm",
                     linear_bias=True, qkv_bias=False,
                     # NAR21: tied embeddings (the source says so); MLM24: the parameter labels
                     # (e.g. 1.7B for 24 x 2048 with V = 131072) need untied embeddings
                     tied_embeddings=nar, dropout=nar, source=case["source"].get("paper", case["source"].get("repo", "")))


def case_setup(case: dict) -> tuple[str, Workload, Knobs]:
    cfg, m = case["config"], case["model"]
    if case["id"].startswith("NAR21"):
        workload = Workload(global_batch=cfg["global_batch"], seq_len=m["seq_len"], precision="fp16",
                            framework="megatron", attention="unfused", overlap_grad_reduce=False)
        knobs = Knobs(tp=cfg["tp"], pp=cfg["pp"], dp=cfg["dp"], cp=1, zero=0, recompute="full",
                      sequence_parallel=False if cfg["tp"] > 1 else None,
                      schedule="interleaved-1f1b" if cfg["pp"] > 1 else None)
        return "a100-80g", workload, knobs
    workload = Workload(global_batch=cfg["global_batch"], seq_len=m["seq_len"], precision="bf16",
                        framework="megatron", attention="flash", overlap_grad_reduce=True, tp_comm_overlap=True)
    knobs = Knobs(tp=cfg["tp"], pp=cfg["pp"], dp=cfg["dp"], cp=1, zero=1)
    return "h100-80g", workload, knobs


def published_convention_tflops(case: dict, step_s: float) -> float:
    m, cfg = case["model"], case["config"]
    B, s, l, h, V = cfg["global_batch"], m["seq_len"], m["layers"], m["hidden"], m["vocab"]
    n = case["hardware"]["num_gpus"]
    if case["id"].startswith("NAR21"):
        flops = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    else:
        flops = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    return flops / (step_s * n) / 1e12


def case_inputs(case: dict, profile_override: dict | None = None):
    """What the planner searches a case with: (layer graph, cluster, workload, fixed knobs);
    ``profile_override`` replaces fields of the cluster's device."""
    cluster_name, workload, knobs = case_setup(case)
    cluster = load_cluster(cluster_name, case["hardware"]["num_gpus"])
    if profile_override:
        from dataclasses import replace
        cluster = replace(cluster, device=replace(cluster.device, **profile_override))
    return build_layer_graph(case_model(case)), cluster, workload, knobs


def run_case(case: dict, profile_override: dict | None = None) -> dict:
    graph, cluster, workload, knobs = case_inputs(case, profile_override)
    t0 = time.perf_counter()
    # the published runtimes split layers evenly across stages (Megatron-LM requires it):
    # search balanced stages with one recompute policy, as they could run
    result = search(graph, cluster, workload, knobs, top_k=1, solver="uniform")
    seconds = time.perf_counter() - t0
    published = case["published"]["tflops_per_gpu"]
    if result.best is None:
        return {"id": case["id"], "published": published, "predicted": float("nan"), "error": float("nan"),
                "config": "no plan fits", "seconds": seconds}
    predicted = published_convention_tflops(case, result.best.estimate.step_time_s)
    c = result.best.config
    chosen = (f"mb {c.micro_batch} vpp {c.vpp} rc {c.recompute} sp {'on' if c.sequence_parallel else 'off'}")
    return {"id": case["id"], "published": published, "predicted": predicted,
            "error": predicted / published - 1, "config": chosen, "seconds": seconds,
            "step_s": result.best.estimate.step_time_s, "mem_gib": result.best.estimate.memory.total / 2**30}


def throughput_cases(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text()) if c["case_type"] == "throughput"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    args = parser.parse_args()
    rows = [run_case(case) for case in throughput_cases(args.cases)]
    print(f"{'case':<18} {'published':>9} {'predicted':>9} {'error':>7}  {'step s':>7} {'GiB':>5}  searched knobs")
    for r in rows:
        print(f"{r['id']:<18} {r['published']:>9.1f} {r['predicted']:>9.1f} {100 * r['error']:>+6.1f}%  "
              f"{r.get('step_s', float('nan')):>7.2f} {r.get('mem_gib', float('nan')):>5.1f}  {r['config']}")
    errors = [abs(r["error"]) for r in rows]
    print(f"\nmean absolute error {100 * statistics.mean(errors):.1f}%   max {100 * max(errors):.1f}%   "
          f"({len(rows)} cases; TFLOP/s per GPU in each source's own convention)")
    for prefix in ("NAR21", "MLM24"):
        sub = [abs(r["error"]) for r in rows if r["id"].startswith(prefix)]
        if sub:
            print(f"  {prefix}: mean {100 * statistics.mean(sub):.1f}%  max {100 * max(sub):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
