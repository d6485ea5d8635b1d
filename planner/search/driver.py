"""The two-level search: global choices enumerated, per-stage choices by an ILP.

1. Global choices (tp, pp, cp, dp, micro-batch, schedule, virtual stages, sequence
   parallelism) are enumerated (``space.py``).
2. Uniform candidates (balanced stages, one recompute policy) are estimated first,
   pruned only by bounds and dominance (``uniform.py``, ``bounds.py``): a strong incumbent.
3. For every group of global choices and every ZeRO/optimizer-offload option whose lower bound
   (``stages.option_lower_bounds``: the exact memory-free pipeline optimum, the least
   recompute memory forces, the optimizer, rank 0's own data-parallel time) is below
   the best found, the stage ILP (``ilp.py``) chooses stage sizes and recompute per
   block under that option, with the best as its cutoff (one ILP per option: smaller
   than one choosing between them, and options that cannot win are not solved).

Nothing is pruned by a guess: every skipped group has a lower bound within
``OPTIMALITY_GAP`` of a candidate already found, so the winner is the cost model's
optimum over the space to within that gap (``exhaustive.py`` enumerates the same
space one candidate at a time to prove it). The stage ILPs run only where they could
beat the winner; the runners-up are the best plans found for the other layouts (each
layout's best balanced-stage plan, improved where an ILP ran).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from ..cluster import Cluster
from ..config import ParallelConfig, Workload
from ..cost.step import CostCache, estimate, peak_memory
from ..errors import UserError
from ..estimate import Candidate
from ..layers import LayerGraph
from ..recompute import POLICIES, every_k, first_blocks, summary_policy
from ..schedules import SCHEDULES
from ..simulate import played_candidate
from .bounds import LayoutBounds, layout_order, optimizer_floor
from .result import OPTIMALITY_GAP, SearchResult, TopK, choose, error_bands, sort_key
from .space import Knobs, Layout, Space
from .stages import graph_shape, option_lower_bounds, regime_problems
from .uniform import least_memory_candidate, uniform_phase

SOLVER_CHOICES = ("cbc", "highs", "exhaustive", "uniform")
PREFER_CHOICES = ("headroom", "fastest")


def default_solver() -> str:
    """HiGHS where highspy is installed: it solves in the planner's own process, where PuLP runs
    CBC as a new process per ILP (about 70 ms each to start on a laptop-class core; a search runs
    up to a few dozen). Otherwise CBC, which ships with PuLP."""
    import importlib.util
    return "highs" if importlib.util.find_spec("highspy") is not None else "cbc"

# a group is skipped when its bound is within OPTIMALITY_GAP (0.1%) of the winner (result.py)


@dataclass
class StageStats:
    groups: int = 0           # global choices (layout x schedule x vpp x sp)
    solved: int = 0           # stage ILPs (or exhaustive enumerations) run
    improved: int = 0         # of which found a better plan than the uniform ones
    unproven: int = 0         # of which the solver stopped at its time limit, its solution not proven optimal
    space: int = 0            # candidates of the full space (closed form), all groups


def search(graph: LayerGraph, cluster: Cluster, workload: Workload, knobs: Knobs = Knobs(), *, top_k: int = 5,
           solver: str | None = None, prune: bool = True, time_limit_s: float = 20.0, progress=None,
           simulate: bool = True, prefer: str = "headroom", bound_s: float = float("inf"),
           seeds: tuple[ParallelConfig, ...] = (), least_memory: bool = True) -> SearchResult:
    """The fastest plan that fits, the best plan of each of the next ``top_k`` layouts,
    and how much of the space was covered.

    ``solver``: "cbc" or "highs" for the stage ILPs (None: ``default_solver()``), "exhaustive" to enumerate every
    stage split and recompute assignment instead (small models only), "uniform" for
    balanced stages and one recompute policy only. ``simulate``: the final ranking of
    the few finalists by their simulated step (``planner/simulate.py``), whose times
    replace the closed form's in their estimates. ``prefer``: "headroom" (the default) recommends, among
    the plans within the validation's median step-time error of the fastest, a safer one where there is
    one (``result.choose``: no more mechanisms, more memory left); "fastest" keeps the fastest. ``bound_s``: only
    plans faster than it are sought (``TopK``'s cap); none found, ``best`` is None as when nothing fits.
    ``seeds``: configs known to be good (another precision's plans), estimated and held before the search starts,
    so its pruning bites from the first layout; the knobs still decide what is legal. ``least_memory``: when nothing
    fits, also find the plan needing the least memory (``SearchResult.least_memory``, for the no-fit message)."""
    t0 = time.perf_counter()
    solver = solver or default_solver()
    space = Space(graph, cluster.num_gpus, workload, knobs, cluster.device.dtypes, cluster.device_kind)
    check_nvme(bool(knobs.nvme_offload), cluster)
    cache = CostCache(graph, cluster, workload)
    # ranked by simulation at the end, the candidates whose closed form does not hold are ranked by their played
    # pipeline as they come (simulate.played_candidate); without, by the closed form alone (what the ILP solves)
    top = TopK(top_k + 1, cap=bound_s, played=(lambda c, bar: played_candidate(cache, c, bar)) if simulate else None)
    for config in seeds:
        try:
            space.check(config)
        except UserError:
            continue
        if all(getattr(knobs, k) in (None, getattr(config, k)) for k in ("dp", "tp", "pp", "cp", "ep", "zero",
                                                                          "micro_batch", "vpp", "schedule")):
            seed = Candidate(config=config, estimate=estimate(graph, cluster, workload, config, cache))
            if seed.estimate.fits:
                top.add(seed)
    order, bounds = layout_order(space, cache)
    stats = uniform_phase(space, cache, top, order, bounds, prune, progress)
    stage = StageStats()
    shape = graph_shape(cache)
    # a fixed every-K pattern fixes each block's policy by its index in the model: balanced stages only
    if solver != "uniform" and shape is not None and not every_k(knobs.recompute) and space.can.unequal_stages:
        stage = _stage_phase(space, cache, top, order, bounds, shape, solver, prune, time_limit_s)
    if simulate:
        top.items = _rank_by_simulation(top.items, cache)
    best = top.items[0] if top.items else None
    least = None if best or not least_memory else least_memory_candidate(space, cache, stats)
    choice = None
    if best is not None:
        step_band, memory_band = error_bands(cluster, workload)
        band = step_band if prefer == "headroom" else 0.0
        best, choice = choose(best, tuple(top.items[1:]), band, memory_band)
    alternatives = tuple(c for c in top.items if c is not best)[:top_k]
    if best is not None and best.config.ep > 1 and knobs.ep is None and top_k \
            and not any(c.config.ep == 1 for c in alternatives):
        # what expert parallelism gains: the best plan without it among the runners-up (its own search; without
        # the all-to-alls to overlap, --ep-comm-overlap has nothing to do there)
        try:
            dense = search(graph, cluster, replace(workload, ep_comm_overlap=False), replace(knobs, ep=1), top_k=0,
                           solver=solver, prune=prune,
                           time_limit_s=time_limit_s, simulate=simulate, prefer="fastest", least_memory=False)
        except UserError:       # the fixed knobs need expert parallelism (a runtime whose experts need it beside tp)
            dense = None
        if dense is not None and dense.best is not None:
            alternatives = tuple(sorted(alternatives[:top_k - 1] + (dense.best,), key=lambda c: c.estimate.step_time_s))
        if dense is not None:       # its stage ILPs are the search's too: run, and stopped unproven
            stage = replace(stage, solved=stage.solved + dense.ilp_solves, unproven=stage.unproven + dense.ilp_unproven)
    return SearchResult(best=best, alternatives=alternatives, choice=choice,
                        candidates=max(stats.covered, stage.space), evaluated=stats.evaluated + stage.solved,
                        memory_checked=stats.checked, seconds=time.perf_counter() - t0, least_memory=least,
                        groups=stage.groups, ilp_solves=stage.solved, ilp_improved=stage.improved,
                        ilp_unproven=stage.unproven)


def _rank_by_simulation(finalists: list[Candidate], cache: CostCache) -> list[Candidate]:
    """The finalists with simulated estimates, fastest first: where unequal stages or
    exposed communication make the closed form wrong, the simulation decides."""
    from ..simulate import simulated_estimate
    out = [Candidate(config=c.config, estimate=simulated_estimate(cache.graph, cache.cluster, cache.workload, c.config,
                                                                  cache)) for c in finalists]
    return sorted(out, key=sort_key)


def _group_cheap_bound(space: Space, cache: CostCache, layout: Layout, schedule: str, vpp: int, sp: bool,
                       zeros: tuple[int, ...]) -> float:
    """Any split, any recompute, any of the ZeRO stages ``zeros`` (of one eager regime): the pipeline with the average
    rank's work (Tmax >= mean), plus the least optimizer step of the average rank's parameters (the slowest rank's
    is on the path). The total work does not depend on where layers go: summed per layer signature."""
    m = layout.num_microbatches(space.w.global_batch)
    config = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, micro_batch=layout.micro_batch,
                            num_microbatches=m, sequence_parallel=sp, zero=zeros[0])
    ctx = cache.context(config)
    work, _, params, _ = cache.totals(ctx)
    p = layout.pp
    optimizer = optimizer_floor(space, layout, cache, config, params / p, schedule)
    # split-backward schedules subtract the least rank's weight gradients, at most the mean rank's
    return SCHEDULES[schedule].pipeline_s(slowest=work / p, total=work, m=m, p=p, v=vpp,
                                          wgrad_s=cache.wgrad_total(ctx) / p) + optimizer


def _stage_phase(space: Space, cache: CostCache, top: TopK, order: list[Layout], bounds: LayoutBounds, shape,
                 solver: str, prune: bool, time_limit_s: float) -> StageStats:
    stats = StageStats()

    def threshold() -> float:
        """What a group must beat to be worth solving: the winner, less the gap."""
        if not prune or not top.items:
            return math.inf
        return top.items[0].estimate.step_time_s * (1 - OPTIMALITY_GAP)

    for layout in order:
        for schedule, vpp in space.schedules(layout):
            if SCHEDULES[schedule].dominated_by and space.k.schedule is None:
                continue      # no faster than another schedule, with no less in flight: never better
            for sp in space.sequence_parallel(layout, schedule):
                stats.groups += 1
                if layout.pp * vpp > len(shape.blocks):
                    continue
                stats.space += _group_space(space, layout, vpp, shape, schedule)
                if prune and (bounds.floor(layout) >= threshold() or bounds.time(layout) >= threshold()):
                    continue

                def may_win(zeros: tuple[int, ...]) -> bool:
                    return not prune or _group_cheap_bound(space, cache, layout, schedule, vpp, sp, zeros) < threshold()
                # one problem per eager regime of the ZeRO stages (torch: FSDP2's bf16 layers, or autocast's) whose
                # bound can still win
                groups = []
                for whole in regime_problems(space, cache, layout, schedule, vpp, sp, shape, keep=may_win):
                    # a runtime that takes one recompute policy for every block: one group per policy
                    groups += [whole] if space.can.recompute_per_layer else [
                        whole.with_policies((policy,)) for policy in whole.policies]
                    if space.offloads_first_blocks(layout):
                        groups.append(whole.with_policies(FIRST_BLOCKS_OFFLOAD))
                problems = []
                for pr in groups:
                    # one problem per ZeRO/optimizer-offload option whose own bound can still win, most promising
                    # first: without the choice between options (binaries and big-M rows) each ILP is
                    # smaller, and the options that cannot win are not solved at all
                    if not prune:
                        problems.append((-math.inf, pr))
                        continue
                    lowers, _ = option_lower_bounds(pr, stop_at=threshold())
                    winners = [(lower, pr.with_options([pr.options[k]]))
                               for k, lower in enumerate(lowers) if lower < threshold()]
                    if solver == "exhaustive" and winners:      # the reference enumerates the whole group
                        winners = [(-math.inf, pr)]
                    problems += winners
                problems.sort(key=lambda item: item[0])
                for lower, problem in problems:
                    if lower >= threshold():        # a plan found meanwhile beats this option's bound
                        continue
                    stats.solved += 1
                    cutoff = top.items[0].estimate.step_time_s if prune and top.items else None
                    if solver == "exhaustive":
                        from .exhaustive import solve_group_exhaustively
                        found = solve_group_exhaustively(problem)
                    else:
                        from .ilp import solve_group     # PuLP and the solver load when a group needs them
                        found = solve_group(problem, solver, time_limit_s, cutoff_s=cutoff)
                    if found is None:
                        continue
                    counts, option, _, proven = found
                    stats.unproven += not proven
                    if counts is None:          # stopped at its time limit with no plan in hand
                        continue
                    config = problem.config(counts, option)
                    est = estimate(space.graph, cache.cluster, space.w, config, cache)
                    offload_group = problem.policies == FIRST_BLOCKS_OFFLOAD
                    if space.k.recompute is None and (space.can.recompute_per_layer or offload_group):
                        # a fixed --recompute is the user's, not lightened; nor is one policy for every block
                        lighter = least_recompute(cache, config, problem.policies)
                        lighter_est = estimate(space.graph, cache.cluster, space.w, lighter, cache)
                        # less recompute can expose more data-parallel time (a shorter backward hides less)
                        if lighter_est.step_time_s <= est.step_time_s:
                            config, est = lighter, lighter_est
                    if offload_group:           # the runtime offloads its first N blocks, N below the model's
                        offloaded = config.recompute_layers.count("activation-offload")
                        if not 0 < offloaded < len(shape.blocks):
                            continue
                        layers = first_blocks(space.graph, offloaded, "activation-offload")
                        config = config.but(recompute=summary_policy(layers), recompute_layers=layers)
                        est = estimate(space.graph, cache.cluster, space.w, config, cache)
                    if est.fits:
                        before = top.items[0].estimate.step_time_s if top.items else math.inf
                        top.add(Candidate(config=config, estimate=est))
                        if est.step_time_s < before * (1 - 1e-9):
                            stats.improved += 1
    return stats


# activation offload on some blocks and none on the others (``Space.offloads_first_blocks``)
FIRST_BLOCKS_OFFLOAD = ("none", "activation-offload")


def least_recompute(cache: CostCache, config: ParallelConfig, allowed) -> ParallelConfig:
    """``config`` with each recomputed layer, in order, moved to the fastest of the ``allowed`` policies that
    add less time to that layer (or as little, and are simpler: earlier in ``POLICIES``) and still fit: the
    stage ILP only sees the slowest rank, so where recompute on another rank costs it nothing its solvers
    may leave any of it in; this keeps only what memory requires (which the step, simulated rank by rank,
    does see)."""
    if config.recompute_layers is None:
        return config
    policies = list(config.recompute_layers)
    capacity, host_capacity = cache.usable_bytes, cache.cluster.job_host_memory_bytes
    ctx = cache.context(config)
    for i, policy in enumerate(policies):
        if policy == "none":
            continue
        cost = cache.layer(i, ctx)

        def cheaper(p: str) -> tuple[float, int]:
            return cost.policy(p).recompute_s, POLICIES.index(p)
        for lighter in sorted((p for p in allowed if cheaper(p) < cheaper(policy)), key=cheaper):
            trial = replace(config, recompute_layers=tuple(policies[:i] + [lighter] + policies[i + 1:]))
            device, host = peak_memory(cache, trial)
            if device <= capacity and host <= host_capacity:
                policies[i] = lighter
                break
    return replace(config, recompute=summary_policy(policies), recompute_layers=tuple(policies))


def _group_space(space: Space, layout: Layout, vpp: int, shape, schedule: str | None = None) -> int:
    """Candidates of one group in closed form, whether it was pruned or solved: stage splits x
    recompute assignments x ZeRO/optimizer-offload options, i.e. the p x |policies| non-negative integer
    matrices with row sums >= v adding up to the blocks (dominated policies included: the ILP
    leaves them out because they cannot win, not because they are not candidates)."""
    p, blocks = layout.pp, len(shape.blocks)
    key = (p, vpp, schedule, layout.tp > 1, layout.cp > 1, layout.dp * layout.cp == 1, layout.ep > 1)   # what zeros() depends on
    memo = space.__dict__.setdefault("_group_space", {})
    if key not in memo:
        policies = len(space.recomputes(layout))
        options = sum(len(space.optimizer_offloads(z)) for z in space.zeros(layout, schedule))
        free = blocks - p * vpp
        if free < 0:
            memo[key] = 0
        elif space.can.recompute_per_layer:
            cells = p * policies
            memo[key] = math.comb(free + cells - 1, cells - 1) * options
        else:       # one policy for every block: the splits of each policy (and activation offload on the
            # first 1 to L - 1 blocks where the runtime offloads its first blocks: pp 1, one split)
            offloads = blocks - 1 if space.offloads_first_blocks(layout) else 0
            memo[key] = (math.comb(free + p - 1, p - 1) * policies + offloads) * options
    return memo[key]


def evaluate(graph: LayerGraph, cluster: Cluster, workload: Workload, config: ParallelConfig) -> Candidate:
    """A fully fixed config: check it and estimate it (it may not fit)."""
    space = Space(graph, cluster.num_gpus, workload, Knobs(), cluster.device.dtypes, cluster.device_kind)
    space.check(config)
    check_nvme(config.nvme_offload, cluster)
    return Candidate(config=config, estimate=estimate(graph, cluster, workload, config))


def check_nvme(nvme_offload: bool, cluster: Cluster) -> None:
    """Offload to NVMe needs a profile that describes the nodes' drives, else UserError naming the flag."""
    if nvme_offload and not cluster.nvme_bytes:
        raise UserError(f"{cluster.name} describes no local NVMe ([host] nvme_GiB, nvme_read_GBps, nvme_write_GBps "
                        "in its profile); allowed: off, or a profile that gives them", field="--nvme-offload")
