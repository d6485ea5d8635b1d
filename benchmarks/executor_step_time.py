"""Predicted against measured step time of `meshplan run` on this machine.

    python benchmarks/executor_step_time.py [--steps 5] [--measure [--ops]]

Plans against the stock cpu-gloo profile, or with --measure against a profile of this
machine that `meshplan profile --nproc 2 --quick` writes first (with --ops it also times
every traced operator of the model, and the plan uses those times).

Writes a Llama-style config (4 layers, hidden 512, seq 256, vocab 8192: big enough that GEMMs,
not Python overhead, dominate a step on one CPU thread; untied, since `meshplan plan` cannot yet
estimate a tied embedding across pipeline stages on cpu-gloo), plans it on cpu-gloo with 2 processes for a
few fixed configs (`meshplan plan`), runs each (`meshplan run`), and prints a table. It asserts
nothing: the error is what it is; cite it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
          "num_key_value_heads": 8, "intermediate_size": 1408, "vocab_size": 8192, "max_position_embeddings": 256}
PLANS = {
    "dp2": ["--dp", "2", "--tp", "1", "--pp", "1", "--zero", "0", "--micro-batch", "4"],
    "dp2 zero3": ["--dp", "2", "--tp", "1", "--pp", "1", "--zero", "3", "--micro-batch", "4"],
    "tp2": ["--dp", "1", "--tp", "2", "--pp", "1", "--zero", "0", "--micro-batch", "8"],
    "pp2 1f1b": ["--dp", "1", "--tp", "1", "--pp", "2", "--zero", "0", "--schedule", "1f1b", "--micro-batch", "2"],
}


def meshplan(*args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(done.stderr)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--measure", action="store_true", help="plan against a fresh `meshplan profile --nproc 2`")
    parser.add_argument("--ops", action="store_true", help="with --measure: also time the model's operators")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="meshplan-steptime-"))
    (tmp / "llama-mid.json").write_text(json.dumps(CONFIG))
    cluster = "cpu-gloo"
    if args.measure:
        cluster = str(tmp / "measured.toml")
        meshplan("profile", "--nproc", "2", "--quick", "--out", cluster,
                 *(["--ops", "llama-mid.json"] if args.ops else []), cwd=tmp)
    print(f"cluster profile: {cluster}")
    print(f"{'plan':<10} {'predicted s':>12} {'measured s':>11} {'error':>7}")
    for name, knobs in PLANS.items():
        plan = tmp / "plan.json"
        meshplan("plan", "--model", "llama-mid.json", "--cluster", cluster, "--gpus", "2", "--precision", "fp32",
                 "--global-batch", "8", "--recompute", "none", *knobs, "--out", str(plan), cwd=tmp)
        summary = json.loads(meshplan("run", "--plan", str(plan), "--model", "llama-mid.json", "--steps",
                                      str(args.steps), "--json", cwd=tmp).strip().splitlines()[-1])
        predicted, measured = summary["predicted"]["step_time_s"], summary["step_time_s"]
        print(f"{name:<10} {predicted:>12.3f} {measured:>11.3f} {100 * (measured / predicted - 1):>+6.0f}%")


if __name__ == "__main__":
    main()
