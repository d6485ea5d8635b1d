"""Wall time of the what-if sweep the issue names, as a user runs it (fresh interpreter).

    python benchmarks/whatif_speed.py [--repeat 3]

Runs `meshplan whatif --model llama3-70b --cluster h100-80g --sweep gpus=64,128,256,512,1024`
into a temporary folder and prints the seconds each run took (target: under 30 s).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["whatif", "--model", "llama3-70b", "--cluster", "h100-80g", "--sweep", "gpus=64,128,256,512,1024"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            run = subprocess.run([sys.executable, "-m", "planner.cli", *COMMAND, "--out", out], env=env,
                                 capture_output=True, text=True)
            seconds = time.perf_counter() - t0
        if run.returncode:
            print(run.stderr)
            return run.returncode
        print(f"meshplan {' '.join(COMMAND)}: {seconds:.1f} s")
    print(run.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
