"""The search's first phase: every candidate with balanced stages and one recompute policy for all blocks,
enumerated and pruned only by bounds and dominance (never by guesses).

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

from dataclasses import dataclass, field

from ..config import ParallelConfig
from ..cost.step import CostCache, estimate, inflight_microbatches, peak_memory, rank_costs, rank_pipeline_s
from ..estimate import Candidate
from ..placement import balanced_stage_layers
from ..recompute import first_blocks
from ..schedules import SCHEDULES
from .bounds import LayoutBounds, least_optimizer_rate, least_state_and_activation_bytes, optimizer_floor
from .policies import distinct_policies, no_slower
from .result import TopK
from .space import Layout, Space


@dataclass
class _Stats:
    covered: int = 0          # uniform configurations covered
    evaluated: int = 0        # estimated in full
    checked: int = 0          # rejected on memory alone
    least: Candidate | None = None
    least_unfit: "_Unfit | None" = None
    infeasible_layouts: list = field(default_factory=list)


def uniform_phase(space: Space, cache: CostCache, top: TopK, order: list[Layout], bounds: LayoutBounds,
                  prune: bool, progress=None) -> _Stats:
    """Every candidate with balanced stages and one recompute policy for all blocks,
    pruned only by bounds and dominance: a strong incumbent for the stage ILPs."""
    stats = _Stats()
    capacity = cache.usable_bytes
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


def _layout_size(space: Space, layout: Layout) -> int:
    """Number of legal configs in a layout (for the coverage count), memoised on what the
    schedules, ZeRO stages and sequence-parallel choices of a layout depend on."""
    m = layout.num_microbatches(space.w.global_batch)
    key = (layout.pp, m % layout.pp == 0, layout.tp > 1, layout.dp > 1, layout.dp * layout.cp == 1, layout.ep > 1)
    sizes = space.__dict__.setdefault("_layout_sizes", {})
    if key not in sizes:
        sizes[key] = _count_layout(space, layout)
    return sizes[key]


def _count_layout(space: Space, layout: Layout) -> int:
    n = 0
    for schedule, vpp in space.schedules(layout):
        for _ in space.sequence_parallel(layout, schedule):
            for zero in space.zeros(layout, schedule):
                # each recompute policy on every block; activation offload on the first 1 to L - 1 blocks
                # where the runtime offloads its first blocks, full recompute on the first 1 to S - 1 of each
                # stage of S blocks where it recomputes those (the fewest that fit are estimated)
                per_stage = -(-space.blocks // (layout.pp * vpp))
                policies = len(space.recomputes(layout)) + (
                    space.blocks - 1 if space.offloads_first_blocks(layout) else 0) + (
                    per_stage - 1 if space.recomputes_first_blocks(layout) else 0)
                n += len(space.optimizer_offloads(zero)) * policies
    return n


def _group_config(space: Space, layout: Layout, schedule: str, vpp: int, sp: bool) -> ParallelConfig:
    m = layout.num_microbatches(space.w.global_batch)
    return ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, micro_batch=layout.micro_batch,
                          num_microbatches=m, vpp=vpp, schedule=schedule, sequence_parallel=sp)


def _group_time_bound(space: Space, cache: CostCache, layout: Layout, base: ParallelConfig) -> float:
    """A lower bound on the step time over the ZeRO/optimizer-offload/recompute choices of one group: the
    pipeline with recompute none (the other choices only add to it) and the least optimizer step
    of its most loaded rank."""
    params = max(r.params for r in rank_costs(cache, base))
    return rank_pipeline_s(cache, base) + optimizer_floor(space, layout, cache, base, params, base.schedule)


def _policy_memory_bound(space: Space, cache: CostCache, layout: Layout, base: ParallelConfig, policy: str) -> float:
    """For one recompute policy, a lower bound on the memory of the group's most loaded GPU: the least,
    over the ZeRO/optimizer-offload choices, of each rank's model states plus its activations (those of its
    micro-batches in flight and its transient peak) and the runtime reserve; where gradients only
    follow the activations (planner.cost.step.grads_follow_activations), the larger of the two
    instead of their sum. Bounded per policy, not by full recompute for all: a one-layer stage with
    one micro-batch in flight needs more under full recompute (the recomputed layer's transient)
    than without."""
    inflight = [inflight_microbatches(base, r, space.w) for r in range(base.pp)]
    ranks = rank_costs(cache, space.with_recompute(base, policy))
    return cache.cluster.device.reserved_bytes + least_state_and_activation_bytes(
        space, layout, base, base.schedule,
        [(r.params, r.act_bytes * f + r.peak_extra_bytes) for r, f in zip(ranks, inflight)])


def _layout_candidates(space: Space, cache: CostCache, layout: Layout, prune: bool, top: TopK):
    """Estimate the candidates of a layout, skipping those dominated by a fitting one.

    A group whose pipeline with recompute none and least optimizer step is slower than the k-th
    best is skipped whole; so is a recompute policy whose memory bound (``_policy_memory_bound``)
    exceeds the device, and the group when the fastest of the policies that may fit is too slow. A
    candidate whose pipeline and least optimizer step are slower than the k-th best is skipped with
    those of more offload and a policy no faster (``policies.no_slower``); of the others memory is
    checked next: a candidate that does not fit is yielded as ``_Unfit`` (for the no-fit message),
    one that fits is estimated (and those of more offload and a policy no faster are skipped)."""
    capacity, host_capacity = cache.usable_bytes, cache.cluster.job_host_memory_bytes
    for schedule, vpp in space.schedules(layout):
        if prune and SCHEDULES[schedule].dominated_by and space.k.schedule is None:
            continue      # no faster than another schedule, more activations in flight: never better
        for sp in space.sequence_parallel(layout, schedule):
            group = _group_config(space, layout, schedule, vpp, sp)
            # the ZeRO stages by the eager regime their layers run in (torch: FSDP2 in bf16, or autocast), each
            # priced in its own; bounded in the cheapest where one is cheapest for every layer (each bound once)
            zeros_all = space.zeros(layout, schedule)
            shared = cache.bound_config(group, zeros_all)
            bounds: dict[tuple, float] = {}

            def bound(kind: str, base: ParallelConfig, policy: str | None = None) -> float:
                """The group's time bound (at ``policy`` for every block, or none) or its memory bound at ``policy``,
                priced at ``shared`` where there is one, else at ``base``."""
                at = base if shared is None else shared
                key = (kind, policy, None if shared is not None else base.zero)
                if key not in bounds:
                    if kind == "time":
                        bounds[key] = _group_time_bound(space, cache, layout,
                                                        at if policy is None else space.with_recompute(at, policy))
                    else:
                        bounds[key] = _policy_memory_bound(space, cache, layout, at, policy)
                return bounds[key]
            for zeros in cache.regime_zeros(group, zeros_all):
                base = group.but(zero=zeros[0])
                ctx = cache.context(base)
                threshold = top.threshold if prune else float("inf")
                if space.offloads_first_blocks(layout):
                    yield from _first_blocks_candidates(space, cache, layout, schedule, vpp, sp, zeros,
                                                        "activation-offload", False, threshold)
                policies = distinct_policies(cache, ctx, space.recomputes(layout))     # fastest first
                may_fit: dict[str, bool] = {}      # recompute policy -> whether its memory bound fits (lazily)
                if prune:
                    if bound("time", base) >= top.threshold:
                        continue
                    # every candidate here recomputes all its blocks alike: the fastest policies whose memory
                    # bound fits bound the group's time (a policy no faster than one of them is not needed)
                    fitting: list[str] = []
                    for policy in policies:
                        if any(no_slower(cache, ctx, f, policy) for f in fitting):
                            continue
                        may_fit[policy] = bound("memory", base, policy) <= capacity
                        if may_fit[policy]:
                            fitting.append(policy)
                    if not fitting:
                        yield _SkippedForMemory()
                        continue
                    if fitting != ["none"] and min(bound("time", base, policy) for policy in fitting) >= top.threshold:
                        continue
                # full recompute on the first blocks of each stage holds more than on every block: not where that
                # cannot fit
                if space.recomputes_first_blocks(layout) and (not prune or bound("memory", base, "full") <= capacity):
                    yield from _first_blocks_candidates(space, cache, layout, schedule, vpp, sp, zeros, "full", True,
                                                        threshold)
                for zero in zeros:
                    # fitting, or too slow: those with more offload and a policy no faster are no better
                    done: list[tuple[int, str]] = []
                    for offload in space.optimizer_offloads(zero):
                        for policy in policies:
                            o = int(offload)
                            if prune and any(fo <= o and no_slower(cache, ctx, fp, policy) for fo, fp in done):
                                continue
                            config = space.config(layout, schedule, vpp, sp, zero, offload, policy)
                            if prune:
                                if policy not in may_fit:
                                    may_fit[policy] = bound("memory", base, policy) <= capacity
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
                            yield Candidate(config=config,
                                            estimate=estimate(space.graph, cache.cluster, space.w, config, cache))


def _first_blocks_candidates(space: Space, cache: CostCache, layout: Layout, schedule: str, vpp: int, sp: bool,
                             zeros: tuple[int, ...], policy: str, per_stage: bool, threshold: float):
    """``_first_blocks_candidate`` of each ZeRO stage and optimizer offload of a group, those there are."""
    for zero in zeros:
        for offload in space.optimizer_offloads(zero):
            found = _first_blocks_candidate(space, cache, space.config(layout, schedule, vpp, sp, zero, offload, "none"),
                                            policy, per_stage, threshold)
            if found is not None:
                yield found


def _first_blocks_candidate(space: Space, cache: CostCache, none: ParallelConfig, policy: str,
                            per_stage: bool, threshold: float = float("inf")) -> Candidate | _Unfit | None:
    """Where ``none`` (no recompute on any block) does not fit: ``policy`` on the fewest first blocks that fit, of
    the model (activation offload: ``Space.offloads_first_blocks``) or of each (virtual) stage alike (full recompute:
    ``Space.recomputes_first_blocks``), none on the others (``recompute.first_blocks``); more such blocks hold less
    on the device and add time (offload also host memory). An ``_Unfit`` where even all blocks but the last of a
    stage leave too much on the device, or the fewest that fit too much on the host; None where ``none`` fits, or a
    stage has a single block (all of it is one policy on every block, which the uniform candidates cover), or its
    pipeline alone reaches ``threshold``."""
    capacity, host_capacity = cache.usable_bytes, cache.cluster.job_host_memory_bytes
    graph = space.graph
    stages = (none.stage_layers or balanced_stage_layers(graph, none.pp * none.vpp)) if per_stage else None
    bounds = [sum(stages[:j]) for j in range(len(stages) + 1)] if stages else [0, len(graph.layers)]
    most = max(sum(layer.is_block for layer in graph.layers[a:b]) for a, b in zip(bounds, bounds[1:]))

    def with_first(n: int) -> tuple[ParallelConfig, float, float]:
        config = none.but(recompute=policy, recompute_layers=first_blocks(graph, n, policy, stages)) if n else none
        return (config, *peak_memory(cache, config))

    _, device, host = with_first(0)
    if device <= capacity or most < 2:
        return None
    config, device, host = with_first(most - 1)
    if device > capacity:
        return _Unfit(config=config, memory=device, host_fits=host <= host_capacity)
    low, high = 1, most - 1             # the device's share falls as more blocks take the policy: the fewest that fit
    while low < high:
        mid = (low + high) // 2
        if with_first(mid)[1] <= capacity:
            high = mid
        else:
            low = mid + 1
    config, device, host = with_first(high)
    if host > host_capacity:
        return _Unfit(config=config, memory=device, host_fits=False)
    if rank_pipeline_s(cache, config) >= threshold:
        return None
    return Candidate(config=config, estimate=estimate(space.graph, cache.cluster, space.w, config, cache))


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
        for sp in space.sequence_parallel(layout, schedule):
            for zero in space.zeros(layout, schedule):
                configs = list(space.configs(layout, schedule, vpp, sp, zero))
                frugal = min(configs, key=lambda c: (peak_memory(cache, c)[0], -int(c.optimizer_offload)))
                yield Candidate(config=frugal, estimate=estimate(space.graph, cache.cluster, space.w, frugal, cache))
