"""The host's time per block of meshplan's executor, by regime: what a step costs where the GPU waits
for Python to issue its kernels (issue 28).

A step of a small model on a fast GPU is bound by the host: each eager operator costs the host
microseconds (dispatch, autograd, the module's Python) while its kernel runs in fewer, and FSDP2's
hooks, operator-level checkpointing's policy and a mixture of experts' routing (a device-to-host
copy of the tokens per expert each layer) add host work of their own. ``executor_host`` measures it
with the executor itself: it trains a tiny model (hidden 256, 64 tokens, batch 1: every kernel a few
microseconds, so the step time is the host's) and solves

    t(L, m) = m (L block_microbatch + rest_microbatch) + L block_step + rest_step

for the host seconds of one block per micro-batch (forward, backward and recompute) and per step
(its parameters' share of the optimizer and of gradient synchronisation), and the rest of the step
per micro-batch (embedding, head, loss) and per step (optimizer, loss read back), from the four
runs of 2 and 6 blocks with one and two micro-batches.
Regimes, as planner/cost/host.py prices them: ``eager`` (ZeRO-0: fp32 parameters under autocast on a
GPU), ``op`` and ``full`` (the same with operator-level and full recompute), ``fsdp`` (ZeRO-3:
FSDP2, bf16 parameters, resharded after forward), ``moe`` (ZeRO-0, every block a mixture of 8 experts,
top 2). Each probe block is the executor's own (executor/models.py, executor/moe.py).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from planner.cost.host import probe_spec

DEPTHS = ((2, 1), (6, 1), (2, 2), (6, 2))     # (blocks, micro-batches) of the four timed runs
PROBES = {"eager": {"zero": 0, "recompute": "none"},
          "op": {"zero": 0, "recompute": "op"},
          "full": {"zero": 0, "recompute": "full"},
          "fsdp": {"zero": 3, "recompute": "none"},
          "moe": {"zero": 0, "recompute": "none", "experts": 8}}


def probe_config(spec) -> dict:
    """``spec`` (planner.cost.host.probe_spec) as the Hugging Face config.json ``meshplan plan`` reads."""
    cfg = {"model_type": "mixtral" if spec.num_experts else "llama", "num_hidden_layers": spec.num_layers,
           "hidden_size": spec.hidden, "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
           "intermediate_size": spec.ffn_hidden, "vocab_size": spec.vocab_size, "tie_word_embeddings": False,
           "max_position_embeddings": spec.seq_len}
    if spec.num_experts:
        cfg.update(num_local_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token)
    return cfg


def _plan_path(spec, *, zero: int, recompute: str, micro: int, device: str, tmp: Path) -> Path:
    """plan.json of ``spec`` on one GPU with every knob fixed, written by ``meshplan plan`` (the profiler
    plans through the command line, as a user does)."""
    import subprocess
    gpu = device.startswith("cuda")
    model = tmp / f"{spec.name}-{spec.num_experts}.json"
    model.write_text(json.dumps(probe_config(spec)))
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


def _step_s(plan_path: Path, device: str, steps: int, warmup: int) -> float:
    """Median seconds of a synchronised training step of the executor (after ``warmup`` steps)."""
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
    return statistics.median(times)


def solve(t: dict) -> dict:
    """The four host times of ``t(L, m) = m (L block_microbatch + rest_microbatch) + L block_step +
    rest_step`` from the runs at ``DEPTHS`` (2 and 6 blocks, 1 and 2 micro-batches)."""
    (l1, m1), (l2, _), _, (_, m2) = DEPTHS
    extra_mb_deep, extra_mb_shallow = t[(l2, m2)] - t[(l2, m1)], t[(l1, m2)] - t[(l1, m1)]
    block_mb = (extra_mb_deep - extra_mb_shallow) / ((l2 - l1) * (m2 - m1))
    rest_mb = extra_mb_shallow / (m2 - m1) - l1 * block_mb
    block_step = (t[(l2, m1)] - t[(l1, m1)]) / (l2 - l1) - m1 * block_mb
    rest_step = t[(l1, m1)] - l1 * (m1 * block_mb + block_step) - m1 * rest_mb
    return {"block_microbatch_s": block_mb, "block_step_s": block_step, "rest_microbatch_s": rest_mb,
            "rest_step_s": rest_step}


def _process_group(device: str) -> bool:
    """Start a one-rank process group where none is (the executor needs one); True if started here."""
    import torch.distributed as dist
    if dist.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return True


def executor_host(device: str, *, probes: dict | None = None, steps: int = 5, warmup: int = 3) -> dict:
    """Per regime: the four timed steps and the host seconds ``solve`` gives. A probe that fails is
    recorded with its error, not raised."""
    import torch.distributed as dist
    started = _process_group(device)
    out: dict = {"model": "probe_spec (executor/profile/host.py): hidden 256, 64 tokens, batch 1",
                 "depths": [list(d) for d in DEPTHS], "steps": steps, "warmup": warmup, "regimes": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, knobs in (probes or PROBES).items():
                row: dict = {**knobs}
                try:
                    t = {}
                    for blocks, micro in DEPTHS:
                        spec = probe_spec(blocks, knobs.get("experts", 0))
                        path = _plan_path(spec, zero=knobs["zero"], recompute=knobs["recompute"], micro=micro,
                                          device=device, tmp=Path(tmp))
                        t[(blocks, micro)] = _step_s(path, device, steps, warmup)
                    row.update(times_s={f"{b}x{m}": s for (b, m), s in t.items()}, **solve(t))
                except Exception as err:           # a regime the device cannot run is a result
                    row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
                out["regimes"][name] = row
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
    result = executor_host(device)
    result["command"] = "python -m executor.profile.host " + " ".join(sys.argv[1:])
    for name, row in result["regimes"].items():
        print(f"{name:6} " + (f"per block: {row['block_microbatch_s'] * 1e6:8.1f} us a micro-batch, "
                              f"{row['block_step_s'] * 1e6:8.1f} us a step; the rest: "
                              f"{row['rest_microbatch_s'] * 1e6:8.1f} us a micro-batch, "
                              f"{row['rest_step_s'] * 1e6:8.1f} us a step"
                              if "error" not in row else row["error"]), flush=True)
    if args.merge:
        raw = json.loads(Path(args.merge).read_text())
        raw["device"]["kernels"]["executor_host"] = result
        result = raw
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
