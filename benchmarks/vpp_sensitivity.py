"""How the predicted throughput of the public pipeline cases moves with the virtual stages per rank.

    python benchmarks/vpp_sensitivity.py [--cases ../shared/validation/public_cases.json]

The sources do not publish the interleaved schedule's virtual stages (vpp); benchmarks/fidelity.py searches
them. For each public case with 2 to 7 pipeline stages this fixes vpp at each value the model splits into,
searches the rest as fidelity.py does, and prints the error against the published TFLOP/s per GPU: where it
keeps rising with vpp, the search's choice is the model's optimum and not necessarily the run's.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fidelity import DEFAULT_CASES, case_inputs, published_convention_tflops, throughput_cases  # noqa: E402
from planner.errors import UserError  # noqa: E402
from planner.search import search  # noqa: E402

VPPS = (1, 2, 3, 4, 6, 8, 12, 16, 24)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    args = parser.parse_args()
    print(f"{'case':<18} {'pp':>3}  " + "  ".join(f"{'vpp ' + str(v):>8}" for v in VPPS))
    for case in throughput_cases(args.cases):
        pp = case["config"]["pp"]
        if not 2 <= pp <= 7:
            continue
        graph, cluster, workload, knobs = case_inputs(case)
        cells = []
        for vpp in VPPS:
            fixed = replace(knobs, vpp=vpp, schedule="interleaved-1f1b" if vpp > 1 else "1f1b")
            try:
                result = search(graph, cluster, workload, fixed, top_k=0, solver="uniform")
            except UserError:       # a vpp the model's layers do not split into
                result = None
            if result is None or result.best is None:
                cells.append(f"{'-':>8}")
                continue
            tflops = published_convention_tflops(case, result.best.estimate.step_time_s)
            cells.append(f"{100 * (tflops / case['published']['tflops_per_gpu'] - 1):>+7.1f}%")
        print(f"{case['id']:<18} {pp:>3}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
