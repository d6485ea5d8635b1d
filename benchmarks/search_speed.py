"""Time of the full search, cold start included, for reference scenarios.

    python benchmarks/search_speed.py

Each scenario runs `meshplan plan ... --json` in a fresh interpreter (imports,
profile loading, layer graph, search, output) and prints the wall time, the
search's own time and the candidates it covered. Timings are noisy on a shared
machine: the script takes the best of 3 runs.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCENARIOS = [
    ("GPT-3 175B on 1024 A100-80GB, batch 1536",
     ["--model", "gpt3-175b", "--cluster", "a100-80g", "--gpus", "1024", "--global-batch", "1536"]),
    ("Llama-3 70B on 512 H100, seq 8192",
     ["--model", "llama3-70b", "--cluster", "h100-80g", "--gpus", "512", "--seq-len", "8192",
      "--global-batch", "512"]),
    ("Llama-3 405B on 16384 H100, seq 8192, 16M tokens",
     ["--model", "llama3-405b", "--cluster", "h100-80g", "--gpus", "16384", "--seq-len", "8192",
      "--global-batch", "2048"]),
    ("Mixtral 8x7B on 64 H100 (ep searched)",
     ["--model", "mixtral-8x7b", "--cluster", "h100-80g", "--gpus", "64"]),
    # 94 blocks that divide into no virtual stages evenly: the played pipelines, and ZB-V's stage ILPs
    ("Qwen3-235B-A22B on 256 B200 (ep searched)",
     ["--model", "qwen3-235b-a22b", "--cluster", "b200", "--gpus", "256"]),
    # and the runner-up without expert parallelism: 1F1B over 32 stages, 94 blocks
    ("Qwen3-235B-A22B on 1024 H100 (ep searched)",
     ["--model", "qwen3-235b-a22b", "--cluster", "h100-80g", "--gpus", "1024"]),
    # bf16 fixed: one search. Left out, Megatron-LM on H100 also searches its fastest FP8 recipe (planner/api.py
    # plan_precisions): two searches, the last scenario
    ("DeepSeek-V3 on 256 H100, Megatron-LM",
     ["--model", "deepseek-v3", "--cluster", "h100-80g", "--gpus", "256", "--framework", "megatron",
      "--precision", "bf16"]),
    ("DeepSeek-V3 on 1024 H100, Megatron-LM",
     ["--model", "deepseek-v3", "--cluster", "h100-80g", "--gpus", "1024", "--framework", "megatron",
      "--precision", "bf16"]),
    ("DeepSeek-V3 on 1024 H100, Megatron-LM, precision searched",
     ["--model", "deepseek-v3", "--cluster", "h100-80g", "--gpus", "1024", "--framework", "megatron"]),
]


def run(args: list[str]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "planner.cli", "plan", *args, "--json"], capture_output=True,
                         text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}: {out.stderr.strip()}")
    return wall, json.loads(out.stdout)


def main() -> int:
    print(f"{'scenario':<50} {'wall s':>7} {'search s':>8} {'candidates':>11} {'full':>6}  plan")
    for name, args in SCENARIOS:
        best = min((run(args) for _ in range(3)), key=lambda r: r[0])
        wall, doc = best
        c, s = doc["config"], doc["search"]
        plan = (f"dp {c['dp']} tp {c['tp']} pp {c['pp']} cp {c['cp']} ep {c.get('ep', 1)} zero {c['zero']} "
                f"mb {c['micro_batch']} "
                f"{c['schedule']} v{c['vpp']} rc {c['recompute']}")
        print(f"{name:<50} {wall:>7.2f} {s['seconds']:>8.2f} {s['candidates']:>11,} {s['evaluated']:>6,}  {plan}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
