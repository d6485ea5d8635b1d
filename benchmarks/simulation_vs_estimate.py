"""The event simulation against the closed-form estimate on the public validation cases.

    python benchmarks/simulation_vs_estimate.py [--cases ../shared/validation/public_cases.json] [--top-k 1]

For every throughput case the plan is searched as ``benchmarks/fidelity.py`` does
(published degrees fixed, balanced stages, unpublished knobs searched, analytical
ranking only); then the best plan (and with ``--top-k`` the runners-up) is simulated
event by event (``planner/simulate.py``). Where the closed form holds (equal stages,
communication hidden where it assumes) the two should agree within 2%.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import DEFAULT_CASES, case_inputs, throughput_cases  # noqa: E402  (it puts the checkout on sys.path)
from planner.cost.step import CostCache  # noqa: E402
from planner.search import search  # noqa: E402
from planner.simulate import simulate  # noqa: E402


def describe(c) -> str:
    return (f"dp{c.dp} tp{c.tp} pp{c.pp} mb{c.micro_batch}x{c.num_microbatches} {c.schedule} v{c.vpp} "
            f"z{c.zero} rc {c.recompute} sp {'on' if c.sequence_parallel else 'off'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    parser.add_argument("--top-k", type=int, default=1, help="also simulate this many runners-up")
    args = parser.parse_args()
    errors = []
    print(f"{'case':<18} {'estimate s':>10} {'simulated s':>11} {'diff':>7} {'sim ms':>7}  config")
    for case in throughput_cases(args.cases):
        graph, cluster, workload, knobs = case_inputs(case)
        result = search(graph, cluster, workload, knobs, top_k=args.top_k, solver="uniform", simulate=False)
        cache = CostCache(graph, cluster, workload)
        if result.best is None:
            print(f"{case['id']:<18} no plan fits (its published layout does not fit meshplan's memory model)")
            continue
        for cand in [result.best, *result.alternatives][:args.top_k]:
            t0 = time.perf_counter()
            sim = simulate(graph, cluster, workload, cand.config, cache).step_time_s
            ms = 1e3 * (time.perf_counter() - t0)
            est = cand.estimate.step_time_s
            errors.append(sim / est - 1)
            print(f"{case['id']:<18} {est:>10.3f} {sim:>11.3f} {100 * (sim / est - 1):>+6.2f}% {ms:>7.0f}  "
                  f"{describe(cand.config)}")
    print(f"\nmean |diff| {100 * statistics.mean(abs(e) for e in errors):.2f}%   "
          f"max |diff| {100 * max(abs(e) for e in errors):.2f}%   ({len(errors)} plans)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
