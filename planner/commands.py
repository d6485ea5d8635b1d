"""What the CLI subcommands do: read inputs, call the library, print."""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import replace

from . import schedules
from .cluster import GiB, builtin_profiles, load_cluster
from .config import ParallelConfig, Workload
from .describe import describe_config, gib, runs
from .errors import NoFeasiblePlan, UserError
from .layers import LayerGraph, build_layer_graph
from .model import ALIASES, ZOO, load_model
from .explain import fixes_for_no_fit, gains, limits, lost_on
from .plan import Plan, config_json
from .recompute import expand_recompute
from .search import Candidate, SearchResult, default_solver, evaluate, search
from .search.space import Knobs
from .simulate import simulated_estimate
from .trace.load import is_traced_source, load_traced_model
from .trace.measured import attach_measured_ops

KNOB_NAMES = ("dp", "tp", "pp", "cp", "zero", "micro_batch", "vpp", "schedule", "recompute", "sequence_parallel",
              "optimizer_offload")


def default_global_batch(seq_len: int, gpus: int) -> int:
    """About 2^20 tokens per step, rounded up to a multiple of the GPUs."""
    sequences = max(1, round(2**20 / seq_len))
    return max(gpus, math.ceil(sequences / gpus) * gpus)


def default_precision(cluster) -> str:
    for dtype in ("bf16", "fp16", "fp32"):
        if dtype in cluster.device.dtypes:
            return dtype
    return cluster.device.dtypes[0]


def load_inputs(args):
    """(spec, graph, cluster, workload) from the parsed flags; spec is None for a traced module."""
    if is_traced_source(args.model):        # --model file.py:factory / package.module:factory
        spec, graph = None, load_traced_model(args.model, getattr(args, "example_input", None))
    else:
        spec = load_model(args.model, seq_len=args.seq_len)
        graph = build_layer_graph(spec)
    cluster = load_cluster(args.cluster, args.gpus)
    precision = args.precision or default_precision(cluster)
    if precision not in cluster.device.dtypes:
        raise UserError(f"{cluster.name}'s {cluster.device.name} has no {precision} peak; "
                        f"allowed: {', '.join(cluster.device.dtypes)}", field="--precision")
    seq = spec.seq_len if spec else (args.seq_len or graph.seq_len)
    if spec is None:                        # measured op times beside the profile (meshplan profile --ops)
        graph = attach_measured_ops(graph, cluster.source, precision, seq)
        for warning in graph.warnings:
            sys.stderr.write(f"meshplan: warning: {warning}\n")
    global_batch = args.global_batch or default_global_batch(seq, cluster.num_gpus)
    workload = Workload(global_batch=global_batch, seq_len=seq, precision=precision, framework=args.framework,
                        attention=args.attention, overlap_grad_reduce=not args.no_overlap_grad_reduce,
                        tp_comm_overlap=args.tp_comm_overlap)
    return spec, graph, cluster, workload


def _knobs(args) -> Knobs:
    knobs = Knobs(**{name: getattr(args, name) for name in KNOB_NAMES})
    if getattr(args, "offload", None) is not None:      # --offload none|optimizer, the earlier name
        if args.optimizer_offload is not None and args.optimizer_offload != (args.offload == "optimizer"):
            raise UserError("--offload is the earlier name of --optimizer-offload; allowed: one of them",
                            field="--offload")
        knobs = replace(knobs, optimizer_offload=args.offload == "optimizer")
    return knobs


def _fully_fixed(knobs: Knobs, workload: Workload, num_gpus: int, graph: LayerGraph) -> ParallelConfig | None:
    """A ParallelConfig when every knob that matters is given (dp may be implied); ``every-K`` expanded
    into the per-layer policies of ``graph``."""
    k = knobs
    if None in (k.tp, k.pp, k.micro_batch, k.zero, k.recompute):
        return None
    cp = k.cp or 1
    dp = k.dp if k.dp is not None else num_gpus // max(1, k.tp * k.pp * cp)
    schedule = k.schedule or schedules.default_for(k.vpp)
    if k.pp > 1 and k.schedule is None and k.vpp is None:
        return None
    m = workload.global_batch // max(1, dp * k.micro_batch)
    config = ParallelConfig(dp=dp, tp=k.tp, pp=k.pp, cp=cp, zero=k.zero, micro_batch=k.micro_batch,
                            num_microbatches=max(1, m), vpp=k.vpp or 1, schedule=schedule,
                            sequence_parallel=bool(k.sequence_parallel), optimizer_offload=bool(k.optimizer_offload))
    return expand_recompute(config, k.recompute, graph)


def fixed_result(graph, cluster, workload: Workload, config: ParallelConfig, seconds: float) -> SearchResult:
    """The SearchResult of one fully fixed config (every knob given): its knobs checked, its step
    simulated, the only candidate."""
    evaluate(graph, cluster, workload, config)                  # checks the knobs
    cand = Candidate(config=config, estimate=simulated_estimate(graph, cluster, workload, config))
    return SearchResult(best=cand, alternatives=(), candidates=1, evaluated=1, seconds=seconds)


def _no_fit_message(result: SearchResult, graph, cluster, workload: Workload, knobs: Knobs) -> str:
    least = result.least_memory
    capacity = cluster.device.memory_bytes / GiB
    if least is None:
        return "no legal configuration exists for these knobs"
    need = least.estimate.memory.total / GiB
    c = least.config
    fixes = fixes_for_no_fit(graph, cluster, workload, knobs, need_bytes=least.estimate.memory.total)
    e = least.estimate
    host = (f" and {e.host_bytes_per_node / GiB:.1f} GiB of host memory per node against "
            f"{e.host_capacity_bytes / GiB:.1f} GiB" if e.host_bytes_per_node > e.host_capacity_bytes else "")
    return (f"no plan fits: the least memory any candidate needs is {need:.1f} GiB per GPU "
            f"(dp {c.dp} tp {c.tp} pp {c.pp} cp {c.cp}, ZeRO-{c.zero}, recompute {c.recompute}, "
            f"optimizer offload {'on' if c.optimizer_offload else 'off'}, micro-batch {c.micro_batch}) against "
            f"{capacity:.1f} GiB{host}; "
            + ("what would change it: " + "; ".join(fixes) if fixes else
               "no single change tried (more GPUs, a shorter sequence, more memory) makes it fit"))


def plan_command(args) -> int:
    t0 = time.perf_counter()
    spec, graph, cluster, workload = load_inputs(args)
    knobs = _knobs(args)
    ilp_solver = args.solver or default_solver()
    fixed = _fully_fixed(knobs, workload, cluster.num_gpus, graph)
    if fixed is not None:
        result = fixed_result(graph, cluster, workload, fixed, time.perf_counter() - t0)
    else:
        solver = "exhaustive" if args.exhaustive else "uniform" if args.uniform_stages else ilp_solver
        if args.exhaustive and args.uniform_stages:
            raise UserError("choose --exhaustive or --uniform-stages, not both", field="--exhaustive")
        result = search(graph, cluster, workload, knobs, top_k=args.top_k, solver=solver,
                        time_limit_s=args.time_limit, progress=_progress_bar() if not args.json else None)
        if result.best is None:
            raise NoFeasiblePlan(_no_fit_message(result, graph, cluster, workload, knobs))
    plan = Plan.from_search(result, model_name=spec.name if spec else graph.name, model_source=args.model, spec=spec,
                            graph=graph, cluster=cluster, workload=workload, seconds=time.perf_counter() - t0,
                            solver="exhaustive" if args.exhaustive else ilp_solver)
    if args.out:
        try:
            plan.write(args.out)
        except OSError as e:
            raise UserError(f"cannot write: {e.strerror}", source=args.out) from None
    if args.report:
        from .report import write_report
        try:
            write_report(plan, args.report)
        except OSError as e:
            raise UserError(f"cannot write the report: {e.strerror}", source=args.report) from None
    if args.json:
        json.dump(plan.to_json(), sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_plan(plan))
    return 0


def _progress_bar():
    """A one-line progress indicator on stderr for searches that take more than a moment."""
    if not sys.stderr.isatty():
        return None
    start = time.perf_counter()

    def show(done: int, total: int) -> None:
        if time.perf_counter() - start > 1.0 and total:
            sys.stderr.write(f"\rsearching: {done}/{total} layouts")
            if done + 1 >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()
    return show


def format_plan(plan: Plan) -> str:
    c, e, w = plan.best.config, plan.best.estimate, plan.workload
    mem = e.memory
    t = e.time
    lines = [
        f"{plan.model_name} ({plan.model_params / 1e9:.2f}B params) on {plan.cluster.name} x {plan.cluster.num_gpus} "
        f"GPUs: {w.global_batch} sequences x {w.seq_len} tokens per step, {w.precision}, {w.framework} runtime",
        "",
        f"plan      {describe_config(c)}",
        f"step      {e.step_time_s:.3f} s   {e.tokens_per_s:,.0f} tokens/s   "
        f"{e.model_tflops_per_gpu:.1f} model TFLOP/s per GPU   MFU {100 * e.mfu:.1f}%",
        f"memory    {gib(mem.total)} of {gib(e.capacity_bytes)} GiB on the most loaded GPU (stage {e.peak_stage}): "
        f"params {gib(mem.params)}, grads {gib(mem.grads)}, optimizer {gib(mem.optimizer)}, "
        f"activations {gib(mem.activations)}, other {gib(mem.other)}"
        + (" (backward frees activations as it writes gradients: the peak holds the larger)"
           if mem.grads_after_activations else "") + ("" if e.fits else "   DOES NOT FIT"),
        f"time      compute {t.compute:.3f} s, recompute {t.recompute:.3f}, TP comm {t.tp_comm:.3f}, "
        f"CP comm {t.cp_comm:.3f}, PP comm {t.pp_comm:.3f}, bubble {t.bubble:.3f}, DP comm {t.dp_comm:.3f}, "
        f"optimizer {t.optimizer:.3f}",
    ]
    won = gains(plan.graph, plan.cluster, plan.workload, c, e)
    if c.stage_layers and c.pp > 1:
        lines.append(f"stages    layers per virtual stage {runs(c.stage_layers)} (embedding first, head last)")
    if "non_uniform_stages" in won:
        g = won["non_uniform_stages"]
        lines.append(f"          unequal stages save {g['saved_s']:.3g} s per step ({g['saved_pct']:.1f}%) against "
                     f"balanced ones" + ("" if g["balanced_fits"] else ", which would not even fit"))
    if "partial_recompute" in won:
        g = won["partial_recompute"]
        lines.append(f"recompute {g['recomputed_layers']} of {g['blocks']} blocks: {g['saved_s']:.3g} s per step "
                     f"({g['saved_pct']:.1f}%) faster than recomputing every block")
    lines.append(f"limits    {limits(c, e, plan.cluster)}")
    lines.append(f"checked   {plan.accuracy().line()}")
    if plan.alternatives:
        lines += ["", "runners-up (the best plan of each other layout)"]
        for alt in plan.alternatives:
            lines.append(f"  {describe_config(alt.config)}")
            lines.append(f"      lost on: {lost_on(e, alt.estimate)}")
    lines += ["", f"searched {plan.candidates:.3g} candidates ({plan.groups:,} global choices, "
                  f"{plan.ilp_solves} stage ILPs, {plan.evaluated:,} estimated in full) in {plan.search_seconds:.2f} s"]
    return "\n".join(lines) + "\n"


def models_command(args) -> int:
    rows = [(name, spec.num_params(), spec) for name, spec in ZOO.items()]
    if args.json:
        json.dump([{"name": n, "params": p, "layers": s.num_layers, "hidden": s.hidden, "heads": s.num_heads,
                    "kv_heads": s.num_kv_heads, "ffn_hidden": s.ffn_hidden, "vocab": s.vocab_size,
                    "seq_len": s.seq_len, "experts": s.num_experts, "source": s.source} for n, p, s in rows],
                  sys.stdout)
        sys.stdout.write("\n")
        return 0
    aliases = {}
    for alias, target in ALIASES.items():
        aliases.setdefault(target, []).append(alias)
    print(f"{'name':<14} {'params':>9} {'layers':>6} {'hidden':>6} {'heads':>9} {'ffn':>6} {'vocab':>7} {'seq':>6}")
    for name, params, s in rows:
        heads = f"{s.num_heads}/{s.num_kv_heads}" if s.num_kv_heads != s.num_heads else str(s.num_heads)
        extra = f"  MoE {s.num_experts}x top-{s.experts_per_token}" if s.is_moe else ""
        also = f"  (also: {', '.join(aliases[name])})" if name in aliases else ""
        print(f"{name:<14} {params / 1e9:>8.2f}B {s.num_layers:>6} {s.hidden:>6} {heads:>9} {s.ffn_hidden:>6} "
              f"{s.vocab_size:>7} {s.seq_len:>6}{extra}{also}")
    print("\nor --model path/to/config.json (Hugging Face model_type gpt2, llama, mistral, qwen2, mixtral)")
    return 0


def clusters_command(args) -> int:
    rows = []
    for name in sorted(builtin_profiles()):
        c = load_cluster(name)
        rows.append(c)
    if args.json:
        json.dump([{"name": c.name, "description": c.description, "gpus_per_node": c.gpus_per_node,
                    "device": c.device.name, "memory_bytes": c.device.memory_bytes,
                    "peak_tflops": {d: f / 1e12 for d, f in c.device.peak_flops},
                    "intra_node_GBps": c.intra.bytes_per_s / 1e9, "nics_per_node": c.nics_per_node,
                    "nic_Gbps": c.nic.bytes_per_s * 8 / 1e9} for c in rows], sys.stdout)
        sys.stdout.write("\n")
        return 0
    print(f"{'name':<10} {'GPU':<24} {'mem GiB':>7} {'TFLOPS':>7} {'per node':>8} {'intra GB/s':>10} {'network':>14}")
    for c in rows:
        peak = max(f for _, f in c.device.peak_flops) / 1e12
        net = f"{c.nics_per_node}x{c.nic.bytes_per_s * 8 / 1e9:.0f} Gb/s" if c.nics_per_node else "-"
        print(f"{c.name:<10} {c.device.name:<24} {c.device.memory_bytes / GiB:>7.1f} {peak:>7.1f} "
              f"{c.gpus_per_node:>8} {c.intra.bytes_per_s / 1e9:>6.0f} {c.fabric:<3.3} {net:>14}")
    print("\nor --cluster path/to/profile.toml (see profiles/*.toml for the format)")
    return 0
