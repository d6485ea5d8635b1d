"""Time of `meshplan compare`, cold start included: GPT-3 175B on 1024 A100 against the
layout of Narayanan et al. 2021 (reports/baselines/gpt3-175b-1024-a100.args).

    python benchmarks/compare_speed.py [--runs 5]

Each run is a fresh interpreter (imports, profile, reading the file, the baseline's
simulated estimate, the search, the JSON). Printed per run: wall seconds, the CPU
seconds of the child process (user + system; what a quiet machine's wall time would be
close to), the machine's load average when it ran, and for reference the same for
`meshplan plan` (the search alone). It prints; it does not assert.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPARE = ["compare", "--cluster", "a100-80g", "--gpus", "1024", "--baseline",
           str(ROOT / "reports" / "baselines" / "gpt3-175b-1024-a100.args"), "--json"]
PLAN = ["plan", "--model", "gpt3-175b", "--cluster", "a100-80g", "--gpus", "1024", "--global-batch", "1536",
        "--framework", "megatron", "--no-overlap-grad-reduce", "--json"]


def timed(args: list[str]) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of `meshplan ARGS` in a fresh interpreter."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}: {out.stderr.strip()}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    print(f"{os.cpu_count()} CPUs; {'command':<8} {'wall s':>7} {'cpu s':>6} {'load':>5}")
    for name, args in (("compare", COMPARE), ("plan", PLAN)):
        for _ in range(runs):
            load = os.getloadavg()[0]
            wall, cpu = timed(args)
            print(f"{'':>8}  {name:<8} {wall:>7.2f} {cpu:>6.2f} {load:>5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
