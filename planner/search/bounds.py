"""Lower bounds on the step time and memory of a layout's candidates, without estimating them: what
lets the search skip layouts and groups that cannot win (never a guess: each is below every
candidate it stands for)."""
from __future__ import annotations

import math

from ..config import ParallelConfig
from ..cost.memory import resident_bytes_per_param, state_bytes_per_param
from ..cost.step import CostCache, expert_shard, grads_follow_activations_at, optimizer_time_s
from ..schedules import SCHEDULES
from .space import Layout, Space


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
            one = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, micro_batch=1,
                                 num_microbatches=1)
            params = self.cache.totals(self.cache.context(one))[2] / layout.pp
            self._floor[layout] = self._order[layout] + optimizer_floor(self.space, layout, self.cache, one, params)
        return self._floor[layout]

    def time(self, layout: Layout) -> float:
        if layout not in self._time:
            self._time[layout] = self._time_bound(layout)
        return self._time[layout]

    def _pipeline_bound(self, layout: Layout, m: int, work: float, wgrad: float) -> float:
        """The least pipeline time over the layout's schedules (``PipelineSchedule.pipeline_s``) with every rank
        at the mean rank's ``work`` seconds per micro-batch, no send waiting, and the split-backward schedules
        taking ``wgrad`` seconds of weight gradients out of the bubble (they take the least rank's: at most the
        mean rank's, which ``wgrad`` must bound)."""
        p = layout.pp
        memo = self.__dict__.setdefault("_schedules_memo", {})
        key = (p, m)                # what the schedules offered depend on besides the pipeline depth
        if key not in memo:
            memo[key] = [(SCHEDULES[s], v) for s, v in self.space.schedules(layout)]
        return min((record.pipeline_s(slowest=work, total=work * p, m=m, p=p, v=v,
                                      wgrad_s=wgrad if record.backward == "split" else 0.0)
                    for record, v in memo[key]), default=(m + p - 1) * work)

    def _order_bound(self, layout: Layout) -> float:
        """The pipeline of the mean rank's linear work floor: the floor of one micro-batch depends on
        (tp, pp, cp, dp) only (memoised on those), the least over sequence parallelism. The weight gradients
        the split-backward schedules subtract are bounded by those of micro-batch 1 times the micro-batch
        (per token they only fall as the micro-batch grows: GEMMs run no slower)."""
        space, pp = self.space, layout.pp
        m = layout.num_microbatches(space.w.global_batch)
        memo = self.__dict__.setdefault("_order_memo", {})
        key = (layout.tp, pp, layout.cp, layout.dp)
        found = memo.get(key)
        if found is None:
            found = memo[key] = []
            for sp in space.sequence_parallel(layout):
                one = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=pp, cp=layout.cp, ep=layout.ep, micro_batch=1,
                                     num_microbatches=m, sequence_parallel=sp)
                for ctx in self.cache.contexts(one, space.zeros(layout)):     # each eager regime of its ZeRO stages
                    found.append((self.cache.totals(ctx)[3] / pp, self._wgrad(ctx) / pp))
        return min(self._pipeline_bound(layout, m, floor * layout.micro_batch, wgrad * layout.micro_batch)
                   for floor, wgrad in found)

    def _wgrad(self, ctx) -> float:
        """The weight-gradient seconds of ``ctx``'s layers (zero where no searched schedule splits the backward)."""
        return self.cache.wgrad_total(ctx) if self._splits_backward else 0.0

    @property
    def _splits_backward(self) -> bool:
        return any(SCHEDULES[s].backward == "split" for s in self.space.can.schedules)

    def _time_bound(self, layout: Layout) -> float:
        space, cache = self.space, self.cache
        if self.memory(layout) > cache.usable_bytes:
            return float("inf")
        m = layout.num_microbatches(space.w.global_batch)
        best = float("inf")
        for sp in space.sequence_parallel(layout):
            cfg = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                                 micro_batch=layout.micro_batch, num_microbatches=m, sequence_parallel=sp)
            for ctx in cache.contexts(cfg, space.zeros(layout)):     # each eager regime of its ZeRO stages
                work, _, params, _ = cache.totals(ctx)
                pipe = self._pipeline_bound(layout, m, work / layout.pp, self._wgrad(ctx) / layout.pp)  # the mean rank
                # the step adds the slowest rank's optimizer to the pipeline
                best = min(best, pipe + optimizer_floor(space, layout, cache, cfg, params / layout.pp))
        return best

    def _memory_bound(self, layout: Layout) -> float:
        space, cache = self.space, self.cache
        best_act = float("inf")
        params = 0.0
        for sp in space.sequence_parallel(layout):
            one = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, micro_batch=1,
                                 num_microbatches=1, sequence_parallel=sp)
            for ctx in cache.contexts(one, space.zeros(layout)):     # each eager regime of its ZeRO stages
                _, act, params, _ = cache.totals(ctx)
                best_act = min(best_act, layout.micro_batch * act / layout.pp)
        params /= layout.pp
        base = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                              micro_batch=layout.micro_batch,
                              num_microbatches=layout.num_microbatches(space.w.global_batch))
        return least_state_and_activation_bytes(space, layout, base, None, [(params, best_act)]) \
            + cache.cluster.device.reserved_bytes


def layout_order(space: Space, cache: CostCache) -> tuple[list[Layout], LayoutBounds]:
    """The layouts, most promising first (by their time floor), and their bounds."""
    layouts = list(space.layouts())
    bounds = LayoutBounds(space, cache, layouts)
    return sorted(layouts, key=bounds.order), bounds


def optimizer_floor(space: Space, layout: Layout, cache: CostCache, base: ParallelConfig, params: float,
                    schedule: str | None = None) -> float:
    """The least optimizer step over the layout's ZeRO/optimizer-offload choices for a rank of ``params``
    parameters: the step adds the slowest rank's optimizer (``cost.step.estimate``), which holds at
    least the mean rank's parameters (``optimizer_time_s`` grows with them)."""
    return params * least_optimizer_rate(space, layout, cache, base, schedule)


def least_optimizer_rate(space: Space, layout: Layout, cache: CostCache, base: ParallelConfig,
                         schedule: str | None = None, zero: int | None = None, offload: bool | None = None) -> float:
    """Seconds per parameter of the fastest optimizer step over the layout's ZeRO/optimizer-offload choices (of
    ZeRO stage ``zero`` and offload ``offload`` only, when given): ``optimizer_time_s`` is linear in
    the parameters (every term is bytes per parameter over a bandwidth), so one rate per choice,
    memoised on the cache."""
    key = (base.dp, base.cp, base.tp, base.pp, base.num_microbatches, schedule if zero is None else None, zero,
           offload, layout.ep)
    memo = cache.__dict__.setdefault("_least_optimizer_rate", {})
    out = memo.get(key)
    if out is None:
        zeros = space.zeros(layout, schedule) if zero is None else [zero]
        # a parameter is a dense one or, under expert parallelism, a routed expert's (its own shard): the lesser
        out = memo[key] = min((min(optimizer_time_s(cache, base.but(zero=z, optimizer_offload=o), 1.0, e)
                                   for e in ((0.0, 1.0) if layout.ep > 1 else (0.0,)))
                               for z in zeros for o in space.optimizer_offloads(z) if offload in (None, o)),
                              default=0.0)
    return out


def least_state_and_activation_bytes(space: Space, layout: Layout, base: ParallelConfig, schedule: str | None,
                                      ranks: list[tuple[float, float]]) -> float:
    """The least over the layout's ZeRO/optimizer-offload choices of the most loaded rank's model states plus
    activations, for (parameters, activation bytes) per rank: their sum, or where gradients only
    follow the activations (planner.cost.step.grads_follow_activations) the larger of the two."""
    w = space.w
    # the most ranks any parameter's states are sharded over: dp x cp, or the expert data-parallel size where larger
    # (bytes per parameter only fall with the shard: a bound for both kinds of parameter)
    shard = max(layout.dp * layout.cp, expert_shard(base, w.framework))
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
                                                     pp=layout.pp, param_offload=space.param_offload,
                                                     grads_16bit=w.grad_reduce_in_bf16)
                grads = 0.0
                if follows:
                    grads = state_bytes_per_param(framework=w.framework, precision=w.precision, zero=zero,
                                                  shard=shard, optimizer_offload=offload, pp=layout.pp,
                                                  param_offload=space.param_offload,
                                                  grads_16bit=w.grad_reduce_in_bf16).grads
                rates.append((per_param, grads))
    return min((max(p * (per_param - grads) + max(p * grads, act) for p, act in ranks)
                for per_param, grads in rates), default=math.inf)
