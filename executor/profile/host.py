"""The host's time per block of meshplan's executor, by regime: what a step costs where the GPU waits
for Python to issue its kernels.

A step of a small model on a fast GPU is bound by the host: each eager operator costs the host
microseconds (dispatch, autograd, the module's Python) while its kernel runs in fewer, and FSDP2's
hooks, operator-level checkpointing's policy and a mixture of experts' routing (a device-to-host
copy of the tokens per expert each layer) add host work of their own. ``executor_host`` measures it
with the executor itself: it trains a tiny model (hidden 256, 64 tokens, batch 1: every kernel a few
microseconds, so the step time is the host's) at several depths and micro-batch counts, and fits

    t(L, m) = m (L block_microbatch + rest_microbatch) + L block_step + rest_step

for the host seconds of one block per micro-batch (forward, backward and recompute) and per step
(its parameters' share of the optimizer and of gradient synchronisation), and the rest of the step
per micro-batch (embedding, head, loss) and per step (optimizer, loss read back).
Regimes, as planner/cost/host.py prices them: ``eager`` (ZeRO-0: fp32 parameters under autocast on a
GPU), ``op`` and ``full`` (the same with operator-level and full recompute), ``fsdp`` (ZeRO-3:
FSDP2, bf16 parameters, resharded after forward), ``moe`` (ZeRO-0, every block a mixture of 8 experts,
top 2). Each probe block is the executor's own (executor/models.py, executor/moe.py).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from planner.cost.host import PROBE_EXPERTS, probe_spec
from planner.model import config_json

# (blocks, micro-batches) of the timed runs: three depths and two micro-batch counts, so that the four
# host times are fitted with a residual that says how well one line holds (a GPU lease measured four
# runs at 2 and 6 blocks in round 2: exactly determined, and off by milliseconds from run to run)
DEPTHS = ((2, 1), (4, 1), (6, 1), (2, 2), (4, 2), (6, 2))
# the regimes most plans need first: a probe stopped at its time limit keeps those it finished
PROBES = {"eager": {"zero": 0, "recompute": "none"},
          "fsdp": {"zero": 3, "recompute": "none"},
          "op": {"zero": 0, "recompute": "op"},
          "full": {"zero": 0, "recompute": "full"},
          "moe": {"zero": 0, "recompute": "none", "experts": PROBE_EXPERTS}}


def _plan_path(spec, *, zero: int, recompute: str, micro: int, device: str, tmp: Path) -> Path:
    """plan.json of ``spec`` on one GPU with every knob fixed, written by ``meshplan plan`` (the profiler
    plans through the command line, as a user does)."""
    import subprocess
    gpu = device.startswith("cuda")
    model = tmp / f"{spec.name}-{spec.num_experts}.json"
    model.write_text(json.dumps(config_json(spec)))
    path = tmp / f"{spec.name}-{spec.num_experts}-{zero}-{recompute}-{micro}.plan.json"
    args = ["plan", "--model", str(model), "--cluster", "h100-80g" if gpu else "cpu-gloo", "--gpus", "1",
            "--dp", "1", "--tp", "1", "--pp", "1", "--cp", "1", "--zero", str(zero), "--micro-batch", "1",
            "--global-batch", str(micro), "--seq-len", str(spec.seq_len), "--recompute", recompute,
            "--optimizer-offload", "off", "--out", str(path)] + ([] if gpu else ["--precision", "fp32"]) \
        + (["--ep", "1"] if spec.num_experts else [])
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"meshplan {' '.join(args)}: {done.stderr.strip()[-300:]}")
    return path


def _step_times(plan_path: Path, device: str, steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` synchronised training steps of the executor (after ``warmup``)."""
    import torch

    from ..plan_file import load_plan
    from ..train import Job, RunOptions, train_step
    dev = torch.device(device)
    job = Job(load_plan(plan_path), RunOptions(steps=warmup + steps), dev)
    for step in range(warmup):
        train_step(job, step)
    times = []
    for step in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        train_step(job, step)                  # returns the loss as a float: synchronised
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del job
    return times


def solve(t: dict) -> dict:
    """The four host times of ``t(L, m) = m (L block_microbatch + rest_microbatch) + L block_step +
    rest_step`` from the runs ``t[(L, m)]``: exact from four runs at two depths and two micro-batch
    counts, least squares from more, with the root-mean-square residual of the fit."""
    import numpy as np
    keys = sorted(t)
    a = np.array([[m * blocks, blocks, m, 1.0] for blocks, m in keys])
    y = np.array([t[k] for k in keys])
    x, *_ = np.linalg.lstsq(a, y, rcond=None)
    residual = float(np.sqrt(np.mean((a @ x - y) ** 2)))
    return {"block_microbatch_s": float(x[0]), "block_step_s": float(x[1]), "rest_microbatch_s": float(x[2]),
            "rest_step_s": float(x[3]), "rms_residual_s": residual}


def fit(row: dict) -> dict:
    """``solve`` over the median of each run's timed steps (``step_times_s``, keyed ``"{blocks}x{micro}"``),
    with those medians as ``times_s``. The median, as benchmarks/gpu_validate.py measures the steps these
    times predict: the least step of a run on a busy host is a lucky one (an H100's probe in round 3 found
    its runs' least steps 10-30% under their medians), and a host time fitted to it prices every step
    as lucky."""
    import statistics
    t = {tuple(int(x) for x in key.split("x")): statistics.median(v) for key, v in row["step_times_s"].items()}
    return {"times_s": {f"{b}x{m}": s for (b, m), s in sorted(t.items())}, **solve(t)}


def _process_group(device: str) -> bool:
    """Start a one-rank process group where none is (the executor needs one); True if started here."""
    import torch.distributed as dist
    if dist.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from executor.launch import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return True


def executor_host(device: str, *, probes: dict | None = None, steps: int = 8, warmup: int = 4,
                  done=None) -> dict:
    """Per regime: every timed step of each run, and the host seconds ``fit`` takes from their medians. A probe
    that fails is recorded with its error, not raised. ``done(result)`` is called after each regime with the
    regimes so far."""
    import torch.distributed as dist
    started = _process_group(device)
    out: dict = {"model": "probe_spec (executor/profile/host.py): hidden 256, 64 tokens, batch 1",
                 "depths": [list(d) for d in DEPTHS], "steps": steps, "warmup": warmup, "regimes": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, knobs in (probes or PROBES).items():
                row: dict = {**knobs}
                try:
                    runs = {}
                    for blocks, micro in DEPTHS:
                        spec = probe_spec(blocks, knobs.get("experts", 0))
                        path = _plan_path(spec, zero=knobs["zero"], recompute=knobs["recompute"], micro=micro,
                                          device=device, tmp=Path(tmp))
                        runs[(blocks, micro)] = _step_times(path, device, steps, warmup)
                    row["step_times_s"] = {f"{b}x{m}": v for (b, m), v in runs.items()}
                    row.update(fit(row))
                except Exception as err:           # a regime the device cannot run is a result
                    row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
                out["regimes"][name] = row
                if done is not None:
                    done(out)
    finally:
        if started:
            dist.destroy_process_group()
    return out


def main() -> None:
    """``python -m executor.profile.host --merge NAME.kernels.json --out NEW.kernels.json``: measure here
    and add the result to a profile's raw measurements (``meshplan profile --from`` derives the TOML)."""
    import argparse
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--merge", metavar="NAME.kernels.json", help="raw measurements to add the result to")
    parser.add_argument("--out", required=True, metavar="PATH.json")
    args = parser.parse_args()
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    command = "python -m executor.profile.host " + " ".join(sys.argv[1:])

    def write(result: dict) -> None:
        """The regimes so far, written at once: a probe stopped at its time limit keeps them."""
        name, row = list(result["regimes"].items())[-1]
        print(f"{name:6} " + (f"per block: {row['block_microbatch_s'] * 1e6:8.1f} us a micro-batch, "
                              f"{row['block_step_s'] * 1e6:8.1f} us a step; the rest: "
                              f"{row['rest_microbatch_s'] * 1e6:8.1f} us a micro-batch, "
                              f"{row['rest_step_s'] * 1e6:8.1f} us a step (fit off by "
                              f"{row['rms_residual_s'] * 1e6:.0f} us rms)"
                              if "error" not in row else row["error"]), flush=True)
        result = {**result, "command": command}
        if args.merge:
            raw = json.loads(Path(args.merge).read_text())
            raw["device"]["kernels"]["executor_host"] = result
            result = raw
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    executor_host(device, done=write)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
