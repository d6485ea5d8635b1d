"""`meshplan run`: train a plan.json with torchrun on seeded synthetic data, measure step time and memory,
print them against the prediction (or build it at full scale and check it: --dry-run). The executor does
the work (executor/); importing this file imports no torch, so bad flags fail before anything starts."""
from __future__ import annotations

import argparse
import json
import sys

from executor.support import DEFAULT_CHECKPOINT_EVERY, DEFAULT_TIMEOUT_S

from ..errors import UserError
from .common import add_debug, int_at_least, positive_int, seconds

non_negative_int = int_at_least(0, "a non-negative integer")

EPILOG = """\
examples:
  meshplan plan --model gpt-1.7b --cluster cpu-gloo --gpus 2 --out plan.json
  meshplan run --plan plan.json --model gpt-1.7b --steps 10              # torchrun, 2 processes
  meshplan run --plan plan.json --model gpt-1.7b --dry-run               # build it at full scale, check it
  meshplan run --plan plan.json --model cfg.json --steps 4 --save ckpt/
  meshplan run --plan other.json --model cfg.json --steps 4 --load ckpt/ # resume under another plan
  meshplan run ... --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29500  # on each of 2 machines
  meshplan run --plan plan.json --model cfg.json --steps 1000 --checkpoint-dir ckpt/ \\
               --checkpoint-every 50 --max-restarts 3    # a rank that dies: restart, resume from ckpt/
"""


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a plan.json with torchrun and measure it",
                              description="Train a plan on seeded synthetic data with torch.distributed, "
                                          "measure step time and memory, write measured.json.",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True, help="plan.json written by `meshplan plan --out`")
    p.add_argument("--model", required=True, help="the model the plan is for: zoo name or config.json")
    p.add_argument("--steps", type=positive_int, help="optimizer steps (required unless --dry-run)")
    p.add_argument("--dry-run", action="store_true",
                   help="build the job at its full world size in this process (fake process group, meta device), "
                        "one representative rank per pipeline stage, check every parameter's placement and shard "
                        "shape against the plan and print per-rank parameter, gradient and optimizer bytes against "
                        "the prediction; no training, no torchrun")
    p.add_argument("--nproc", type=positive_int, help="processes on this machine (default: the plan's GPUs / nnodes)")
    p.add_argument("--nnodes", type=positive_int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", help="host:port of the rendezvous, for several machines")
    p.add_argument("--seed", type=int, default=0, help="data and initialisation seed (default 0)")
    p.add_argument("--save", metavar="DIR", help="save a checkpoint after the last step")
    p.add_argument("--load", metavar="DIR", help="resume from a checkpoint (any plan's)")
    f = p.add_argument_group("failures (a rank that dies, a peer that is lost)")
    f.add_argument("--checkpoint-dir", metavar="DIR",
                   help="restartable run: resume from DIR's latest complete checkpoint (if any), checkpoint "
                        "into DIR atomically every --checkpoint-every steps and after the last; --steps is "
                        "then the run's total; the same command again continues it")
    f.add_argument("--checkpoint-every", type=positive_int, metavar="K",
                   help=f"steps between checkpoints (default {DEFAULT_CHECKPOINT_EVERY}; needs --checkpoint-dir)")
    f.add_argument("--max-restarts", type=non_negative_int, default=0, metavar="N",
                   help="restart the job up to N times when a rank fails (torchrun's elastic agent; with "
                        "--checkpoint-dir each restart resumes from the last complete checkpoint; default 0)")
    f.add_argument("--timeout", type=seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"longest a collective waits for a peer before the job ends with an error "
                        f"(default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--out", default="measured.json", help="where to write measured.json (default ./measured.json)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_debug(p)


def run(args) -> int:
    """Check the plan against --model and this executor, then dry-run it or launch it with torchrun (the
    executor: executor/launch.py, executor/dryrun.py); print predicted against measured."""
    from executor.integrity import check_model
    from executor.plan_file import load_plan, warn_if_other_version
    plan = check_model(load_plan(args.plan), args.model)
    warn_if_other_version(plan)
    if args.dry_run:
        return _dry_run(args, plan)
    if args.steps is None:
        raise UserError("required unless --dry-run: the optimizer steps to run", field="--steps")
    from executor.launch import Launch, RunRequest, run_plan
    request = RunRequest(model=args.model, steps=args.steps, seed=args.seed, save=args.save, load=args.load,
                         checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                         timeout_s=args.timeout, out=args.out,
                         launch=Launch(nproc=args.nproc or plan.world_size // args.nnodes, nnodes=args.nnodes,
                                       node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                                       max_restarts=args.max_restarts))
    code, measured = run_plan(plan, args.plan, request, debug=getattr(args, "debug", False))
    if code != 0:
        return code if code < 128 else 1
    if measured is None:
        return 0        # another node: rank 0 (on node 0) writes measured.json
    if args.json:
        json.dump(summary(measured), sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_measured(measured))
        sys.stdout.write(f"wrote {args.out}\n")
    return 0


def _dry_run(args, plan) -> int:
    """The job of ``plan`` built for its GPUs at full scale, checked, not run (executor/dryrun.py)."""
    from executor.dryrun import dry_run, format_dry_run
    reports, seconds = dry_run(plan, "cuda")
    if args.json:
        json.dump({"seconds": seconds, "ranks": [r.to_json() for r in reports]}, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_dry_run(plan, reports, seconds))
    return 1 if any(r.problems for r in reports) else 0


def summary(measured: dict) -> dict:
    return {"losses": measured["losses"], "step_time_s": measured["step_time_s"],
            "memory_per_rank_bytes": measured["memory_per_rank_bytes"], "predicted": measured["predicted"],
            "resumed_from": measured.get("resumed_from", 0), "restart": measured.get("restart", 0)}


def format_measured(measured: dict) -> str:
    """Predicted against measured: step time, and each rank's memory by category."""
    pred = measured["predicted"]
    lines = [f"losses    {' '.join(f'{x:.4f}' for x in measured['losses'])}"]
    if measured["step_time_s"] is None:
        lines.append(f"no step ran: the checkpoint resumed from already holds all {measured['resumed_from']} steps")
        return "\n".join(lines) + "\n"
    p_time = pred.get("step_time_s")
    err = f" ({100 * (measured['step_time_s'] / p_time - 1):+.0f}%)" if p_time else ""
    lines.append(f"step time predicted {p_time if p_time is None else f'{p_time:.4f}'} s, "
                 f"measured {measured['step_time_s']:.4f} s{err}")
    lines.append(f"{'rank':>4} {'stage':>5}  {'category':<12} {'predicted B':>14} {'measured B':>14} {'error':>7}")
    stages = pred.get("memory_per_stage_bytes") or []
    for rank in measured["memory_per_rank_bytes"]:
        want = stages[rank["pp_rank"]] if rank["pp_rank"] < len(stages) else {}
        for key in ("params", "grads", "optimizer", "activations"):
            got, exp = rank[key], want.get(key)
            error = f"{100 * (got / exp - 1):+6.1f}%" if exp else "     -"
            lines.append(f"{rank['rank']:>4} {rank['pp_rank']:>5}  {key:<12} {exp if exp is not None else '-':>14} "
                         f"{got:>14} {error:>7}")
        if rank["params_gathered"]:
            lines.append(f"{rank['rank']:>4} {rank['pp_rank']:>5}  {'(gathered)':<12} {'':>14} "
                         f"{rank['params_gathered']:>14}")
        if rank.get("peak_allocated") is not None and want.get("total") is not None:
            # everything the rank allocated at its peak (CUDA's max_memory_allocated; on the CPU the profiler's
            # allocation events, executor/measure.py AllocationPeak) against the stage's total without the
            # runtime's reserve, which no allocator counter sees
            exp, got = want["total"] - want.get("reserve", 0), rank["peak_allocated"]
            lines.append(f"{rank['rank']:>4} {rank['pp_rank']:>5}  {'peak':<12} {exp:>14} {got:>14} "
                         f"{100 * (got / exp - 1):+6.1f}%")
        host = sum(rank.get("host", {}).values())
        if host:            # optimizer offload: model states in host memory, apart from the GPU's
            lines.append(f"{rank['rank']:>4} {rank['pp_rank']:>5}  {'(host)':<12} {'':>14} {host:>14}")
    return "\n".join(lines) + "\n"
