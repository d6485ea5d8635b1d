"""`meshplan run`: train a plan.json with torchrun on seeded synthetic data, measure step time and memory,
print them against the prediction (or build it at full scale and check it: --dry-run). The executor does
the work (executor/); importing this file imports no torch, so bad flags fail before anything starts."""
from __future__ import annotations

import argparse
import json
import sys

from executor.launch import RDZV_CONF
from executor.support import DEFAULT_CHECKPOINT_EVERY, DEFAULT_TIMEOUT_S

from ..errors import UserError
from .common import add_debug, int_at_least, positive_int, seconds

non_negative_int = int_at_least(0, "a non-negative integer")
ELASTIC_RESTARTS = 3        # --max-restarts with --elastic: three nodes lost (torchrun's documented elastic example)

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
  meshplan run --plan plan.json --model cfg.json --steps 1000 --checkpoint-dir /shared/ckpt \\
               --elastic 1:4 --nproc 8 --rdzv-endpoint host0:29400   # the same on each node, 1 to 4 of them

elastic runs (--elastic MIN:MAX): torchrun's elastic agent on each node, c10d rendezvous at
--rdzv-endpoint; the job runs on the nodes there are, from MIN to MAX. When a node leaves (one of
--max-restarts) or joins, every process restarts, sees that the world differs from the plan's, plans
the same job again for the processes it has (same model, cluster profile, global batch, sequence
length and fixed knobs; those the new world cannot hold are searched), loads the latest checkpoint
resharded into the new plan and goes on at the next step. Each change is written to
DIR/plan-changes.json and printed at the end. If no plan fits the processes left, the run stops with
one line naming the fewest GPUs that fit (exit code 3); the checkpoint is kept.
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
                        "the prediction (exit 1 where a placement differs or a rank holds more than 5%% above the "
                        "predicted gradients or optimizer states); no training, no torchrun")
    p.add_argument("--nproc", type=positive_int,
                   help="processes on this machine (default: the plan's GPUs / --nnodes, or / MAX with --elastic)")
    p.add_argument("--nnodes", type=positive_int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="the rendezvous, for several machines or --elastic: the same on every node")
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
    f.add_argument("--max-restarts", type=non_negative_int, metavar="N",
                   help="restart the job up to N times when a rank fails (torchrun's elastic agent; with "
                        "--checkpoint-dir each restart resumes from the last complete checkpoint; default 0, "
                        f"with --elastic {ELASTIC_RESTARTS}: each node lost takes one, a node joining none)")
    f.add_argument("--elastic", type=node_range, metavar="MIN:MAX",
                   help="go on with MIN to MAX nodes as nodes leave and join, re-planning for the processes there "
                        "are (torchrun's --nnodes MIN:MAX, c10d rendezvous; needs --checkpoint-dir on a file "
                        "system every node sees and --rdzv-endpoint; --nproc is per node)")
    f.add_argument("--rdzv-conf", type=rdzv_conf, metavar="KEY=VALUE,...",
                   help=f"the rendezvous's settings (torchrun's --rdzv-conf): {', '.join(RDZV_CONF)}; seconds, "
                        "but keep_alive_max_attempt (a count) and is_host (1 or 0). A node lost is seen after "
                        "keep_alive_interval x keep_alive_max_attempt (default 5 x 3 s), and the rendezvous waits "
                        "last_call_timeout (default 30 s) for more nodes: shorter values resume sooner")
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
    nodes = args.elastic[1] if args.elastic else args.nnodes
    restarts = args.max_restarts if args.max_restarts is not None else ELASTIC_RESTARTS if args.elastic else 0
    request = RunRequest(model=args.model, steps=args.steps, seed=args.seed, save=args.save, load=args.load,
                         checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                         timeout_s=args.timeout, out=args.out,
                         launch=Launch(nproc=args.nproc or max(1, plan.world_size // nodes), nnodes=args.nnodes,
                                       node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                                       max_restarts=restarts, elastic=args.elastic, rdzv_conf=args.rdzv_conf or ""))
    code, measured, changes = run_plan(plan, args.plan, request, debug=getattr(args, "debug", False))
    if code != 0:
        return code if code < 128 else 1
    if args.json:
        doc = {**(summary(measured) if measured else {}), **({"plan_changes": changes} if args.elastic else {})}
        if doc:
            json.dump(doc, sys.stdout)
            sys.stdout.write("\n")
        return 0
    sys.stdout.write("".join(format_change(c) for c in changes))
    if measured is not None:        # else another node: rank 0 (on node 0, or where the rendezvous put it) wrote it
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
    return 1 if any(r.problems or r.over_plan() for r in reports) else 0


def summary(measured: dict) -> dict:
    return {"losses": measured["losses"], "step_time_s": measured["step_time_s"],
            "memory_per_rank_bytes": measured["memory_per_rank_bytes"], "predicted": measured["predicted"],
            "resumed_from": measured.get("resumed_from", 0), "restart": measured.get("restart", 0),
            **({"world_sizes": measured["world_sizes"]} if "world_sizes" in measured else {})}


def node_range(text: str) -> tuple[int, int]:
    """'1:4' -> (1, 4): the fewest and most nodes of an elastic run (torchrun's --nnodes MIN:MAX)."""
    low, colon, high = text.partition(":")
    if not colon or not low.isdigit() or not high.isdigit() or not 1 <= int(low) <= int(high):
        raise argparse.ArgumentTypeError(f"expected MIN:MAX nodes with 1 <= MIN <= MAX (e.g. 1:4), got {text!r}")
    return int(low), int(high)


def rdzv_conf(text: str) -> str:
    from executor.launch import parse_rdzv_conf
    try:
        return parse_rdzv_conf(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(e.detail) from None


def format_change(change: dict) -> str:
    """One change of plan of an elastic run (an entry of DIR/plan-changes.json, executor/elastic.py)."""
    from ..config import ParallelConfig
    from ..describe import describe_config
    old, new = change["from"], change["to"]
    ratio = new["step_time_s"] / old["step_time_s"] - 1 if old["step_time_s"] else None
    lost = change.get("lost_s")
    lines = [f"plan change at step {change['step']}: {old['world_size']} -> {new['world_size']} processes",
             f"  before  {describe_config(ParallelConfig.from_json(old['config']))}; predicted "
             f"{old['step_time_s']:.4g} s per step ({old['plan']})",
             f"  after   {describe_config(ParallelConfig.from_json(new['config']))}; predicted "
             f"{new['step_time_s']:.4g} s per step" + (f" ({100 * ratio:+.0f}%)" if ratio is not None else "")
             + f" ({new['plan']})",
             "  lost    " + (f"{lost:.1f} s from the checkpoint of step {change['step']} to the first step under the "
                             "new plan" if lost is not None else "no checkpoint before the change")
             + f": {change['steps_redone']} step(s) run again"
             + (f", {change['idle_s']:.1f} s with no step running" if change.get("idle_s") is not None else "")
             + f", re-plan {change['replan_s']:.2f} s"]
    lines += [f"  note    {note}" for note in change.get("searched_instead", ())]
    return "\n".join(lines) + "\n"


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
