"""Plan, run and measure on this machine: meshplan's predictions against its own executor.

    python benchmarks/closed_loop.py [--steps 6] [--quick] [--out benchmarks/results/closed_loop.json]

1. Profiles this machine for 2 processes (`meshplan profile --nproc 2`; --quick: fewer shapes),
   and again (--quick) right before each plan and right after its run: this VM's speed drifts by
   up to 25% within minutes (the same plan measured 2.03 s and 2.48 s half an hour apart, and
   3.33 s and 2.42 s twenty minutes apart, 2026-11-23), so each prediction is made from the machine
   as it was around its run: the mean of the plan's predicted step under the profile before and
   under the one after (planner.simulate.simulated_estimate, what `meshplan plan` reports), both
   kept in the results (--profile-once: the first profile for all, nothing after).
2. For a small compute-dominated Llama-style model, plans a grid of plans on 2 processes
   against that profile (`meshplan plan ... --out`): data parallelism with ZeRO 0-3, tensor
   parallelism with and without sequence parallelism, pipelines with GPipe, 1F1B and the
   interleaved schedule, context parallelism, every recompute policy (none, selective, op, full,
   offload, every-2), micro-batch 1-4, and the planner's own choice with nothing fixed.
3. Runs each (`meshplan run --steps N --json`) and takes the median step after the first two
   (the first initialises, the second rebuilds DDP's buckets), leaving out the instrumented one
   (executor/train.py ``steady_times``) and, per rank, the most memory the
   instrumented step had allocated at once (executor/measure.py AllocationPeak: the profiler's
   CPU allocation events on top of the model states alive when the step began) against the
   predicted per-stage total without the runtime reserve (which no allocator counter sees).
4. Prints predicted against measured step time and memory, their errors, the rank correlation
   of step times (Spearman), and how the planner's own choice compares with the measured
   fastest plan. Writes the rows to --out (benchmarks/results/closed_loop.json), which
   benchmarks/accuracy.py summarises into each CPU plan's error band.

It asserts nothing: the errors are what they are. The machine must be otherwise idle: the
profile and the runs share its cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from planner.cluster import load_cluster  # noqa: E402
from executor.train import steady_times  # noqa: E402


def predicted_step_s(plan_doc: dict, profile: Path, model: Path) -> float:
    """The step time `meshplan plan` would report for the plan's config against ``profile``."""
    from planner.cli import build_parser
    from planner.commands import load_inputs
    from planner.config import ParallelConfig
    from planner.simulate import simulated_estimate
    args = build_parser().parse_args(["plan", "--model", str(model), "--cluster", str(profile), "--gpus", "2", *BATCH])
    _, graph, cluster, workload = load_inputs(args)
    return simulated_estimate(graph, cluster, workload, ParallelConfig.from_json(plan_doc["config"])).step_time_s
MODEL = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 8, "intermediate_size": 1408, "vocab_size": 8192, "max_position_embeddings": 256}
BATCH = ["--global-batch", "8", "--precision", "fp32"]
DP = ["--dp", "2", "--tp", "1", "--pp", "1", "--cp", "1"]
TP = ["--dp", "1", "--tp", "2", "--pp", "1", "--cp", "1", "--zero", "0"]
PP = ["--dp", "1", "--tp", "1", "--pp", "2", "--cp", "1", "--zero", "0"]
GRID = {   # name -> `meshplan plan` knobs (None: the planner's own choice, nothing fixed)
    **{f"dp2 zero{z} mb4": DP + ["--zero", str(z), "--micro-batch", "4", "--recompute", "none"] for z in range(4)},
    **{f"dp2 zero0 mb{mb}": DP + ["--zero", "0", "--micro-batch", str(mb), "--recompute", "none"] for mb in (2, 1)},
    **{f"dp2 {rc}": DP + ["--zero", "0", "--micro-batch", "4", "--recompute", rc]
       for rc in ("selective", "op", "full", "offload", "every-2")},         # every recompute policy
    **{f"tp2 sp {sp}": TP + ["--micro-batch", "4", "--sequence-parallel", sp, "--recompute", "none"]
       for sp in ("off", "on")},
    **{f"pp2 {s}": PP + ["--schedule", s, "--micro-batch", "2", "--recompute", "none"] for s in ("gpipe", "1f1b")},
    "pp2 interleaved": PP + ["--schedule", "interleaved-1f1b", "--vpp", "2", "--micro-batch", "1",
                             "--recompute", "none"],
    "cp2": ["--dp", "1", "--tp", "1", "--pp", "1", "--cp", "2", "--zero", "0", "--micro-batch", "4",
            "--recompute", "none"],
    "planner's choice": None,
}


class Failed(Exception):
    """A `meshplan` command that exited non-zero (its stderr)."""


def meshplan(*args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise Failed(f"meshplan {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


MEASURED = ("params", "params_gathered", "grads", "optimizer", "activations")


def measured_bytes(rank: dict) -> float:
    """What one rank allocated at its peak: ``peak_allocated`` (on the CPU the profiler's allocation
    events over the instrumented step, on top of the model states alive when it began;
    executor/measure.py AllocationPeak), or where a run has none, the executor's counters by
    category (model states, gathered parameter copies, the peak of the tensors saved for backward)."""
    if rank.get("peak_allocated") is not None:
        return rank["peak_allocated"]
    return sum(rank.get(k) or 0 for k in MEASURED)


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for position, i in enumerate(order):
            out[i] = position
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="a quicker, coarser profile")
    parser.add_argument("--only", nargs="*", help="run only these grid entries")
    parser.add_argument("--out", type=Path, help="write the rows as JSON (benchmarks/results/closed_loop.json)")
    parser.add_argument("--profile-once", action="store_true",
                        help="plan every entry against the first profile (default: a quick profile before each "
                             "plan and after its run)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="meshplan-closed-loop-"))
    (tmp / "llama-mid.json").write_text(json.dumps(MODEL))
    profile = tmp / "measured.toml"
    t0 = time.perf_counter()
    meshplan("profile", "--device", "cpu", "--nproc", "2", *(["--quick"] if args.quick else []),
             "--out", str(profile), cwd=tmp)
    print(f"profiled this machine in {time.perf_counter() - t0:.0f} s: {profile}")
    rows, failures = [], []
    print(f"{'plan':<18} {'predicted s':>11} {'before/after':>12} {'measured s':>10} {'error':>7}   {'pred MiB':>8} "
          f"{'meas MiB':>8} {'error':>7}  config")
    for name, knobs in GRID.items():
        if args.only and name not in args.only:
            continue
        plan = tmp / "plan.json"
        if not args.profile_once:
            profile = tmp / f"measured-{len(rows) + len(failures)}.toml"
            meshplan("profile", "--device", "cpu", "--nproc", "2", "--quick", "--out", str(profile), cwd=tmp)
        meshplan("plan", "--model", "llama-mid.json", "--cluster", str(profile), "--gpus", "2", *BATCH,
                 *(knobs or []), "--out", str(plan), cwd=tmp)
        doc = json.loads(plan.read_text())
        try:
            meshplan("run", "--plan", str(plan), "--model", "llama-mid.json", "--steps", str(args.steps),
                     "--out", str(tmp / "measured.json"), cwd=tmp)
        except Failed as e:        # reported and counted, not retried: a failing run is a result too
            failures.append({"name": name, "error": str(e).splitlines()[-1]})
            print(f"{name:<18} FAILED: {str(e).splitlines()[-1]}", flush=True)
            continue
        out = json.loads((tmp / "measured.json").read_text())
        times = steady_times(out["step_times_s"], out["instrumented_step"])
        measured_s = statistics.median(times)
        before_s = after_s = doc["estimate"]["step_time_s"]
        if not args.profile_once:           # the machine after the run: the prediction is the mean
            after = tmp / f"measured-{len(rows) + len(failures)}-after.toml"
            meshplan("profile", "--device", "cpu", "--nproc", "2", "--quick", "--out", str(after), cwd=tmp)
            after_s = predicted_step_s(doc, after, tmp / "llama-mid.json")
        predicted_s = (before_s + after_s) / 2
        stages = doc["estimate"]["memory_per_stage_bytes"]
        per_rank = out["memory_per_rank_bytes"]
        # the most loaded rank of each: what `fits` is decided on
        predicted_mem = max(s["total"] - s["reserve"] for s in stages)
        measured_mem = max(measured_bytes(r) for r in per_rank)
        c = doc["config"]
        config = (f"dp {c['dp']} tp {c['tp']} pp {c['pp']} cp {c['cp']} zero {c['zero']} mb {c['micro_batch']} "
                  f"{c['schedule']} v{c['vpp']} sp {'on' if c['sequence_parallel'] else 'off'} rc {c['recompute']}")
        row = {"name": name, "config": config, "predicted_step_s": predicted_s,
               "predicted_before_s": before_s, "predicted_after_s": after_s, "measured_step_s": measured_s,
               "step_error": measured_s / predicted_s - 1, "predicted_peak_bytes": predicted_mem,
               "measured_peak_bytes": measured_mem, "peak_error": measured_mem / predicted_mem - 1,
               "step_times_s": out["step_times_s"],
               "profile_gemm_tflops": load_cluster(str(profile), 2).device.peak("fp32") / 1e12}
        rows.append(row)
        print(f"{name:<18} {predicted_s:>11.3f} {before_s:>5.2f}/{after_s:<6.2f} {measured_s:>10.3f} "
              f"{100 * row['step_error']:>+6.1f}%   "
              f"{predicted_mem / 2**20:>8.1f} {measured_mem / 2**20:>8.1f} {100 * row['peak_error']:>+6.1f}%  "
              f"{config}", flush=True)
    if len(rows) > 2:
        rho = spearman([r["predicted_step_s"] for r in rows], [r["measured_step_s"] for r in rows])
        fastest = min(rows, key=lambda r: r["measured_step_s"])
        mine = next((r for r in rows if r["name"] == "planner's choice"), None)
        within = lambda key: sum(abs(r[key]) <= 0.10 for r in rows)   # noqa: E731
        print(f"\nstep time within 10%: {within('step_error')} of {len(rows)}; memory within 10%: "
              f"{within('peak_error')} of {len(rows)}; rank correlation {rho:+.2f}")
        if mine:
            print(f"planner's choice {mine['measured_step_s']:.3f} s against the measured fastest "
                  f"({fastest['name']}) {fastest['measured_step_s']:.3f} s: "
                  f"{100 * (mine['measured_step_s'] / fastest['measured_step_s'] - 1):+.1f}%")
    if failures:
        print(f"{len(failures)} run(s) failed: " + "; ".join(f["name"] for f in failures))
    if args.out:
        args.out.write_text(json.dumps({"measured_by": "python benchmarks/closed_loop.py --out "
                                        "benchmarks/results/closed_loop.json", "processes": 2,
                                        "profiled": "once" if args.profile_once else
                                        "before each plan and after its run (--quick); predicted: the mean",
                                        "load_average": os.getloadavg()[0], "model": MODEL, "steps": args.steps,
                                        "rows": rows, "failures": failures}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
