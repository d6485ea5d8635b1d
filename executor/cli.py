"""The `meshplan run` subcommand (registered by planner/cli.py, which imports this lazily)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from planner.cli import _positive_int
from planner.errors import UserError

from .launch import Launch, check_model, launch
from .plan_file import load_plan

EPILOG = """\
examples:
  meshplan plan --model gpt-1.7b --cluster cpu-gloo --gpus 2 --out plan.json
  meshplan run --plan plan.json --model gpt-1.7b --steps 10              # torchrun, 2 processes
  meshplan run --plan plan.json --model cfg.json --steps 4 --save ckpt/
  meshplan run --plan other.json --model cfg.json --steps 4 --load ckpt/ # resume under another plan
  meshplan run ... --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29500  # on each of 2 machines
"""


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run", help="run a plan.json with torchrun and measure it",
                              description="Train a plan on seeded synthetic data with torch.distributed, "
                                          "measure step time and memory, write measured.json.",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True, help="plan.json written by `meshplan plan --out`")
    p.add_argument("--model", required=True, help="the model the plan is for: zoo name or config.json")
    p.add_argument("--steps", type=_positive_int, required=True, help="optimizer steps")
    p.add_argument("--nproc", type=_positive_int, help="processes on this machine (default: the plan's GPUs / nnodes)")
    p.add_argument("--nnodes", type=_positive_int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", help="host:port of the rendezvous, for several machines")
    p.add_argument("--seed", type=int, default=0, help="data and initialisation seed (default 0)")
    p.add_argument("--save", metavar="DIR", help="save a checkpoint after the last step")
    p.add_argument("--load", metavar="DIR", help="resume from a checkpoint (any plan's)")
    p.add_argument("--out", default="measured.json", help="where to write measured.json (default ./measured.json)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def summary(measured: dict) -> dict:
    return {"losses": measured["losses"], "step_time_s": measured["step_time_s"],
            "memory_per_rank_bytes": measured["memory_per_rank_bytes"], "predicted": measured["predicted"]}


def format_comparison(measured: dict) -> str:
    """Predicted against measured: step time, and each rank's memory by category."""
    pred = measured["predicted"]
    lines = [f"losses    {' '.join(f'{x:.4f}' for x in measured['losses'])}"]
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
    return "\n".join(lines) + "\n"


def run_command(args) -> int:
    plan = check_model(load_plan(args.plan), args.model)
    nproc = args.nproc or plan.world_size // args.nnodes
    if nproc * args.nnodes != plan.world_size:
        raise UserError(f"{args.nnodes} node(s) x {nproc} processes = {nproc * args.nnodes}, but the plan needs "
                        f"{plan.world_size} (dp x tp x pp x cp)", field="--nproc")
    out = Path(args.out)
    out.unlink(missing_ok=True)
    train_args = ["--plan", args.plan, "--model", args.model, "--steps", str(args.steps), "--seed", str(args.seed),
                  "--out", str(out)]
    for flag, value in (("--save", args.save), ("--load", args.load)):
        if value:
            train_args += [flag, value]
    code = launch(Launch(nproc=nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                         rdzv_endpoint=args.rdzv_endpoint), train_args)
    if code != 0:
        sys.stderr.write(f"meshplan run: torchrun exited with code {code}\n")
        return code if code < 128 else 1
    if args.node_rank != 0:
        return 0        # rank 0 (on node 0) writes measured.json
    measured = json.loads(out.read_text())
    if args.json:
        json.dump(summary(measured), sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_comparison(measured))
        sys.stdout.write(f"wrote {out}\n")
    return 0
