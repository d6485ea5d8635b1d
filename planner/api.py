"""The planner as a library: values in, values out.

    from planner import api
    job = api.load_job("llama3-8b", "h100-80g", gpus=8)
    plan = api.plan(job)                       # a Plan: plan.best.config, plan.best.estimate, plan.to_json()
    points = api.whatif(api.JobInputs(model="llama3-70b", cluster="h100-80g"), "gpus", ["64", "128"])
    cmp = api.compare("megatron_args.txt", cluster="a100-80g", gpus=1024)

Every caller goes through these functions: the command line (planner/cli/), the gallery, the
benchmarks and ``executor.auto_parallelize``. They take plain values (a model source, a cluster
source, the workload's numbers, the fixed knobs) and return plain values (a Plan, what-if points,
a Comparison). Bad input raises ``UserError`` naming the flag or field; nothing fits raises
``NoFeasiblePlan`` with the least memory any candidate needs and what would change it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from . import schedules
from .cluster import Cluster, load_cluster
from .config import DEFAULT_MEMORY_HEADROOM, ParallelConfig, Workload
from . import finetune as finetune_modes
from .errors import NoFeasiblePlan, UserError, one_of
from .estimate import Candidate
from .explain import no_fit
from .layers import LayerGraph, build_layer_graph
from .model import ModelSpec, is_zoo_model, load_model
from .plan import Plan
from .precision import DTYPES, RECIPES, library, split as split_precision
from .recompute import expand_recompute
from .runtimes import RUNTIMES, lora_style, unfused_core
from .search import Knobs, SearchResult, default_solver, evaluate, search
from .search.finish import finish

__all__ = ["DEFAULT_CLUSTER", "DEFAULT_MODEL", "Job", "JobInputs", "Knobs", "Plan", "compare", "estimate",
           "fixed_plan", "load_job", "plan", "plan_graph", "whatif"]

DEFAULT_MODEL = "llama3-8b"
DEFAULT_CLUSTER = "h100-80g"


@dataclass(frozen=True, kw_only=True)
class Job:
    """What is planned: the model (its layer graph; its architecture for a config model), the cluster and
    the workload."""

    model_source: str                   # what the model was given as: a zoo name, a config.json, file.py:factory
    spec: ModelSpec | None              # None for a traced module
    graph: LayerGraph
    cluster: Cluster
    workload: Workload

    @property
    def model_name(self) -> str:
        return self.spec.name if self.spec else self.graph.name


@dataclass(frozen=True, kw_only=True)
class JobInputs:
    """The values a Job is loaded from (what `meshplan plan` takes before its knobs); None: the default."""

    model: str = DEFAULT_MODEL          # a zoo name, a Hugging Face config.json, file.py:factory or pkg.mod:factory
    cluster: str = DEFAULT_CLUSTER      # a built-in profile or a profile TOML
    gpus: int | None = None             # default: one node of the cluster
    global_batch: int | None = None     # sequences per step; default about 1M tokens, a multiple of the GPUs
    seq_len: int | None = None          # default: the model's
    precision: str | None = None        # default: bf16, or what the device has
    framework: str = "torch"            # whose memory layout and overlap are modelled (planner/runtimes.py)
    attention: str = "flash"            # "flash" or "unfused"
    overlap_grad_reduce: bool = True
    tp_comm_overlap: bool = False
    ep_comm_overlap: bool = False       # Megatron-Core's overlapped expert all-to-alls (planner/config.py)
    example_input: str | None = None    # SHAPE:DTYPE[,...] for a traced module
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM   # memory a plan leaves free (planner/config.py)
    expert_imbalance: float = 1.0       # the busiest expert rank's tokens over the balanced share (planner/config.py)
    expert_dispatcher: str = "alltoall"     # "alltoall", or Megatron-LM's "allgather" or "flex" (planner/config.py)
    compile: bool = False               # torch: each block torch.compile'd (planner/config.py Workload.compile)
    fp8_param_gather: bool = False      # Megatron-LM's --fp8-param-gather (planner/config.py)
    grad_reduce_in_bf16: bool = False   # Megatron-LM's --grad-reduce-in-bf16 (planner/config.py)
    finetune: str = "full"              # training mode: "full", "lora" or "qlora" (planner/finetune.py)
    lora_rank: int | None = None        # the adapters' rank (None: the runtime's LoRA's, planner/finetune.py STYLES)
    lora_targets: tuple[str, ...] | None = None     # their projections (None: the runtime's LoRA's)

    def load(self, warn: Callable[[str], None] | None = None) -> Job:
        """The Job: the model traced or built, the cluster loaded with its GPUs, the workload with its defaults.
        ``warn`` receives what the measured operator times of a traced module could not cover."""
        from .trace.load import is_traced_source, load_traced_model
        from .trace.measured import attach_measured_ops
        if is_traced_source(self.model):
            spec, graph = None, load_traced_model(self.model, self.example_input)
        else:
            spec = load_model(self.model, seq_len=self.seq_len)
            graph = build_layer_graph(spec)
            if self.seq_len is None and not is_zoo_model(self.model):
                # a config.json says how long a context the model takes, not how long it trains at (Llama 3.1's
                # 131072 after pretraining at 8192: Dubey et al. 2024, Sec 3.4.2); the zoo entries carry their
                # pretraining's
                (warn or (lambda _: None))(
                    f"--seq-len left out: {spec.seq_len}-token sequences, {self.model}'s longest context (its "
                    "max_position_embeddings or n_positions), which may be longer than it trains at; "
                    "pass --seq-len to plan another")
        cluster = load_cluster(self.cluster, self.gpus)
        precision, fp8 = split_precision(self.precision or default_precision(cluster))
        if precision not in cluster.device.dtypes:
            raise UserError(f"{cluster.name}'s {cluster.device.name} has no {precision} peak; "
                            f"allowed: {', '.join(cluster.device.dtypes)}", field="--precision")
        seq = spec.seq_len if spec else (self.seq_len or graph.seq_len)
        if spec is None:                # measured op times beside the profile (meshplan profile --ops)
            graph = attach_measured_ops(graph, cluster.source, precision, seq)
            for warning in graph.warnings:
                (warn or (lambda _: None))(warning)
        attention = priced_attention(spec, self.framework, self.attention, warn)
        workload = Workload(global_batch=self.global_batch or default_global_batch(seq, cluster.num_gpus),
                            seq_len=seq, precision=precision, framework=self.framework, attention=attention,
                            overlap_grad_reduce=self.overlap_grad_reduce, tp_comm_overlap=self.tp_comm_overlap,
                            ep_comm_overlap=self.ep_comm_overlap, memory_headroom=self.memory_headroom,
                            expert_imbalance=self.expert_imbalance,
                            expert_dispatcher=self.expert_dispatcher, compile=self.compile, fp8=fp8,
                            fp8_param_gather=self.fp8_param_gather, grad_reduce_in_bf16=self.grad_reduce_in_bf16,
                            **finetune_fields(self.finetune, self.lora_rank, self.lora_targets, self.framework))
        check_finetune(workload, cluster, spec)
        if self.compile and not RUNTIMES[self.framework].on(cluster.device_kind).compiles_blocks:
            raise UserError(f"the {self.framework} runtime does not compile blocks with torch.compile; allowed with "
                            "--compile: --framework torch or torchtitan", field="--compile")
        if fp8:
            check_fp8(fp8, self.framework, cluster, self.compile)
        if self.grad_reduce_in_bf16 and (self.framework != "megatron" or precision != "bf16"):
            raise UserError("accumulates Megatron-LM's bf16 gradients in bf16; allowed: with --framework megatron "
                            "and --precision bf16 or an FP8 recipe", field="--grad-reduce-in-bf16")
        if self.ep_comm_overlap:
            check_ep_comm_overlap(self.framework, cluster, graph.num_experts, self.expert_dispatcher)
        if self.fp8_param_gather and (not fp8 or library(self.framework) != "te"):
            raise UserError("keeps FP8 parameters of TransformerEngine's linears; allowed: with --framework megatron "
                            "and an FP8 --precision (" + ", ".join(r for r in RECIPES if RECIPES[r].te) + ")",
                            field="--fp8-param-gather")
        return Job(model_source=self.model, spec=spec, graph=graph, cluster=cluster, workload=workload)


def check_ep_comm_overlap(framework: str, cluster, num_experts: int, dispatcher: str) -> None:
    """--ep-comm-overlap where it runs: Megatron-Core's --overlap-moe-expert-parallel-comm, on a mixture of experts
    with the all-to-all dispatcher (megatron/core/transformer/transformer_config.py at 92c8482e), or UserError."""
    if not RUNTIMES[framework].on(cluster.device_kind).ep_comm_overlap:
        runs = [name for name, rt in RUNTIMES.items() if rt.on(cluster.device_kind).ep_comm_overlap]
        raise UserError(f"the {framework} runtime does not overlap expert parallelism's all-to-alls with another "
                        f"micro-batch's compute on {cluster.device_kind}; allowed with --ep-comm-overlap: "
                        f"--framework {' or '.join(runs) or 'none'}", field="--ep-comm-overlap")
    if not num_experts:
        raise UserError("overlaps expert parallelism's all-to-alls, and the model has no routed experts; allowed: a "
                        "mixture of experts", field="--ep-comm-overlap")
    if dispatcher not in ("alltoall", "flex"):
        raise UserError(f"overlaps the all-to-all and flex dispatchers' exchanges, not the {dispatcher} dispatcher's "
                        "(transformer_config.py: 'supported with alltoall/flex token dispatcher'); allowed with it: "
                        "--expert-dispatcher alltoall or flex", field="--ep-comm-overlap")


def finetune_fields(finetune: str, lora_rank: int | None, lora_targets: tuple[str, ...] | None,
                    framework: str = "torch") -> dict:
    """The Workload's training-mode fields, the adapters' defaults filled in as ``framework``'s LoRA has them
    (planner/finetune.py STYLES), or UserError naming the flag."""
    mode = finetune_modes.mode(finetune)
    if not mode.adapters:
        finetune_modes.check(finetune, lora_rank or 0, tuple(lora_targets or ()))
        return {"finetune": finetune, "lora_rank": 0, "lora_targets": ()}
    style = finetune_modes.STYLES[lora_style(framework)]
    rank = style.rank if lora_rank is None else lora_rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UserError(f"must be a positive integer, got {rank!r}", field="--lora-rank")
    targets = style.targets if lora_targets is None else tuple(lora_targets)
    finetune_modes.check(finetune, rank, targets)
    if not targets:
        raise UserError(f"no LoRA target; allowed: a comma-separated list of {one_of(finetune_modes.TARGETS)}",
                        field="--lora-targets")
    return {"finetune": finetune, "lora_rank": rank, "lora_targets": tuple(t for t in finetune_modes.TARGETS
                                                                        if t in targets)}


def check_finetune(workload: Workload, cluster: Cluster, spec: ModelSpec | None) -> None:
    """Refuse a training mode the runtime does not run on this device (``Combinations.finetune_modes``), and LoRA on a
    mixture of experts (routed experts' frozen storage is not modelled over expert parallelism yet)."""
    if workload.finetune == "full":
        return
    allowed = RUNTIMES[workload.framework].on(cluster.device_kind).finetune_modes
    if workload.finetune not in allowed:
        where = "on a CPU" if cluster.device_kind == "cpu" else f"on {cluster.name}"
        who = [n for n, r in RUNTIMES.items() if workload.finetune in r.on(cluster.device_kind).finetune_modes]
        raise UserError(f"the {workload.framework} runtime does not run {workload.finetune} {where}; allowed: "
                        f"{one_of(allowed)}" + (f" (--finetune {workload.finetune}: --framework {one_of(who)})"
                                                if who else ""), field="--finetune")
    if spec is not None and spec.num_experts:
        raise UserError(f"{workload.finetune} of a mixture of experts is not modelled yet; allowed: full",
                        field="--finetune")


def priced_attention(spec: ModelSpec | None, framework: str, attention: str,
                     warn: Callable[[str], None] | None = None) -> str:
    """The attention a workload of ``spec`` is priced with: ``attention``, but unfused where ``framework`` writes
    the model's core out (runtimes.unfused_core: meshplan's executor, for attention sinks or a window shorter than
    the sequence), which ``warn`` is told."""
    if attention != "flash" or not unfused_core(spec, framework):
        return attention
    (warn or (lambda _: None))(f"{spec.name}'s attention (sinks, or a window shorter than the sequence) runs as "
                               "`meshplan run` writes it out, its scores materialised: priced --attention unfused "
                               "(--framework torchtitan runs it fused)")
    return "unfused"


def load_job(model: str = DEFAULT_MODEL, cluster: str = DEFAULT_CLUSTER, **inputs) -> Job:
    """``JobInputs(model=..., cluster=..., **inputs).load()``."""
    return JobInputs(model=model, cluster=cluster, **inputs).load()


def default_global_batch(seq_len: int, gpus: int) -> int:
    """About 2^20 tokens per step, rounded up to a multiple of the GPUs."""
    sequences = max(1, round(2**20 / seq_len))
    return max(gpus, math.ceil(sequences / gpus) * gpus)


def check_fp8(recipe: str, framework: str, cluster: Cluster, compile: bool) -> None:
    """Refuse an FP8 recipe the runtime does not run on this device (``Combinations.fp8_recipes``), one the GPU has
    no tensor-core rate for, or torchao's recipes without compiled blocks (planner/precision.py)."""
    allowed = RUNTIMES[framework].on(cluster.device_kind).fp8_recipes
    if recipe not in allowed:
        where = "on a CPU" if cluster.device_kind == "cpu" else f"on {cluster.name}"
        raise UserError(f"the {framework} runtime does not run {recipe} {where}; allowed: "
                        f"{one_of([*DTYPES, *allowed])}" + ("" if allowed or cluster.device_kind == "cpu" else
                                                         " (FP8: --framework megatron, torchtitan or torch)"),
                        field="--precision")
    dtype = RECIPES[recipe].gemm_dtype
    if not cluster.device.gemm_peak(dtype):
        have = [r for r in allowed if cluster.device.gemm_peak(RECIPES[r].gemm_dtype)]
        raise UserError(f"{cluster.name}'s {cluster.device.name} has no {dtype} tensor-core rate (peak_tflops."
                        f"{dtype} in its profile); allowed: {one_of([*DTYPES, *have])}", field="--precision")
    if library(framework) == "torchao" and not compile:
        raise UserError(f"torchao's {recipe} casts run as fused kernels only in compiled blocks (torchao: 'enable "
                        "torch.compile for competitive performance'), and eager casts are not priced; allowed: "
                        f"--precision {recipe} with --compile", field="--precision")


def default_precision(cluster: Cluster) -> str:
    for dtype in ("bf16", "fp16", "fp32"):
        if dtype in cluster.device.dtypes:
            return dtype
    return cluster.device.dtypes[0]


# -- planning --------------------------------------------------------------------------------------

class NotFaster(Exception):
    """``plan`` with a ``bound_s``: no plan that fits is faster than it."""


def plan(job: Job, knobs: Knobs = Knobs(), *, top_k: int = 5, solver: str | None = None, time_limit_s: float = 20.0,
         progress: Callable[[int, int], None] | None = None, prefer: str = "headroom",
         bound_s: float = math.inf, seeds: tuple[ParallelConfig, ...] = ()) -> Plan:
    """The fastest plan that fits, whole (planner/search/finish.py), with the best plan of each of the next
    ``top_k`` layouts. When ``knobs`` fix every knob that matters the config is estimated, not searched (it
    may not fit: the Plan says so). ``solver``: "cbc" or "highs" for the stage ILPs (None: HiGHS where it
    is installed), "exhaustive" to enumerate instead (small models), "uniform" for balanced stages and one
    recompute policy only. ``prefer``: "headroom" (a safer plan among those within the model's error of
    the fastest, where there is one: planner/search/result.py ``choose``) or "fastest". Raises
    NoFeasiblePlan when nothing fits. ``bound_s``: only plans faster than it (``search``'s), NotFaster when
    there is none; ``seeds``: configs to start from (``search``'s)."""
    t0 = time.perf_counter()
    ilp = solver if solver in ("cbc", "highs") else default_solver()
    fixed = fully_fixed(knobs, job.workload, job.cluster.num_gpus, job.graph)
    if fixed is not None:
        return fixed_plan(job, fixed, knobs)
    result = search(job.graph, job.cluster, job.workload, knobs, top_k=top_k, solver=solver or ilp,
                    time_limit_s=time_limit_s, progress=progress, prefer=prefer, bound_s=bound_s, seeds=seeds)
    if result.best is None and bound_s < math.inf:
        raise NotFaster(bound_s)
    if result.best is None:
        answer = no_fit(result, job.graph, job.cluster, job.workload, knobs)
        raise NoFeasiblePlan(answer.message(), answer=answer.to_json())
    return finish(result, graph=job.graph, cluster=job.cluster, workload=job.workload, model_name=job.model_name,
                  model_source=job.model_source, spec=job.spec, solver="exhaustive" if solver == "exhaustive" else ilp,
                  seconds=time.perf_counter() - t0, knobs=knobs.fixed())


def precision_candidates(inputs: JobInputs) -> tuple[str, ...]:
    """The --precision values the search tries: the one given; left out, the device's default dtype and, where that
    is bf16, every FP8 recipe the runtime runs on the cluster's GPU (``Combinations.fp8_recipes``, the GPU's FP8 or
    MXFP8 rate; torchao's recipes only with --compile: planner/precision.py)."""
    if inputs.precision:
        return (inputs.precision,)
    cluster = load_cluster(inputs.cluster, inputs.gpus)
    base = default_precision(cluster)
    if base != "bf16" or inputs.framework not in RUNTIMES:
        return (base,)
    recipes = [r for r in RUNTIMES[inputs.framework].on(cluster.device_kind).fp8_recipes
               if cluster.device.gemm_peak(RECIPES[r].gemm_dtype) and (library(inputs.framework) == "te"
                                                                       or inputs.compile)]
    return (base, *recipes)


def plan_precisions(inputs: JobInputs, knobs: Knobs = Knobs(), *, warn: Callable[[str], None] | None = None,
                    prefer: str = "headroom", **options) -> Plan:
    """``plan`` of the job at each of its ``precision_candidates``: with one, that plan; with several (--precision
    left out), the fastest that fits, an FP8 recipe only where it beats the default dtype by more than the model's
    step-time error (the validation's median, as ``prefer="headroom"`` treats near-ties; "fastest": by any margin),
    since FP8 changes the numerics. The Plan's ``precisions`` says what each one gave.

    Searching costs the same for each precision, so not every recipe is searched: the default dtype is, then each
    recipe is estimated on the default dtype's plan (``on_base_plan``) and the one fastest there is searched; a
    recipe the runtime refuses on that plan (torch's FP8 at tp > 1) is searched as well."""
    from dataclasses import replace as _replace
    from .search.result import error_bands
    names = precision_candidates(inputs)
    if len(names) == 1:
        return plan(_replace(inputs, precision=names[0]).load(warn=warn), knobs, prefer=prefer, **options)
    jobs = {name: _replace(inputs, precision=name).load(warn=warn if i == 0 else None) for i, name in enumerate(names)}

    slower: list[str] = []      # searched for a plan fast enough to be chosen over the default dtype's: none

    def searched(name: str, bound_s: float = math.inf, seeds: tuple = ()) -> Plan | None:
        try:
            return plan(jobs[name], knobs, prefer=prefer, bound_s=bound_s, seeds=seeds, **options)
        except NoFeasiblePlan:
            return None
        except NotFaster:
            slower.append(name)
            return None
        except UserError:
            if name == names[0]:
                raise
            return None         # a recipe the runtime refuses with the knobs the user fixed (FP8 at a fixed --tp 2)
    plans: dict[str, Plan | None] = {names[0]: searched(names[0])}
    base_plan = plans[names[0]]
    # a recipe is chosen only where it beats the default dtype's plan by more than the band: a bound on its search
    band = error_bands(jobs[names[0]].cluster, jobs[names[0]].workload)[0] if prefer == "headroom" else 0.0
    bound = base_plan.best.estimate.step_time_s / (1 + band) if base_plan and base_plan.best.estimate.fits \
        else math.inf
    on_base: dict[str, float] = {}
    if plans[names[0]] is not None:
        for name in names[1:]:
            try:
                on_base[name] = estimate(jobs[name], plans[names[0]].best.config).estimate.step_time_s
            except UserError:
                plans[name] = searched(name, bound)
    to_search = [min(on_base, key=on_base.get)] if on_base else [n for n in names[1:] if n not in plans]
    # the default dtype's plan and runners-up start the recipe's search: its pruning bites from the first layout
    seeds = (base_plan.best.config, *(a.config for a in base_plan.alternatives)) if base_plan else ()
    for name in to_search:
        plans[name] = searched(name, bound, seeds)
    fits = {n: p for n, p in plans.items() if p is not None and p.best.estimate.fits}
    if not fits:
        first = next((p for p in plans.values() if p is not None), None)
        if first is None:
            return plan(_replace(inputs, precision=names[0]).load(), knobs, prefer=prefer, **options)  # raises
        return first
    base = names[0]
    step = {n: p.best.estimate.step_time_s for n, p in fits.items()}
    fastest = min(step, key=step.get)
    chosen = fastest
    why = f"{fastest} is the fastest that fits"
    if fastest != base and base in step and step[base] <= step[fastest] * (1 + band):
        chosen = base
        why = (f"{fastest} is {100 * (step[base] / step[fastest] - 1):.1f}% faster than {base}, within the model's "
               f"{100 * band:.1f}% median step-time error: {base} keeps its numerics")
    if chosen == base and slower:
        why = (f"no plan of {', '.join(slower)} is faster than {base}'s by more than the model's {100 * band:.1f}% "
               f"median step-time error: {base} keeps its numerics")
    out = fits[chosen]
    tried = {n: (round(p.best.estimate.step_time_s, 6) if p is not None and p.best.estimate.fits else None)
             for n, p in plans.items() if n not in slower}
    return _replace(out, precisions={"tried": tried, "chosen": out.workload.precision_name, "why": why,
                                     **({"on_base_plan": {n: round(s, 6) for n, s in on_base.items()}}
                                        if on_base else {}),
                                     **({"not_faster": slower, "bound_s": round(bound, 6)} if slower else {})})


def plan_graph(graph: LayerGraph, cluster: Cluster | str, workload: Workload, *, gpus: int | None = None,
               knobs: Knobs = Knobs(), solver: str | None = None, model_source: str = "module") -> Plan:
    """``plan`` for a layer graph traced from a live module (``executor.auto_parallelize``): ``cluster`` a
    Cluster or a profile name / TOML path (then ``gpus`` says how many)."""
    if isinstance(cluster, str):
        cluster = load_cluster(cluster, gpus)
    elif gpus is not None and gpus != cluster.num_gpus:
        cluster = cluster.with_gpus(gpus)
    job = Job(model_source=model_source, spec=None, graph=graph, cluster=cluster, workload=workload)
    return plan(job, knobs, top_k=1, solver=solver)


def fixed_plan(job: Job, config: ParallelConfig, knobs: Knobs | None = None) -> Plan:
    """The whole Plan of one given config (its stage split and per-layer recompute as they are): checked,
    estimated, explained; it may not fit (the Plan says so). ``knobs``: those the user fixed to make it
    (recorded in the Plan), None where the config was given whole."""
    t0 = time.perf_counter()
    result = SearchResult(best=estimate(job, config), alternatives=(), candidates=1, evaluated=1,
                          seconds=time.perf_counter() - t0)
    return finish(result, graph=job.graph, cluster=job.cluster, workload=job.workload, model_name=job.model_name,
                  model_source=job.model_source, spec=job.spec, solver=default_solver(),
                  seconds=time.perf_counter() - t0, knobs=None if knobs is None else knobs.fixed())


def estimate(job: Job, config: ParallelConfig) -> Candidate:
    """One fully fixed config: its knobs checked (UserError naming the flag), its step simulated."""
    from .simulate import simulated_estimate
    evaluate(job.graph, job.cluster, job.workload, config)         # checks the knobs
    return Candidate(config=config, estimate=simulated_estimate(job.graph, job.cluster, job.workload, config))


def fully_fixed(knobs: Knobs, workload: Workload, num_gpus: int, graph: LayerGraph) -> ParallelConfig | None:
    """A ParallelConfig when every knob that matters is given (dp may be implied); ``every-K`` expanded
    into the per-layer policies of ``graph``."""
    k = knobs
    if None in (k.tp, k.pp, k.micro_batch, k.zero, k.recompute) or (graph.num_experts and k.ep is None):
        return None
    record = schedules.SCHEDULES.get(k.schedule) if k.schedule else None
    if k.pp > 1 and k.vpp is None and (record is None or (record.virtual_stages and not record.stages_per_rank)):
        return None     # the virtual stages are left to the search (a V schedule's are its own: stages_per_rank)
    vpp = k.vpp or (record.stages_per_rank if k.pp > 1 and record is not None and record.virtual_stages else None)
    cp = k.cp or 1
    dp = k.dp if k.dp is not None else num_gpus // max(1, k.tp * k.pp * cp)
    m = workload.global_batch // max(1, dp * k.micro_batch)
    config = ParallelConfig(dp=dp, tp=k.tp, pp=k.pp, cp=cp, ep=k.ep or 1, zero=k.zero, micro_batch=k.micro_batch,
                            num_microbatches=max(1, m), vpp=vpp or 1,
                            schedule=k.schedule or schedules.default_for(vpp),
                            sequence_parallel=bool(k.sequence_parallel), optimizer_offload=bool(k.optimizer_offload),
                            param_offload=bool(k.param_offload))
    return expand_recompute(config, k.recompute, graph)


# -- what-if and compare ----------------------------------------------------------------------------

def whatif(inputs: JobInputs, key: str, values: list[str], knobs: Knobs = Knobs(), *, top_k: int = 2,
           progress: Callable[[int, str], None] | None = None) -> list:
    """The best plan at each value of one swept quantity (planner/whatif.py ``SWEEPS``: gpus, bandwidth,
    gpu, global_batch, seq_len): one ``whatif.Point`` each, in order. ``progress(done, value)`` is told
    before each point."""
    from .whatif import sweep
    return sweep(inputs, key, values, knobs, top_k=top_k, progress=progress)


def compare(baseline: str, *, cluster: str = DEFAULT_CLUSTER, gpus: int | None = None, model: str | None = None,
            global_batch: int | None = None, seq_len: int | None = None, tp: int | None = None,
            pp: int | None = None, ep: int | None = None, tokens: float | None = None, top_k: int = 5,
            adapter: str | None = None):
    """Your configuration (a Megatron-LM arguments file or launch script, a DeepSpeed JSON, a torchtitan
    TOML or a plan.json) estimated, the best plan for the same job searched, both side by side: a
    ``compare.Comparison``. ``adapter``: a PEFT adapter_config.json (else the one beside ``baseline``, if
    any): the job fine-tunes with LoRA. Raises NoFeasiblePlan when neither fits."""
    from .baseline import Context, check_baseline, read_baseline
    from .compare import CHINCHILLA_TOKENS_PER_PARAM, Comparison, does_not_fit_by
    machines = load_cluster(cluster, gpus)
    ctx = Context(gpus=machines.num_gpus, global_batch=global_batch, seq_len=seq_len, tp=tp, pp=pp, ep=ep)
    read, spec, graph = read_baseline(baseline, ctx, model, adapter)
    check_baseline(read, graph, machines)
    workload = read.workload()
    check_finetune(workload, machines, spec)
    if workload.fp8:
        check_fp8(workload.fp8, workload.framework, machines, workload.compile)
    source = model or spec.name
    mine = estimate(Job(model_source=source, spec=spec, graph=graph, cluster=machines, workload=workload), read.config)
    result = search(graph, machines, workload, Knobs(), top_k=top_k)
    cmp = Comparison(baseline=read, spec=spec, model_source=source, graph=graph, cluster=machines,
                     workload=workload, mine=mine, best=result.best, search=result,
                     token_budget=tokens or CHINCHILLA_TOKENS_PER_PARAM * graph.num_params)
    if cmp.best is None and not cmp.already_best:
        answer = no_fit(result, graph, machines, workload, Knobs())
        raise NoFeasiblePlan(f"your plan does not fit ({does_not_fit_by(mine.estimate)}), and " + answer.message(),
                             answer={"baseline": {"config": mine.config.to_json(), "estimate": mine.estimate.to_json()},
                                     **answer.to_json()})
    return cmp
