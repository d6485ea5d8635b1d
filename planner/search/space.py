"""The legal search space: which knob values can work together for one job."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator

from ..config import FRAMEWORKS, ParallelConfig, Workload, check_config, knob_flag
from ..errors import UserError, one_of
from ..layers import LayerGraph
from ..recompute import every_k, expand_recompute, parse_recompute
from ..runtimes import EXECUTOR_RUNTIME, RUNTIMES, refusals
from ..schedules import DEFAULT as DEFAULT_SCHEDULE, NAMES as SCHEDULE_NAMES, SCHEDULES


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """Knobs the user fixed; None means 'search it'."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    vpp: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    optimizer_offload: bool | None = None
    param_offload: bool | None = None       # never searched: off unless fixed on
    nvme_offload: bool | None = None        # likewise (ZeRO-Infinity's NVMe)

    def fixed(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def max_stages(graph: LayerGraph, can_stand_alone: bool) -> int:
    """The most (virtual) pipeline stages ``graph`` splits into: one block each, and where the
    runtime lets them (``Combinations.stages_without_blocks``) the layers before the first block
    (the embedding) and after the last (final norm and head) as a stage each."""
    kinds = [layer.is_block for layer in graph.layers]
    ends = kinds and not kinds[0] and not kinds[-1]
    return graph.num_blocks + (2 if can_stand_alone and ends else 0)


@dataclass(frozen=True)
class Layout:
    """The global degrees and micro-batch: one group of candidates sharing a compute lower bound."""

    tp: int
    pp: int
    cp: int
    dp: int
    micro_batch: int
    ep: int = 1             # expert parallelism (routed experts over ep of the ranks: planner/runtimes.py)

    def num_microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)


class Space:
    """All legal ParallelConfigs for (graph, gpus, workload) under the fixed knobs: those the
    workload's runtime runs on ``device_kind`` (its ``Combinations`` in planner/runtimes.py)."""

    def __init__(self, graph: LayerGraph, num_gpus: int, workload: Workload, knobs: Knobs,
                 dtypes: tuple[str, ...] = (), device_kind: str = "cuda"):
        self.graph, self.n, self.w, self.k = graph, num_gpus, workload, knobs
        self.blocks = graph.num_blocks
        self.device_kind = device_kind
        if workload.framework in RUNTIMES:
            self.can = RUNTIMES[workload.framework].on(device_kind)
            self.max_stages = max_stages(graph, self.can.stages_without_blocks)
        self._check_fixed(dtypes)

    # -- validation of what the user fixed ------------------------------------------------------
    def _check_fixed(self, dtypes) -> None:
        k, g, w, n = self.k, self.graph, self.w, self.n
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "vpp"):
            value = getattr(k, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UserError(f"must be a positive integer, got {value!r}", field=f"--{name.replace('_', '-')}")
        if k.zero is not None and k.zero not in (0, 1, 2, 3):
            raise UserError(f"{k.zero!r} is not a ZeRO stage; allowed: 0, 1, 2 or 3", field="--zero")
        if k.schedule is not None and k.schedule not in SCHEDULE_NAMES:
            raise UserError(f"{k.schedule!r} is not allowed; allowed: {one_of(SCHEDULE_NAMES)}", field="--schedule")
        for name in ("optimizer_offload", "param_offload", "nvme_offload"):
            value = getattr(k, name)
            if value is not None and not isinstance(value, bool):
                raise UserError(f"must be on or off, got {value!r}", field=knob_flag(name))
        if k.recompute is not None:
            parse_recompute(k.recompute)        # a policy or every-K, else UserError
        if w.framework not in FRAMEWORKS:
            raise UserError(f"{w.framework!r} is not allowed; allowed: {one_of(FRAMEWORKS)}", field="--framework")
        if dtypes and w.precision not in dtypes:
            raise UserError(f"the cluster's devices have no {w.precision} peak; allowed: {one_of(dtypes)}",
                            field="--precision")
        if w.framework in RUNTIMES and w.expert_dispatcher not in self.can.expert_dispatchers:
            raise UserError(f"{w.expert_dispatcher!r} does not run on the {w.framework} runtime; allowed: "
                            f"{one_of(self.can.expert_dispatchers)}", field="--expert-dispatcher")
        product = 1
        for name in ("dp", "tp", "pp", "cp"):
            value = getattr(k, name)
            if value is not None:
                product *= value
                if n % value:
                    raise UserError(f"{name} {value} does not divide the {n} GPUs", field=f"--{name}")
        if n % product:
            fixed = " x ".join(f"{name} {getattr(k, name)}" for name in ("dp", "tp", "pp", "cp")
                               if getattr(k, name) is not None)
            raise UserError(f"{fixed} = {product} does not divide the {n} GPUs", field="--dp/--tp/--pp/--cp")
        if all(getattr(k, name) is not None for name in ("dp", "tp", "pp", "cp")) and product != n:
            raise UserError(f"dp x tp x pp x cp = {product} but the cluster has {n} GPUs", field="--dp/--tp/--pp/--cp")
        if k.tp is not None:
            if g.num_heads % k.tp:
                allowed = [d for d in divisors(g.num_heads) if n % d == 0]
                raise UserError(f"tp {k.tp} does not divide the {g.num_heads} attention heads; allowed: "
                                f"{one_of(allowed)}", field="--tp")
            if g.num_kv_heads % k.tp and k.tp % g.num_kv_heads:
                raise UserError(f"tp {k.tp} neither divides nor is a multiple of the {g.num_kv_heads} "
                                "key/value heads", field="--tp")
        if (k.pp or 1) > 1 and not g.pipelines:
            raise UserError(f"pp {k.pp}: the module cannot be cut into pipeline stages ({g.pipeline_why}); "
                            "allowed: 1", field="--pp")
        if k.pp is not None and k.pp > self.max_stages:
            raise UserError(f"pp {k.pp} is more stages than the model's {self.blocks} layers can make (at most "
                            f"{self.max_stages})", field="--pp")
        if k.pp is not None and k.vpp is not None and k.pp * k.vpp > self.max_stages:
            alone = " (the embedding and the head may stand alone)" if self.max_stages > self.blocks else ""
            raise UserError(f"pp {k.pp} x vpp {k.vpp} = {k.pp * k.vpp} model chunks, more than the model's "
                            f"{self.blocks} blocks make: the {w.framework} runtime puts at least one block in every "
                            f"chunk{alone}, so at most {self.max_stages}; allowed: vpp at most "
                            f"{self.max_stages // k.pp}", field="--vpp")
        if k.cp is not None and k.cp > 1 and w.seq_len % (2 * k.cp):
            raise UserError(f"cp {k.cp} needs the sequence length ({w.seq_len}) to be a multiple of 2 x cp",
                            field="--cp")
        if k.micro_batch is not None and w.global_batch % k.micro_batch:
            raise UserError(f"micro-batch {k.micro_batch} does not divide the global batch {w.global_batch}",
                            field="--micro-batch")
        if k.dp is not None and w.global_batch % k.dp:
            raise UserError(f"dp {k.dp} does not divide the global batch {w.global_batch}", field="--dp")
        if k.dp is not None and k.micro_batch is not None and w.global_batch % (k.dp * k.micro_batch):
            raise UserError(f"global batch {w.global_batch} is not a multiple of dp x micro-batch = "
                            f"{k.dp} x {k.micro_batch}", field="--micro-batch")
        if k.schedule is not None:       # what is not fixed yet at its least demanding (the micro-batches too)
            record = SCHEDULES[k.schedule]
            refused = record.refusal(pp=k.pp or 2, vpp=k.vpp or (2 if record.virtual_stages else 1))
            if refused:
                raise UserError(refused[1], field=refused[0])
        if k.sequence_parallel and k.tp == 1:
            raise UserError("sequence parallelism shards along the TP group: it needs tp >= 2",
                            field="--sequence-parallel")
        if k.optimizer_offload and k.zero == 0:
            raise UserError("optimizer offload (ZeRO-Offload) needs ZeRO stage 1, 2 or 3", field="--optimizer-offload")
        if k.ep is not None and k.ep > 1:
            if n % k.ep:
                raise UserError(f"ep {k.ep} does not divide the {n} GPUs", field="--ep")
            if not g.splits_experts and w.framework == EXECUTOR_RUNTIME:
                raise UserError(f"ep {k.ep}: {g.experts_why}; allowed: 1 (or plan for --framework megatron)",
                                field="--ep")
        for knob, why in refusals(w.framework, self.device_kind, zero=k.zero, tp=k.tp, pp=k.pp, cp=k.cp,
                                  schedule=k.schedule, optimizer_offload=k.optimizer_offload,
                                  param_offload=k.param_offload, nvme_offload=k.nvme_offload,
                                  sequence_parallel=k.sequence_parallel,
                                  recompute="full" if every_k(k.recompute) else k.recompute,
                                  num_kv_heads=g.num_kv_heads, num_experts=g.num_experts,
                                  ep=k.ep, dp=k.dp, latent_attention=g.latent_attention, compile=w.compile,
                                  finetune=w.finetune, ep_comm_overlap=w.ep_comm_overlap, fp8=w.fp8):
            raise UserError(why, field=knob_flag(knob))

    # -- enumeration ----------------------------------------------------------------------------
    def _options(self, name: str, values: list) -> list:
        fixed = getattr(self.k, name)
        return [fixed] if fixed is not None else values

    def _allowed(self, name: str, values: list) -> list:
        """``values``, or the fixed value of knob ``name`` where it is one of them."""
        fixed = getattr(self.k, name)
        return values if fixed is None else [fixed] if fixed in values else []

    def layouts(self) -> Iterator[Layout]:
        """(tp, pp, cp, dp, micro-batch) combinations that can work."""
        g, w, n = self.graph, self.w, self.n
        for tp in self._options("tp", divisors(n)):
            if g.num_heads % tp or (g.num_kv_heads % tp and tp % g.num_kv_heads):
                continue
            if g.num_kv_heads % tp and not self.can.replicates_kv_heads:
                continue
            if tp > 1 and g.num_experts and not self.can.experts_with_tp:
                continue
            if tp > 1 and w.fp8 and not self.can.fp8_with_tp:
                continue
            if tp > 1 and w.finetune == "qlora" and not self.can.nf4_base_with_tp:
                continue
            if tp == 1 and self.k.sequence_parallel:    # --sequence-parallel on: only layouts with a TP group to shard
                continue
            for pp in self._options("pp", divisors(n // tp)):
                if pp > self.max_stages or (n // tp) % pp or (pp > 1 and not g.pipelines):
                    continue
                if pp > 1 and w.finetune != "full" and not self.can.adapters_with_pp:
                    continue
                for cp in self._options("cp", divisors(n // (tp * pp)) if self.can.context_parallel else [1]):
                    if (n // (tp * pp)) % cp or (cp > 1 and w.seq_len % (2 * cp)):
                        continue
                    dp = n // (tp * pp * cp)
                    if (self.k.dp is not None and dp != self.k.dp) or w.global_batch % dp:
                        continue
                    for ep in self.eps(tp, cp, dp):
                        for mb in self._options("micro_batch", divisors(w.global_batch // dp)):
                            if (w.global_batch // dp) % mb == 0:
                                yield Layout(tp, pp, cp, dp, mb, ep)

    def eps(self, tp: int, cp: int, dp: int) -> list[int]:
        """Expert-parallel degrees for these dense degrees: 1 for a dense model, else those dividing the routed
        experts that the runtime runs here (``refusals``: ep folded onto dp x cp x tp, or dividing dp), or the
        fixed one."""
        experts = self.graph.num_experts
        if not experts or (not self.graph.splits_experts and self.w.framework == EXECUTOR_RUNTIME):
            return self._allowed("ep", [1])
        # where ep > 1 with tp > 1 needs sequence parallelism, which the plan cannot have (fixed off, or latent
        # attention on a runtime that runs it without SP), only ep 1 is left beside that tp
        no_sp = tp > 1 and self.can.ep_needs_sp and (
            self.k.sequence_parallel is False or not self.can.sequence_parallel
            or (self.graph.latent_attention and not self.can.sp_with_latent_attention))
        out = [ep for ep in divisors(experts) if not (no_sp and ep > 1) and not [
            knob for knob, _ in refusals(self.w.framework, self.device_kind, ep=ep, dp=dp, tp=tp, cp=cp,
                                         num_experts=experts, ep_comm_overlap=self.w.ep_comm_overlap)
            if knob == "ep"]]
        return self._allowed("ep", out)

    def schedules(self, layout: Layout) -> list[tuple[str, int]]:
        """(schedule, vpp) pairs legal for a layout: the runtime's schedules (or the fixed one), each
        with the virtual stages per rank its record allows (``PipelineSchedule.refusal``). They depend on
        the pipeline depth and the micro-batches only (memoised on those)."""
        key = (layout.pp, layout.num_microbatches(self.w.global_batch))
        memo = self.__dict__.setdefault("_schedules", {})
        if key not in memo:
            memo[key] = self._schedules_of(layout)
        return memo[key]

    def _schedules_of(self, layout: Layout) -> list[tuple[str, int]]:
        if layout.pp == 1:          # no pipeline: the step is one rank's gradient accumulation
            fixed = self.k.schedule and SCHEDULES[self.k.schedule]
            if (fixed and fixed.virtual_stages) or (self.k.vpp or 1) != 1:
                return []
            return [(self.k.schedule or DEFAULT_SCHEDULE, 1)]
        m = layout.num_microbatches(self.w.global_batch)
        out = []
        for name in self._options("schedule", list(self.can.schedules)):
            record = SCHEDULES[name]
            if record.virtual_stages and layout.pp < self.can.virtual_stages_min_pp:
                continue        # the runtime interleaves no pipeline this short (Megatron-LM of 2021: pp > 2)
            if record.compile_refusal(self.w.compile):
                continue        # split backward: torch refuses compiled stages
            if self.w.ep_comm_overlap and refusals(self.w.framework, self.device_kind, schedule=name, pp=layout.pp,
                                                   ep_comm_overlap=True):
                continue        # Megatron-Core's overlapped all-to-alls need virtual stages under a pipeline
            vpps = ([record.stages_per_rank] if record.stages_per_rank else self._virtual_stages(layout.pp)) \
                if record.virtual_stages else [1]
            for vpp in self._options("vpp", vpps):
                if layout.pp * vpp <= self.max_stages and not record.refusal(pp=layout.pp, vpp=vpp, m=m):
                    out.append((name, vpp))
        return out

    def _virtual_stages(self, pp: int) -> list[int]:
        """Virtual stages per rank to try: those dividing the rank's blocks, and the one that makes
        every stage a single layer (the embedding and the head alone at the ends) where it exists."""
        out = divisors(self.blocks // pp)
        if self.max_stages > self.blocks and self.max_stages % pp == 0:
            out.append(self.max_stages // pp)
        return out

    def zeros(self, layout: Layout, schedule: str | None = None) -> list[int]:
        """ZeRO stages the runtime runs with this layout (and schedule, when known)."""
        key = (layout.tp > 1, layout.pp > 1, layout.cp > 1, layout.dp * layout.cp == 1, schedule,
               layout.ep, layout.cp * layout.tp)
        memo = self.__dict__.setdefault("_zeros_memo", {})
        if key not in memo:
            memo[key] = self._zeros(layout, schedule)
        return memo[key]

    def _zeros(self, layout: Layout, schedule: str | None) -> list[int]:
        allowed = [z for z in self.can.zero_stages
                   if not refusals(self.w.framework, self.device_kind, zero=z, tp=layout.tp, pp=layout.pp,
                                   cp=layout.cp, dp=layout.dp, ep=layout.ep, schedule=schedule, param_offload=self.param_offload,
                                   nvme_offload=self.nvme_offload, finetune=self.w.finetune)]
        if layout.dp * layout.cp == 1 and not self.param_offload and not self.nvme_offload:
            # nothing to shard over: the stages are all equal to ZeRO-0 (but where ZeRO-3's parameters go to the host)
            fixed = self.k.zero
            return [0] if fixed is None else [fixed] if fixed in allowed else []
        return self._allowed("zero", allowed)

    def sequence_parallel(self, layout: Layout, schedule: str | None = None) -> list[bool]:
        """Sequence parallelism off and on where the layout and the runtime allow it (with ``schedule``: under it)."""
        needs = layout.tp > 1 and ((layout.ep > 1 and self.can.ep_needs_sp)
                                   or (self.w.compile and self.can.compile_with_tp_needs_sp))
        if (schedule is not None and layout.pp > 1 and not self.can.sp_with_split_backward
                and SCHEDULES[schedule].backward == "split"):
            # the layout needs SP, which this schedule cannot run: none under it (the layout's other schedules may)
            return [] if needs else self._allowed("sequence_parallel", [False])
        if self.graph.latent_attention and not self.can.sp_with_latent_attention:
            return self._allowed("sequence_parallel", [False])      # ``eps`` keeps out a layout that needs SP here
        if needs:
            return self._allowed("sequence_parallel", [True])
        return self._allowed("sequence_parallel", [False, True] if layout.tp > 1 and self.can.sequence_parallel
                             else [False])

    def optimizer_offloads(self, zero: int) -> list[bool]:
        """Without optimizer offload, and with it where the runtime offloads at this ZeRO stage."""
        return self._allowed("optimizer_offload", [False, True] if zero in self.can.offload_zero_stages else [False])

    def recomputes(self, layout: Layout | None = None) -> list[str]:
        """The recompute policies to search (the runtime's, with the layout's expert parallelism where given), or the
        fixed one: a policy or ``every-K``."""
        allowed = list(self.can.recomputes)
        if self.w.ep_comm_overlap or self.w.fp8:     # Megatron-Core refuses full recompute with the one and the
            # output-discarding modules with delayed scaling (a fixed policy is refused above)
            allowed = [p for p in allowed if not refusals(self.w.framework, self.device_kind, recompute=p,
                                                          ep_comm_overlap=self.w.ep_comm_overlap, fp8=self.w.fp8)]
        narrowed = False
        if layout is not None and layout.ep > 1 and self.can.recomputes_with_ep is not None:
            allowed, narrowed = [p for p in allowed if p in self.can.recomputes_with_ep], True
        if layout is not None and layout.tp > 1 and self.w.compile and self.can.compile_with_tp_recomputes is not None:
            allowed, narrowed = [p for p in allowed if p in self.can.compile_with_tp_recomputes], True
        fixed = self.k.recompute
        if narrowed and fixed is not None:
            return [fixed] if (every_k(fixed) and "full" in allowed) or fixed in allowed else []
        return self._options("recompute", allowed)

    def offloads_first_blocks(self, layout: Layout) -> bool:
        """Whether ``layout`` is also searched with activation offload on its first blocks and none on the others,
        the one mix of policies a runtime with one policy for every block may run (``Combinations.
        offloads_first_blocks``: Megatron-Core's --cpu-offloading-num-layers): with no pipeline, nor
        --ep-comm-overlap, and the recompute the search's to pick."""
        return (self.can.offloads_first_blocks and not self.can.recompute_per_layer and layout.pp == 1
                and not self.w.ep_comm_overlap and self.k.recompute is None and "none" in self.recomputes(layout))

    def recomputes_first_blocks(self, layout: Layout) -> bool:
        """Whether ``layout`` is also searched with full recompute on the same first blocks of every (virtual) stage
        and none on the others, on balanced stages (``Combinations.recomputes_first_blocks``: Megatron-LM's
        --recompute-method block --recompute-num-layers N), the recompute the search's to pick."""
        allowed = self.recomputes(layout)
        return (self.can.recomputes_first_blocks and not self.can.recompute_per_layer and self.k.recompute is None
                and "none" in allowed and "full" in allowed)

    def with_recompute(self, config: ParallelConfig, policy: str) -> ParallelConfig:
        """``config`` recomputing every block with ``policy``, or in the ``every-K`` pattern (full on every
        K-th block, planner/recompute.py), per layer."""
        return expand_recompute(config, policy, self.graph)

    def configs(self, layout: Layout, schedule: str, vpp: int, sp: bool, zero: int) -> Iterator[ParallelConfig]:
        for offload in self.optimizer_offloads(zero):
            for recompute in self.recomputes(layout):
                yield self.config(layout, schedule, vpp, sp, zero, offload, recompute)

    def config(self, layout: Layout, schedule: str, vpp: int, sp: bool, zero: int, optimizer_offload: bool,
               recompute: str) -> ParallelConfig:
        m = layout.num_microbatches(self.w.global_batch)
        return self.with_recompute(ParallelConfig(
            dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, zero=zero, micro_batch=layout.micro_batch,
            num_microbatches=m, vpp=vpp, schedule=schedule, sequence_parallel=sp,
            optimizer_offload=optimizer_offload, param_offload=self.param_offload,
            nvme_offload=self.nvme_offload and (optimizer_offload or self.param_offload)),
            recompute)

    @property
    def param_offload(self) -> bool:
        """Parameter offload, where fixed on (the search never turns it on by itself)."""
        return bool(self.k.param_offload)

    @property
    def nvme_offload(self) -> bool:
        """Offload to NVMe, where fixed on (likewise)."""
        return bool(self.k.nvme_offload)

    def check(self, config: ParallelConfig) -> None:
        check_config(config, num_gpus=self.n, global_batch=self.w.global_batch, seq_len=self.w.seq_len,
                     num_heads=self.graph.num_heads, num_kv_heads=self.graph.num_kv_heads, num_blocks=self.blocks,
                     framework=self.w.framework, precision=self.w.precision, device_kind=self.device_kind,
                     max_stages=self.max_stages, num_experts=self.graph.num_experts,
                     latent_attention=self.graph.latent_attention, fp8=self.w.fp8, compile=self.w.compile,
                     finetune=self.w.finetune, ep_comm_overlap=self.w.ep_comm_overlap)
