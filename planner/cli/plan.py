"""`meshplan plan`: find the fastest plan that fits (or estimate a fixed one), print it, write it."""
from __future__ import annotations

import argparse
import json
import sys

from ..finetune import describe as describe_mode
from .. import api
from ..accuracy import Accuracy
from ..config import COMPILE_PRICED_AS
from ..describe import describe_config, gib, runs
from ..energy import Energy
from ..explain import gain_sentences, headroom_words, ranking_sentence, schedule_sentence
from ..errors import UserError
from ..runtimes import EXECUTOR_RUNTIME, unbuilt
from ..plan import Plan
from .common import (RECOMPUTE_HELP, SCHEDULE_HELP, add_debug, add_job_args, add_knob_args, hours, job_inputs,
                     knobs, positive_int, search_progress, token_count, warn)

EPILOG = """\
examples:
  meshplan plan                                   # Llama-3 8B on one DGX H100 node, everything searched
  meshplan plan --model gpt3-175b --cluster a100-80g --gpus 1024 --global-batch 1536
  meshplan plan --model llama3-70b --gpus 64 --tp 8 --pp 4      # fix some knobs, search the rest
  meshplan plan --model path/to/config.json --cluster my-cluster.toml --gpus 16 --json
  meshplan plan --model gpt-1.7b --cluster a100-80g --gpus 32 --dp 32 --tp 1 --pp 1 \\
                --micro-batch 4 --recompute full --zero 0      # fully fixed: just estimate it
  meshplan plan --model llama2-70b --cluster a100-80g --global-batch 64 --seq-len 4096 --fit-min
                                                  # the fewest GPUs (and host memory) the job fits on

Knobs you leave out are searched: dp, tp, pp, cp (data, tensor, pipeline, context
parallel degrees), --zero, --micro-batch, --vpp, --schedule, --recompute,
--sequence-parallel, --optimizer-offload (--param-offload, DeepSpeed's, only when given).
--framework names the runtime that will train: the search offers only what it expresses.
A fully fixed plan that does not fit is still reported, with "fits": false. Exit codes:
0 ok, 2 bad input, 3 nothing fits.

""" + RECOMPUTE_HELP + "\n" + SCHEDULE_HELP


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="find the fastest plan that fits (or estimate a fixed one)",
                       description="Find the fastest hybrid-parallel plan that fits in memory, or estimate a "
                                   "fixed one.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(p)
    add_knob_args(p)
    p.add_argument("--top-k", type=positive_int, default=5, help="runners-up to keep (default 5)")
    p.add_argument("--solver", choices=("cbc", "highs"), default=None,
                   help="ILP solver for stage sizes, per-layer recompute, ZeRO and optimizer offload (default: highs "
                        "where highspy is installed, as it is with meshplan: it solves in-process; else cbc, which "
                        "ships with PuLP). Both find the same optimum")
    p.add_argument("--exhaustive", action="store_true",
                   help="enumerate every stage split and recompute assignment instead of the ILP (the "
                        "reference solver: exact and slow, for small models)")
    p.add_argument("--uniform-stages", action="store_true",
                   help="only balanced stages with one recompute policy for every layer (as Megatron-LM runs)")
    p.add_argument("--time-limit", type=float, default=20.0, metavar="SECONDS",
                   help="time limit of each stage ILP (default 20)")
    p.add_argument("--prefer", choices=("headroom", "fastest"), default="headroom",
                   help="among plans within the model's step-time error of the fastest (the validation's median), "
                        "recommend one with no more modelled mechanisms and more memory left, where there is one "
                        "(headroom, the default), or always the fastest by the model")
    p.add_argument("--tokens", type=token_count, metavar="N",
                   help="a training run's tokens (300B, 1.5T, 2e12): the energy line adds the run's total")
    p.add_argument("--fit-min", action="store_true",
                   help="find the fewest GPUs of the cluster the job fits on instead of planning a given count: one "
                        "node's 1, 2, 4, ... GPUs, then whole nodes (doubling, then every count in between); prints "
                        "the plan there and the host memory per node it needs. The global batch stays the given one "
                        "(default: one node's). Leave --gpus out")
    p.add_argument("--fit-limit", type=positive_int, default=65536, metavar="GPUS",
                   help="with --fit-min: the most GPUs to try (default 65536)")
    p.add_argument("--node-mtbf", type=hours, metavar="HOURS",
                   help="with --report: a node's mean time between failures, for the checkpoint interval that loses "
                        "least work (Young 1974, Daly 2006; default 6,335 h, Llama 3 405B's pre-training: 419 "
                        "unexpected interruptions in 54 days on 2,048 nodes)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--out", metavar="PLAN.json", help="also write plan.json (the executor's input)")
    p.add_argument("--report", metavar="DIR", help="also write a strategy report into DIR: plan.json, report.md, "
                                                   "report.html, plots (PNG, SVG) and exports for other frameworks")
    add_debug(p)


def run(args) -> int:
    if args.exhaustive and args.uniform_stages:
        raise UserError("choose --exhaustive or --uniform-stages, not both", field="--exhaustive")
    solver = "exhaustive" if args.exhaustive else "uniform" if args.uniform_stages else args.solver
    inputs = job_inputs(args)
    if args.fit_min:
        return _fit_min(args, inputs)
    plan = api.plan_precisions(inputs, knobs(args), warn=warn, top_k=args.top_k, solver=solver,
                               time_limit_s=args.time_limit, progress=None if args.json else search_progress(),
                               prefer=args.prefer)
    parts = unbuilt(plan.spec) if plan.spec is not None and plan.workload.framework == EXECUTOR_RUNTIME else []
    if parts:
        warn(f"`meshplan run` cannot train {plan.spec.name} yet ({', '.join(what for _, what in parts)} are not in "
             "its reference models): this plan prices meshplan's runtime; --framework megatron plans it for "
             "Megatron-LM")
    if args.out:
        try:
            plan.write(args.out)
        except OSError as e:
            raise UserError(f"cannot write: {e.strerror}", source=args.out) from None
    if args.report:
        from ..report import write_report
        try:
            write_report(plan, args.report, node_mtbf_h=args.node_mtbf)
        except OSError as e:
            raise UserError(f"cannot write the report: {e.strerror}", source=args.report) from None
    if args.json:
        doc = plan.to_json()
        if args.tokens and doc["energy"]:
            doc["energy"] = Energy.from_json(doc["energy"]).to_json(args.tokens)
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_plan(plan, tokens=args.tokens))
    return 0


def _fit_min(args, inputs) -> int:
    """`--fit-min`: the fewest GPUs that fit (planner/fitmin.py), exit 3 where none up to --fit-limit does."""
    from ..fitmin import fit_min
    if args.gpus is not None:
        raise UserError("--fit-min searches the number of GPUs; allowed: leave --gpus out (--fit-limit caps it)",
                        field="--gpus")
    for flag in ("out", "report"):
        if getattr(args, flag):
            raise UserError(f"--{flag} writes one plan; allowed with --fit-min: none (plan again with --gpus N)",
                            field=f"--{flag}")

    def progress(n: int, result: str) -> None:
        if not args.json:
            sys.stderr.write(f"meshplan: {n} GPUs: {result}\n")
    from dataclasses import replace
    from ..cluster import load_cluster
    from ..runtimes import RUNTIMES
    if args.finetune:
        modes = [args.finetune]
    else:               # each training mode the runtime runs on the cluster's devices (planner/runtimes.py)
        modes = list(RUNTIMES[inputs.framework].on(load_cluster(inputs.cluster, None).device_kind).finetune_modes)
    results = {}
    for mode in modes:
        if not args.json and len(modes) > 1:
            sys.stderr.write(f"meshplan: --finetune {mode}\n")
        results[mode] = fit_min(replace(inputs, finetune=mode), knobs(args), limit=args.fit_limit,
                                progress=progress)
    if args.json:
        doc = results[modes[0]].to_json() if len(modes) == 1 else {m: r.to_json() for m, r in results.items()}
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write("\n".join(format_fit_min(r) for r in results.values()))
    return 0 if any(r.plan is not None for r in results.values()) else 3


def format_fit_min(found) -> str:
    from ..finetune import describe as describe_finetune
    tried = ", ".join(f"{n} {r}" for n, r in found.tried)
    if found.plan is None:
        return f"nothing fits on up to {found.limit} GPUs (tried: {tried})\n"
    plan = found.plan
    e, w = plan.best.estimate, plan.workload
    nodes = -(-plan.world_size // found.gpus_per_node)
    host = (f"{gib(e.host_bytes_per_node)} of {gib(e.host_capacity_bytes)} GiB of host memory per node"
            if e.host_bytes_per_node else "no host memory beyond the runtime's") + (
        f", {gib(e.nvme_bytes_per_node)} of {gib(e.nvme_capacity_bytes)} GiB of NVMe per node"
        if e.nvme_bytes_per_node else "")
    return "\n".join([
        f"{plan.model_name} ({plan.model_params / 1e9:.2f}B params) on {plan.cluster_name}: {w.global_batch} sequences "
        f"x {w.seq_len} tokens per step, {w.precision_name}, {w.framework} runtime"
        + (describe_finetune(w.finetune, w.lora_rank, w.lora_targets) or ", full training"),
        "",
        f"fewest    {plan.world_size} GPUs ({nodes} node(s) of {found.gpus_per_node})",
        f"plan      {describe_config(plan.best.config)}",
        f"step      {e.step_time_s:.3f} s   {e.tokens_per_s:,.0f} tokens/s",
        f"memory    {gib(e.memory.total)} of {gib(e.capacity_bytes)} GiB on the most loaded GPU; {host}",
        f"tried     {tried}",
        "",
    ])


def format_plan(plan: Plan, tokens: float | None = None) -> str:
    c, e, w = plan.best.config, plan.best.estimate, plan.workload
    mem, t = e.memory, e.time
    lines = [
        f"{plan.model_name} ({plan.model_params / 1e9:.2f}B params) on {plan.cluster_name} x {plan.world_size} "
        f"GPUs{f' ({plan.cluster.partial_nodes})' if plan.cluster.partial_nodes else ''}: {w.global_batch} sequences x {w.seq_len} tokens per step, {w.precision_name}, {w.framework} runtime"
        f"{describe_mode(w.finetune, w.lora_rank, w.lora_targets)}"
        + (f"; {COMPILE_PRICED_AS}" if w.compile else ""),
        "",
        f"plan      {describe_config(c)}",
        f"step      {e.step_time_s:.3f} s   {e.tokens_per_s:,.0f} tokens/s   "
        f"{e.model_tflops_per_gpu:.1f} model TFLOP/s per GPU   MFU {100 * e.mfu:.1f}%",
        f"memory    {gib(mem.total)} of {gib(e.capacity_bytes)} GiB on the most loaded GPU (stage {e.peak_stage}; "
        f"{headroom_words(w.memory_headroom, e)}): "
        f"params {gib(mem.params)}, grads {gib(mem.grads)}, optimizer {gib(mem.optimizer)}, "
        f"activations {gib(mem.activations)}, other {gib(mem.other)}"
        + (" (backward frees activations as it writes gradients: the peak holds the larger)"
           if mem.grads_after_activations else "") + ("" if e.fits else "   DOES NOT FIT"),
        *([f"offload   {gib(e.host_bytes_per_node)} of {gib(e.host_capacity_bytes)} GiB of host memory per node "
           f"(swap buffers); {gib(e.nvme_bytes_per_node)} of {gib(e.nvme_capacity_bytes)} GiB of NVMe per node"]
          if c.nvme_offload else []),
        f"time      compute {t.compute:.3f} s, recompute {t.recompute:.3f}, TP comm {t.tp_comm:.3f}, "
        f"CP comm {t.cp_comm:.3f}, " + (f"EP all-to-all {t.ep_comm:.3f}, " if t.ep_comm else "") +
        f"PP comm {t.pp_comm:.3f}, bubble {t.bubble:.3f}, DP comm {t.dp_comm:.3f}, "
        f"optimizer {t.optimizer:.3f}" + (f", waiting for the host {t.host_wait:.3f}" if t.host_wait else ""),
    ]
    if plan.precisions:         # --precision left out and the runtime runs FP8 here: what each precision gave
        tried = ", ".join(f"{n} {s:.3f} s" if s is not None else f"{n} does not fit"
                          for n, s in plan.precisions["tried"].items())
        on_base = plan.precisions.get("on_base_plan") or {}
        base = next(iter(plan.precisions["tried"]))
        also = ("; on " + base + "'s plan: " + ", ".join(f"{n} {s:.3f} s" for n, s in on_base.items())) if on_base else ""
        lines.append(f"precision {plan.precisions['chosen']}: {plan.precisions['why']} (searched: {tried}{also}; "
                     "--precision fixes one)")
    if c.stage_layers and c.pp > 1:
        lines.append(f"stages    layers per virtual stage {runs(c.stage_layers)} (embedding first, head last)")
    lines += [f"gains     {sentence}" for sentence in gain_sentences(plan.gains)]
    schedules = schedule_sentence(plan.gains)
    if schedules:
        lines.append(f"schedule  {schedules}")
    lines.append(f"limits    {plan.limits}")
    lines.append(f"energy    {Energy.from_json(plan.energy).line(tokens)}" if plan.energy else
                 f"energy    not estimated: the {plan.cluster_name} profile has no [power] table")
    lines.append(f"checked   {Accuracy.from_json(plan.accuracy).line()}")
    ranking = ranking_sentence(plan.choice, e, plan.alternatives)
    if ranking:
        lines.append(f"ranking   {ranking}")
    if plan.alternatives:
        lines += ["", "runners-up (the best plan of each other layout)"]
        for alt in plan.alternatives:
            lines.append(f"  {describe_config(alt.config)}")
            lines.append(f"      lost on: {alt.lost_on}")
    s = plan.search
    lines += ["", f"searched {s.line()}"]
    return "\n".join(lines) + "\n"
