"""Fit the GEMM mechanism's free constants to the public throughput cases.

    python benchmarks/calibrate.py [--cases ../shared/validation/public_cases.json]

The one free constant per device (everything else in profiles/ comes from
datasheets and papers) is gemm_efficiency: the achieved fraction of dense peak
of a large training GEMM (A100 from the NAR21 cases, H100 from the MLM24 cases).
Grid search minimising the mean absolute error over the device's cases. The result is
written by hand into profiles/*.toml with this command as its source.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import DEFAULT_CASES, run_case_api, throughput_cases  # noqa: E402


def device_of(case: dict) -> str | None:
    """The device a case calibrates: A100 from NAR21 Table 1 (the profile's source names those cases), H100 from
    MLM24; None for the others (Table 2's runs are held out: its ZeRO-3 rows price DeepSpeed's gathers, not GEMMs)."""
    if case["id"].startswith("NAR21-T1"):
        return "a100"
    return "h100" if case["id"].startswith("MLM24") else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    args = parser.parse_args()
    cases = throughput_cases(args.cases)
    for device in ("a100", "h100"):
        sub = [c for c in cases if device_of(c) == device]
        scores = []
        for eff in [x / 100 for x in range(45, 86)]:
            errs = [run_case_api(c, {"gemm_efficiency": eff})["error"] for c in sub]
            if any(e != e for e in errs):       # a case with no plan that fits: this efficiency cannot be scored
                continue
            scores.append((statistics.mean(abs(e) for e in errs), eff, max(abs(e) for e in errs)))
        mae, eff, worst = min(scores)
        print(f"{device}: gemm_efficiency {eff:.2f}  MAE {100 * mae:.1f}%  max {100 * worst:.1f}%  "
              f"over {len(sub)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
