"""Exact search by enumeration, pruned only by bounds and dominance (never by guesses).

Candidates are grouped by layout (tp, pp, cp, dp, micro-batch). For each layout a
lower bound on the step time is computed from the layers alone (compute and TP
communication at their cheapest, the least pipeline bubble any schedule allows);
layouts are visited in order of that bound and the search stops when the bound
reaches the k-th best step time found. Inside a layout, choices whose time can
only be higher and memory no lower than a fitting choice are skipped:

- a recompute policy that adds no more seconds to any block than one found fitting (or too slow)
  is no slower (planner/search/policies.py; the policies are not a total order: "op" recomputes
  less than "full" but keeps more, "activation-offload" may add nothing but needs host memory);
- no offload is faster than optimizer offload;
- a schedule another dominates (``PipelineSchedule.dominated_by``: GPipe takes the same time as 1F1B
  and holds more micro-batches) is not searched unless it is fixed.

``prune=False`` evaluates every legal candidate (the reference the tests use).
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field, replace

from ..cluster import Cluster
from ..config import ParallelConfig, Workload
from ..cost.memory import resident_bytes_per_param, state_bytes_per_param
from ..cost.step import (CostCache, Estimate, estimate, grads_follow_activations_at, inflight_microbatches,
                         optimizer_time_s, peak_memory, rank_costs, rank_pipeline_s)
from ..layers import LayerGraph
from ..recompute import policy_rank
from ..schedules import SCHEDULES
from .policies import distinct_policies, no_slower
from .space import Knobs, Layout, Space



@dataclass(frozen=True, kw_only=True)
class Candidate:
    config: ParallelConfig
    estimate: Estimate


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    best: Candidate | None                 # fastest that fits
    alternatives: tuple[Candidate, ...]    # the runners-up that fit, fastest first
    candidates: int                        # legal configurations covered (evaluated or pruned exactly)
    evaluated: int                         # configurations estimated in full (time and memory)
    memory_checked: int = 0                # configurations rejected on memory alone
    seconds: float
    least_memory: Candidate | None = None  # when nothing fits: what needs the least memory
    groups: int = 0                        # global choices the stage search looked at
    ilp_solves: int = 0                    # stage ILPs run (the others were bounded out)
    ilp_improved: int = 0                  # of which beat every balanced-stage candidate


def _sort_key(c: Candidate) -> tuple:
    """Fastest first; ties go to less memory, then to the simpler config."""
    cfg = c.config
    return (round(c.estimate.step_time_s, 12), round(c.estimate.memory.total), cfg.tp, cfg.pp, cfg.cp, cfg.zero,
            policy_rank(cfg.recompute), cfg.vpp, cfg.sequence_parallel, cfg.optimizer_offload,
            cfg.micro_batch)


def layout_key(config: ParallelConfig) -> tuple[int, int, int, int]:
    return (config.dp, config.tp, config.pp, config.cp)


OPTIMALITY_GAP = 1e-3     # the search's answer is the cost model's optimum to within this fraction


def _complexity(c: Candidate) -> tuple[int, float]:
    """What a plan asks of its runtime beyond the plain one: optimizer offload, then the share of
    its layers it recomputes."""
    cfg = c.config
    if cfg.recompute_layers is not None:
        share = sum(p != "none" for p in cfg.recompute_layers) / max(1, len(cfg.recompute_layers))
    else:
        share = 0.0 if cfg.recompute == "none" else 1.0
    return int(cfg.optimizer_offload), share


def _better(new: Candidate, old: Candidate) -> bool:
    """Whether ``new`` should replace ``old`` (the same layout): faster, unless ``old`` is simpler and
    within the optimality gap of it; or simpler and within the gap of ``old``."""
    t_new, t_old = new.estimate.step_time_s, old.estimate.step_time_s
    if _complexity(new) < _complexity(old) and t_new <= t_old * (1 + OPTIMALITY_GAP):
        return True
    if _complexity(new) > _complexity(old) and t_new >= t_old * (1 - OPTIMALITY_GAP):
        return False
    return _sort_key(new) < _sort_key(old)


class _TopK:
    """The best candidate of each distinct parallel layout (dp, tp, pp, cp), the k fastest
    layouts kept: the runners-up are other ways to split the job, not near-copies. Within a
    layout, a plan with more offload or recompute must be faster by more than the optimality gap
    to displace a simpler one (a 0.02% gain is not worth moving the optimizer to the host)."""

    def __init__(self, k: int):
        self.k, self.items = k, []

    def add(self, c: Candidate) -> None:
        key = layout_key(c.config)
        same = [x for x in self.items if layout_key(x.config) == key]
        if same and not _better(c, same[0]):
            return
        self.items = [x for x in self.items if layout_key(x.config) != key] + [c]
        self.items.sort(key=_sort_key)
        del self.items[self.k:]

    @property
    def threshold(self) -> float:
        return self.items[-1].estimate.step_time_s if len(self.items) >= self.k else float("inf")


class LayoutBounds:
    """Lower bounds on the step time and memory of every candidate of a layout.

    Memory: sharded states at their smallest, activations fully recomputed, one
    micro-batch in flight, on the average rank (the most loaded one holds at least as
    much). Saved activations are linear in the micro-batch (every quantity is per token,
    attention's per sequence), so micro-batch 1 gives them for all.

    Time, three bounds: ``order`` for every layout, from each layer's linear floor at
    micro-batch 1 (GEMMs at their ideal rate, no communication; ``LayerCost.work_floor_s``),
    which orders the layouts; ``floor``, that plus the least optimizer step of the mean
    rank (at one micro-batch); and ``time``, the pipeline of the mean rank's exact work at
    the layout's micro-batch with recompute none plus the least optimizer step of the mean
    rank. The last two only for the layouts the search reaches. A layout whose memory bound
    exceeds the device has an infinite ``time`` bound. The memory bound is computed only for
    the layouts the search reaches."""

    def __init__(self, space: Space, cache: CostCache, layouts: list[Layout]):
        self.space, self.cache = space, cache
        self._memory: dict[Layout, float] = {}
        self._order = {lay: self._order_bound(lay) for lay in layouts}
        self._floor: dict[Layout, float] = {}
        self._time: dict[Layout, float] = {}

    def memory(self, layout: Layout) -> float:
        if layout not in self._memory:
            self._memory[layout] = self._memory_bound(layout)
        return self._memory[layout]

    def order(self, layout: Layout) -> float:
        """The floor without the optimizer: the key the layouts are visited by."""
        return self._order[layout]

    def floor(self, layout: Layout) -> float:
        """The order key plus the least optimizer step of the mean rank at one micro-batch (the
        step's casts and accumulation only grow with them; the parameters do not depend on
        sequence parallelism, so it adds to the least over it)."""
        if layout not in self._floor:
            one = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, micro_batch=1,
                                 num_microbatches=1)
            params = self.cache.totals(self.cache.context(one))[2] / layout.pp
            self._floor[layout] = self._order[layout] + optimizer_floor(self.space, layout, self.cache, one, params)
        return self._floor[layout]

    def time(self, layout: Layout) -> float:
        if layout not in self._time:
            self._time[layout] = self._time_bound(layout)
        return self._time[layout]

    def _pipeline_factor(self, layout: Layout, m: int) -> float:
        """The least pipeline time over the layout's schedules when every rank takes one second per
        micro-batch and no send waits (``PipelineSchedule.pipeline_s`` with equal ranks): the factor
        that turns the mean rank's work into a bound. Memoised on what the schedules depend on."""
        memo = self.__dict__.setdefault("_pipeline_factor_memo", {})
        key = (layout.pp, m, m % layout.pp == 0)
        if key not in memo:
            memo[key] = min((SCHEDULES[s].pipeline_s(slowest=1.0, total=float(layout.pp), m=m, p=layout.pp, v=v)
                             for s, v in self.space.schedules(layout)), default=float(m + layout.pp - 1))
        return memo[key]

    def _order_bound(self, layout: Layout) -> float:
        """The pipeline of the mean rank's linear work floor: the floor of one micro-batch depends on
        (tp, pp, cp, dp) only (memoised on those), the least over sequence parallelism."""
        space, pp = self.space, layout.pp
        m = layout.num_microbatches(space.w.global_batch)
        memo = self.__dict__.setdefault("_order_memo", {})
        key = (layout.tp, pp, layout.cp, layout.dp)
        work = memo.get(key)
        if work is None:
            work = memo[key] = min(
                self.cache.totals(self.cache.context(ParallelConfig(
                    dp=layout.dp, tp=layout.tp, pp=pp, cp=layout.cp, micro_batch=1, num_microbatches=m,
                    sequence_parallel=sp)))[3] for sp in space.sequence_parallel(layout)) / pp
        return self._pipeline_factor(layout, m) * work * layout.micro_batch

    def _time_bound(self, layout: Layout) -> float:
        space, cache = self.space, self.cache
        if self.memory(layout) > cache.cluster.device.memory_bytes:
            return float("inf")
        m = layout.num_microbatches(space.w.global_batch)
        factor = self._pipeline_factor(layout, m)
        best = float("inf")
        for sp in space.sequence_parallel(layout):
            cfg = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                                 micro_batch=layout.micro_batch, num_microbatches=m, sequence_parallel=sp)
            work, _, params, _ = cache.totals(cache.context(cfg))
            work /= layout.pp                                       # mean rank, no recompute
            pipe = factor * work
            # the step adds the slowest rank's optimizer to the pipeline
            best = min(best, pipe + optimizer_floor(space, layout, cache, cfg, params / layout.pp))
        return best

    def _memory_bound(self, layout: Layout) -> float:
        space, cache = self.space, self.cache
        best_act = float("inf")
        params = 0.0
        for sp in space.sequence_parallel(layout):
            one = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, micro_batch=1,
                                 num_microbatches=1, sequence_parallel=sp)
            _, act, params, _ = cache.totals(cache.context(one))
            best_act = min(best_act, layout.micro_batch * act / layout.pp)
        params /= layout.pp
        base = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                              micro_batch=layout.micro_batch,
                              num_microbatches=layout.num_microbatches(space.w.global_batch))
        return _least_state_and_activation_bytes(space, layout, base, None, [(params, best_act)]) \
            + cache.cluster.device.reserved_bytes


@dataclass
class _Stats:
    covered: int = 0          # uniform configurations covered
    evaluated: int = 0        # estimated in full
    checked: int = 0          # rejected on memory alone
    least: Candidate | None = None
    least_unfit: "_Unfit | None" = None
    infeasible_layouts: list = field(default_factory=list)


def uniform_phase(space: Space, cache: CostCache, top: _TopK, order: list[Layout], bounds: LayoutBounds,
                  prune: bool, progress=None) -> _Stats:
    """Every candidate with balanced stages and one recompute policy for all blocks,
    pruned only by bounds and dominance: a strong incumbent for the stage ILPs."""
    stats = _Stats()
    capacity = cache.cluster.device.memory_bytes
    for index, layout in enumerate(order):
        if progress:
            progress(index, len(order))
        if prune and bounds.order(layout) >= top.threshold:  # the order's key: none after it can win
            stats.covered += sum(_layout_size(space, lay) for lay in order[index:])
            break
        if prune and bounds.floor(layout) >= top.threshold:
            stats.covered += _layout_size(space, layout)
            continue
        if prune and bounds.memory(layout) > capacity:
            stats.covered += _layout_size(space, layout)
            stats.infeasible_layouts.append(layout)
            continue
        stats.covered += _layout_size(space, layout)
        if prune and bounds.time(layout) >= top.threshold:
            continue
        for cand in _layout_candidates(space, cache, layout, prune, top):
            if isinstance(cand, _SkippedForMemory):
                if not stats.infeasible_layouts or stats.infeasible_layouts[-1] != layout:
                    stats.infeasible_layouts.append(layout)
                continue
            if isinstance(cand, _Unfit):
                stats.checked += 1
                if stats.least_unfit is None or cand.need < stats.least_unfit.need:
                    stats.least_unfit = cand
            elif cand.estimate.fits:
                stats.evaluated += 1
                top.add(cand)
            else:
                stats.evaluated += 1
                if stats.least is None or _need(cand) < _need(stats.least):
                    stats.least = cand
    return stats


def least_memory_candidate(space: Space, cache: CostCache, stats: _Stats) -> Candidate | None:
    """When nothing fits: the candidate that needs the least memory, for the error message."""
    least = stats.least
    if stats.least_unfit is not None and (least is None or stats.least_unfit.need < _need(least)):
        least = Candidate(config=stats.least_unfit.config,
                          estimate=estimate(space.graph, cache.cluster, space.w, stats.least_unfit.config, cache))
    for layout in stats.infeasible_layouts:
        for cand in _frugal_candidates(space, cache, layout):
            stats.evaluated += 1
            if least is None or _need(cand) < _need(least):
                least = cand
    return least


def _need(cand: Candidate) -> tuple[bool, float]:
    """How the no-fit message ranks candidates: those whose offloaded states fit in host memory
    first (offload can empty the device of model states, but not the host), then by device memory."""
    e = cand.estimate
    return e.host_bytes_per_node > e.host_capacity_bytes, e.memory.total


def layout_order(space: Space, cache: CostCache) -> tuple[list[Layout], LayoutBounds]:
    """The layouts, most promising first (by their time floor), and their bounds."""
    layouts = list(space.layouts())
    bounds = LayoutBounds(space, cache, layouts)
    return sorted(layouts, key=bounds.order), bounds


def _layout_size(space: Space, layout: Layout) -> int:
    """Number of legal configs in a layout (for the coverage count), memoised on what the
    schedules, ZeRO stages and sequence-parallel choices of a layout depend on."""
    m = layout.num_microbatches(space.w.global_batch)
    key = (layout.pp, m % layout.pp == 0, layout.tp > 1, layout.dp > 1, layout.dp * layout.cp == 1)
    sizes = space.__dict__.setdefault("_layout_sizes", {})
    if key not in sizes:
        sizes[key] = _count_layout(space, layout)
    return sizes[key]


def _count_layout(space: Space, layout: Layout) -> int:
    n = 0
    for schedule, _ in space.schedules(layout):
        for _ in space.sequence_parallel(layout):
            for zero in space.zeros(layout, schedule):
                n += len(space.optimizer_offloads(zero)) * len(space.recomputes())
    return n


def _group_config(space: Space, layout: Layout, schedule: str, vpp: int, sp: bool) -> ParallelConfig:
    m = layout.num_microbatches(space.w.global_batch)
    return ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, micro_batch=layout.micro_batch,
                          num_microbatches=m, vpp=vpp, schedule=schedule, sequence_parallel=sp)


def optimizer_floor(space: Space, layout: Layout, cache: CostCache, base: ParallelConfig, params: float,
                    schedule: str | None = None) -> float:
    """The least optimizer step over the layout's ZeRO/offload choices for a rank of ``params``
    parameters: the step adds the slowest rank's optimizer (``cost.step.estimate``), which holds at
    least the mean rank's parameters (``optimizer_time_s`` grows with them)."""
    return params * least_optimizer_rate(space, layout, cache, base, schedule)


def least_optimizer_rate(space: Space, layout: Layout, cache: CostCache, base: ParallelConfig,
                         schedule: str | None = None, zero: int | None = None, offload: bool | None = None) -> float:
    """Seconds per parameter of the fastest optimizer step over the layout's ZeRO/offload choices (of
    ZeRO stage ``zero`` and offload ``offload`` only, when given): ``optimizer_time_s`` is linear in
    the parameters (every term is bytes per parameter over a bandwidth), so one rate per choice,
    memoised on the cache."""
    key = (base.dp, base.cp, base.tp, base.pp, base.num_microbatches, schedule if zero is None else None, zero,
           offload)
    memo = cache.__dict__.setdefault("_least_optimizer_rate", {})
    out = memo.get(key)
    if out is None:
        zeros = space.zeros(layout, schedule) if zero is None else [zero]
        out = memo[key] = min((optimizer_time_s(cache, base.but(zero=z, optimizer_offload=o), 1.0)
                               for z in zeros for o in space.optimizer_offloads(z) if offload in (None, o)),
                              default=0.0)
    return out


def _group_time_bound(space: Space, cache: CostCache, layout: Layout, base: ParallelConfig) -> float:
    """A lower bound on the step time over the ZeRO/offload/recompute choices of one group: the
    pipeline with recompute none (the other choices only add to it) and the least optimizer step
    of its most loaded rank."""
    params = max(r.params for r in rank_costs(cache, base))
    return rank_pipeline_s(cache, base) + optimizer_floor(space, layout, cache, base, params, base.schedule)


def _policy_memory_bound(space: Space, cache: CostCache, layout: Layout, base: ParallelConfig, policy: str) -> float:
    """For one recompute policy, a lower bound on the memory of the group's most loaded GPU: the least,
    over the ZeRO/offload choices, of each rank's model states plus its activations (those of its
    micro-batches in flight and its transient peak) and the runtime reserve; where gradients only
    follow the activations (planner.cost.step.grads_follow_activations), the larger of the two
    instead of their sum. Bounded per policy, not by full recompute for all: a one-layer stage with
    one micro-batch in flight needs more under full recompute (the recomputed layer's transient)
    than without."""
    inflight = [inflight_microbatches(base, r) for r in range(base.pp)]
    ranks = rank_costs(cache, space.with_recompute(base, policy))
    return cache.cluster.device.reserved_bytes + _least_state_and_activation_bytes(
        space, layout, base, base.schedule,
        [(r.params, r.act_bytes * f + r.peak_extra_bytes) for r, f in zip(ranks, inflight)])


def _least_state_and_activation_bytes(space: Space, layout: Layout, base: ParallelConfig, schedule: str | None,
                                      ranks: list[tuple[float, float]]) -> float:
    """The least over the layout's ZeRO/offload choices of the most loaded rank's model states plus
    activations, for (parameters, activation bytes) per rank: their sum, or where gradients only
    follow the activations (planner.cost.step.grads_follow_activations) the larger of the two."""
    w = space.w
    shard = layout.dp * layout.cp
    most: dict[float, float] = {}        # ranks with the same parameters: only the most activations count
    for params, act in ranks:
        most[params] = max(act, most.get(params, act))
    ranks = list(most.items())
    key = (layout, schedule, base.pp, base.num_microbatches)
    memo = space.__dict__.setdefault("_state_rates", {})
    rates = memo.get(key)
    if rates is None:           # (bytes per parameter, of which gradients that only follow the activations)
        rates = memo[key] = []
        for zero in space.zeros(layout, schedule):
            follows = grads_follow_activations_at(w.framework, pp=base.pp, num_microbatches=base.num_microbatches,
                                                  shard=shard, zero=zero)
            for offload in space.optimizer_offloads(zero):
                per_param = resident_bytes_per_param(framework=w.framework, precision=w.precision, zero=zero,
                                                     shard=shard, optimizer_offload=offload, tp=layout.tp,
                                                     pp=layout.pp)
                grads = 0.0
                if follows:
                    grads = state_bytes_per_param(framework=w.framework, precision=w.precision, zero=zero,
                                                  shard=shard, optimizer_offload=offload, pp=layout.pp).grads
                rates.append((per_param, grads))
    return min((max(p * (per_param - grads) + max(p * grads, act) for p, act in ranks)
                for per_param, grads in rates), default=math.inf)


def _layout_candidates(space: Space, cache: CostCache, layout: Layout, prune: bool, top: _TopK):
    """Estimate the candidates of a layout, skipping those dominated by a fitting one.

    A group whose pipeline with recompute none and least optimizer step is slower than the k-th
    best is skipped whole; so is a recompute policy whose memory bound (``_policy_memory_bound``)
    exceeds the device, and the group when the fastest of the policies that may fit is too slow. A
    candidate whose pipeline and least optimizer step are slower than the k-th best is skipped with
    those of more offload and a policy no faster (``policies.no_slower``); of the others memory is
    checked next: a candidate that does not fit is yielded as ``_Unfit`` (for the no-fit message),
    one that fits is estimated (and those of more offload and a policy no faster are skipped)."""
    capacity, host_capacity = cache.cluster.device.memory_bytes, cache.cluster.host_memory_bytes
    for schedule, vpp in space.schedules(layout):
        if prune and SCHEDULES[schedule].dominated_by and space.k.schedule is None:
            continue      # no faster than another schedule, more activations in flight: never better
        for sp in space.sequence_parallel(layout):
            base = _group_config(space, layout, schedule, vpp, sp)
            ctx = cache.context(base)
            policies = distinct_policies(cache, ctx, space.recomputes())     # fastest first
            may_fit: dict[str, bool] = {}      # recompute policy -> whether its memory bound fits (lazily)
            if prune:
                if _group_time_bound(space, cache, layout, base) >= top.threshold:
                    continue
                # every candidate here recomputes all its blocks alike: the fastest policies whose memory
                # bound fits bound the group's time (a policy no faster than one of them is not needed)
                fitting: list[str] = []
                for policy in policies:
                    if any(no_slower(cache, ctx, f, policy) for f in fitting):
                        continue
                    may_fit[policy] = _policy_memory_bound(space, cache, layout, base, policy) <= capacity
                    if may_fit[policy]:
                        fitting.append(policy)
                if not fitting:
                    yield _SkippedForMemory()
                    continue
                if fitting != ["none"] and min(_group_time_bound(space, cache, layout, space.with_recompute(
                        base, policy)) for policy in fitting) >= top.threshold:
                    continue
            for zero in space.zeros(layout, schedule):
                done: list[tuple[int, str]] = []     # fitting, or too slow: more offload, no faster policy, no better
                for offload in space.optimizer_offloads(zero):
                    for policy in policies:
                        o = int(offload)
                        if prune and any(fo <= o and no_slower(cache, ctx, fp, policy) for fo, fp in done):
                            continue
                        config = space.config(layout, schedule, vpp, sp, zero, offload, policy)
                        if prune:
                            if policy not in may_fit:
                                may_fit[policy] = _policy_memory_bound(space, cache, layout, base, policy) <= capacity
                            if not may_fit[policy]:
                                continue
                            # memory first (most candidates that get this far do not fit), then its
                            # pipeline and its optimizer step on its most loaded rank: too slow, and so is
                            # every choice with more offload (a slower optimizer step, as this search
                            # assumes throughout) and a policy no faster (a longer pipeline)
                            device, host = peak_memory(cache, config)
                            if device > capacity or host > host_capacity:
                                yield _Unfit(config=config, memory=device, host_fits=host <= host_capacity)
                                continue
                            done.append((o, policy))
                            params = max(rank.params for rank in rank_costs(cache, config))
                            least_opt = params * least_optimizer_rate(space, layout, cache, config, schedule, zero,
                                                                      config.optimizer_offload)
                            if rank_pipeline_s(cache, config) + least_opt >= top.threshold:
                                continue
                        yield Candidate(config=config, estimate=estimate(space.graph, cache.cluster, space.w, config,
                                                                         cache))


class _SkippedForMemory:
    """A group of candidates whose memory lower bound exceeds the device."""


@dataclass(frozen=True, kw_only=True)
class _Unfit:
    """A candidate known not to fit, with the memory it needs (no time estimated)."""

    config: ParallelConfig
    memory: float
    host_fits: bool = True

    @property
    def need(self) -> tuple[bool, float]:       # as ``_need``
        return not self.host_fits, self.memory


def _frugal_candidates(space: Space, cache: CostCache, layout: Layout):
    """The least-memory choices of a layout: for each ZeRO stage, the offload and recompute policy that
    need the least memory on the device."""
    for schedule, vpp in space.schedules(layout):
        if SCHEDULES[schedule].dominated_by and space.k.schedule is None:
            continue
        for sp in space.sequence_parallel(layout):
            for zero in space.zeros(layout, schedule):
                configs = list(space.configs(layout, schedule, vpp, sp, zero))
                frugal = min(configs, key=lambda c: (peak_memory(cache, c)[0], -int(c.optimizer_offload)))
                yield Candidate(config=frugal, estimate=estimate(space.graph, cache.cluster, space.w, frugal, cache))


def evaluate(graph: LayerGraph, cluster: Cluster, workload: Workload, config: ParallelConfig) -> Candidate:
    """A fully fixed config: check it and estimate it (it may not fit)."""
    space = Space(graph, cluster.num_gpus, workload, Knobs(), cluster.device.dtypes, cluster.device_kind)
    space.check(config)
    return Candidate(config=config, estimate=estimate(graph, cluster, workload, config))


def with_microbatches(config: ParallelConfig, global_batch: int) -> ParallelConfig:
    return replace(config, num_microbatches=global_batch // (config.dp * config.micro_batch))
