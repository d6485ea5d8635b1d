"""The per-group stage problem: what the ILP and the exhaustive reference decide.

A *group* fixes the global choices (tp, pp, cp, dp, micro-batch, schedule, vpp,
sequence parallelism). Within it, the decisions are:

- how many transformer blocks each virtual stage holds (contiguous, at least one
  each; the layers before the first block go with the first stage, those after the
  last block with the last stage: Megatron-LM's and torchtitan's convention);
- the recompute policy of each block (how many blocks of each stage recompute);
- the ZeRO stage and optimizer offload.

Blocks are identical (one signature), so a stage is described by counts, and the
order of blocks inside a stage does not change any cost. ``GroupProblem`` gathers
every constant of the cost model that these decisions combine linearly.
"""
from __future__ import annotations

import copy
import heapq
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from ..config import ParallelConfig
from ..cost.layer import LayerCost
from ..cost.memory import resident_bytes_per_param, state_bytes_per_param
from ..cost.step import (CostCache, other_bytes, data_parallel_spans_nodes, dp_collectives, dp_micro_passes,
                         dp_overlaps, expert_shard, frozen_rates, inflight_microbatches, layer_network_busy_s,
                         network_crossing, optimizer_time_s, pipeline_sends_busy_s, resident_rates, sends_overlap,
                         tied_bucket, tied_embedding_sync_s, state_rates)
from ..runtimes import RUNTIMES
from ..placement import holds_head_copy, last_stage_rank, placement_of, rank_stages
from ..recompute import POLICIES, summary_policy
from ..schedules import SCHEDULES
from .policies import distinct_policies
from .space import Layout, Space


def compositions(total: int, parts: int, minimum: int):
    """Every tuple of ``parts`` integers >= ``minimum`` that adds up to ``total``."""
    if parts == 1:
        if total >= minimum:
            yield (total,)
        return
    for first in range(minimum, total - minimum * (parts - 1) + 1):
        for rest in compositions(total - first, parts - 1, minimum):
            yield (first,) + rest


@dataclass(frozen=True)
class Shape:
    """A layer graph as prefix layers, ``blocks`` identical blocks, suffix layers."""

    prefix: tuple[int, ...]
    blocks: tuple[int, ...]
    suffix: tuple[int, ...]


def graph_shape(cache: CostCache) -> Shape | None:
    """The prefix/blocks/suffix decomposition, or None when blocks are not all identical."""
    layers = cache.graph.layers
    idx = [i for i, layer in enumerate(layers) if layer.is_block]
    if not idx or idx != list(range(idx[0], idx[-1] + 1)):
        return None
    if len({layers[i].signature for i in idx}) != 1:
        return None
    return Shape(prefix=tuple(range(idx[0])), blocks=tuple(idx), suffix=tuple(range(idx[-1] + 1, len(layers))))


@dataclass(frozen=True)
class Fixed:
    """The non-block layers' share of a rank (zero when the rank holds none)."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    act_bytes: float = 0.0
    extra_bytes: float = 0.0
    params: float = 0.0                  # trainable parameters (planner/finetune.py ``Adapters.trains``)
    buckets: tuple[tuple[float, float], ...] = ()   # (trainable parameters, frozen bytes) of each non-block layer
                                                    # (one collective each)
    wgrad_s: float = 0.0                 # of bwd_s, the weight gradients (a pass of their own in split backward)
    frozen_bytes: float = 0.0            # frozen parameters' bytes (planner/finetune.py) before ZeRO sharding
    busy_fwd_s: float = 0.0              # their inter-node traffic sharing the data-parallel NICs, in forward
    busy_bwd_s: float = 0.0              # and in backward (cost.step.layer_network_busy_s)


_EMPTY = Fixed()


@dataclass(frozen=True)
class Option:
    """One (ZeRO stage, optimizer offload) choice with its per-parameter and per-layer constants."""

    zero: int
    optimizer_offload: bool
    state_bytes: float            # params + grads + optimizer bytes per parameter on the GPU
    host_bytes: float             # bytes per parameter in host memory (optimizer offload)
    other_bytes: float            # runtime reserve and communication buffers
    optimizer_s_per_param: float  # optimizer step seconds per parameter of the rank
    block_state_bytes: float = 0.0   # of one block: its parameters' device bytes (routed experts at their own
                                     # shard under expert parallelism: cost.step.resident_rates)
    block_host_bytes: float = 0.0    # of one block: host bytes of its states
    block_optimizer_s: float = 0.0   # of one block: optimizer step seconds
    frozen_share: float = 1.0        # device bytes per byte of frozen parameters (cost.memory.frozen_share)
    frozen_host_share: float = 0.0   # host bytes per byte of them

    def fixed_state_bytes(self, fixed: "Fixed") -> float:
        """Device bytes of the model states of a rank's non-block layers."""
        return fixed.params * self.state_bytes + fixed.frozen_bytes * self.frozen_share

    def fixed_host_bytes(self, fixed: "Fixed") -> float:
        """Host bytes of them (optimizer or parameter offload)."""
        return fixed.params * self.host_bytes + fixed.frozen_bytes * self.frozen_host_share


class GroupProblem:
    """Every constant the stage decisions combine, for one group of candidates."""

    def __init__(self, space: Space, cache: CostCache, layout: Layout, schedule: str, vpp: int, sp: bool,
                 shape: Shape, policies: tuple[str, ...] | None = None, zeros: tuple[int, ...] | None = None):
        """``zeros``: the ZeRO stages this problem chooses among (default: the layout's), all of one eager regime
        (``CostCache.regime_zeros``: the layers' costs are priced once, in it)."""
        self.space, self.cache, self.layout, self.shape = space, cache, layout, shape
        self.m = layout.num_microbatches(space.w.global_batch)
        self.p, self.v = layout.pp, vpp
        self.stages = self.p * self.v
        zeros = list(zeros) if zeros is not None else space.zeros(layout, schedule)
        # at the first of its ZeRO stages: the eager regime the layers and the stage-boundary sends are priced in
        self.base = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                                   micro_batch=layout.micro_batch, num_microbatches=self.m, vpp=vpp,
                                   schedule=schedule, sequence_parallel=sp, param_offload=space.param_offload,
                                   nvme_offload=space.nvme_offload, zero=zeros[0] if zeros else 0)
        # each rank's virtual stages, chunk by chunk (a loop, or a V: planner/placement.py)
        self.rank_stages = [rank_stages(placement_of(self.base), r, self.p, self.v) for r in range(self.p)]
        if len(cache.regime_zeros(self.base, zeros)) > 1:
            raise ValueError(f"ZeRO stages {zeros} run their layers in different eager regimes: one problem each")
        ctx = self.ctx = cache.context(self.base)
        self.block: LayerCost = cache.layer(shape.blocks[0], ctx)
        self.num_blocks = len(shape.blocks)
        self.policies = policies or self._useful_policies(space)
        self.hop_s = cache.hop_s(self.base)
        self.schedule = SCHEDULES[schedule]
        self.sends_overlap = sends_overlap(schedule, space.w.framework)     # else each send is in its rank's time
        self.inflight = [inflight_microbatches(self.base, r, space.w) for r in range(self.p)]
        # the inter-node traffic that shares the data-parallel collectives' NICs (cost.step.network_busy_s): the
        # stage-boundary sends', each way, and each block's per recompute policy
        self.shares_nics = data_parallel_spans_nodes(cache.cluster, self.base)
        self.crosses = network_crossing(cache, self.base)
        self.sends_busy_s = pipeline_sends_busy_s(cache, self.base) if self.shares_nics else 0.0
        self.fixed = [self._fixed(r, ctx) for r in range(self.p)]
        self.options = [self._option(z, o) for z in zeros for o in space.optimizer_offloads(z)]
        self.tied_s = tied_embedding_sync_s(cache, self.base)
        # split-backward schedules: the pipeline's closed form takes the least weight-gradient time of any rank
        # (cost.step.pipeline_s); ``wgrad_bound`` is at least it for every split, for the bounds and the ILP's cut (o)
        self.split_backward = self.schedule.backward == "split" and self.p > 1
        self.wgrad_bound = most_least_wgrad(self.block.wgrad_s, [f.wgrad_s for f in self.fixed], self.v,
                                            self.num_blocks) if self.split_backward else 0.0
        self.param_gather_overlaps = RUNTIMES[space.w.framework].timing.overlaps_param_gather
        self.frontiers: dict[Option, tuple] = {}     # optimizer_frontier per option (``with_options`` copies share it)

    def block_busy_s(self, policy: str) -> tuple[float, float]:
        """(forward, backward) seconds of one block's inter-node traffic on the data-parallel NICs under
        ``policy`` (cost.step.layer_network_busy_s; zeros where the data-parallel group stays in a node)."""
        return layer_network_busy_s(self.block, policy, *self.crosses) if self.shares_nics else (0.0, 0.0)

    def dp_overlaps(self, opt: Option) -> tuple[bool, bool]:
        """``cost.step.dp_overlaps`` of this group under option ``opt``."""
        lay, w = self.layout, self.cache.workload
        return dp_overlaps(framework=w.framework, device_kind=self.cache.cluster.device_kind,
                           overlap_grad_reduce=w.overlap_grad_reduce, zero=opt.zero, dp=lay.dp * lay.cp, tp=lay.tp,
                           pp=lay.pp, ep=lay.ep)

    # -- constants ----------------------------------------------------------------------------
    def _useful_policies(self, space: Space) -> tuple[str, ...]:
        """Recompute policies worth deciding: a fixed --recompute, else the runtime's without those whose
        costs equal another's on every block (planner/search/policies.py: selective with fused attention
        keeps what none keeps and costs nothing extra)."""
        return distinct_policies(self.cache, self.ctx, space.recomputes(self.layout))

    def _fixed(self, rank: int, ctx) -> Fixed:
        """Prefix layers sit on virtual stage 0 (rank 0), suffix layers on the last stage (rank p - 1 in a
        loop, rank 0 in a V)."""
        last = last_stage_rank(self.base)
        if rank not in (0, last):
            return _EMPTY
        layers = []
        if rank == 0:
            layers += self.shape.prefix
        if rank == last:
            layers += self.shape.suffix
        costs = [self.cache.layer(i, ctx) for i in layers]
        params = sum(c.params for c in costs)
        frozen = sum(c.frozen_bytes for c in costs)
        buckets = tuple((c.params, c.frozen_bytes) for c in costs)
        graph = self.cache.graph
        if holds_head_copy(graph, self.base, rank):
            bucket = tied_bucket(self.cache, graph.tied_params / self.layout.tp)
            params, frozen = params + bucket[0], frozen + bucket[1]
            buckets += (bucket,)
        busy = [layer_network_busy_s(c, "none", *self.crosses) for c in costs] if self.shares_nics else []
        return Fixed(fwd_s=sum(c.fwd_s for c in costs), bwd_s=sum(c.bwd_s for c in costs),
                     act_bytes=sum(c.policy("none").act_bytes for c in costs),
                     extra_bytes=max([c.policy("none").peak_extra_bytes for c in costs] or [0.0]), params=params,
                     buckets=buckets, wgrad_s=sum(c.wgrad_s for c in costs), frozen_bytes=frozen,
                     busy_fwd_s=sum(b[0] for b in busy), busy_bwd_s=sum(b[1] for b in busy))

    def _option(self, zero: int, offload: bool) -> Option:
        """Memoised on the cache: an option depends on the layout, sequence parallelism and the
        choice, not on the schedule or the virtual stages (the groups that differ only by those
        share it)."""
        key = (self.layout, self.base.sequence_parallel, zero, offload, self.base.param_offload)
        memo = self.cache.__dict__.setdefault("_stage_options", {})
        if key not in memo:
            memo[key] = self._new_option(zero, offload)
        return memo[key]

    def _new_option(self, zero: int, offload: bool) -> Option:
        cache, w, lay = self.cache, self.cache.workload, self.layout
        po = self.base.param_offload
        states = state_bytes_per_param(framework=w.framework, precision=w.precision, zero=zero,
                                       shard=lay.dp * lay.cp, optimizer_offload=offload, pp=lay.pp, param_offload=po,
                                       grads_16bit=w.grad_reduce_in_bf16)
        resident = resident_bytes_per_param(framework=w.framework, precision=w.precision, zero=zero,
                                            shard=lay.dp * lay.cp, optimizer_offload=offload, tp=lay.tp, pp=lay.pp,
                                            param_offload=po, grads_16bit=w.grad_reduce_in_bf16)
        config = self._with(zero, offload)
        block = self.block
        dense, expert_resident = resident_rates(cache, config)
        expert_host = state_rates(cache, config)[1].host
        routed = block.routed_params        # routed experts' states: their own shard (``routed_state_shard``)
        frozen, frozen_host = frozen_rates(cache, config)
        if config.nvme_offload:     # the offloaded states on NVMe: the host holds swap buffers (the estimate's check)
            states, expert_host, frozen_host = replace(states, host_optimizer=0.0, host_params=0.0, host_grads=0.0), \
                0.0, 0.0
        return Option(zero=zero, optimizer_offload=offload, state_bytes=resident, host_bytes=states.host,
                      other_bytes=other_bytes(cache, config),
                      optimizer_s_per_param=optimizer_time_s(cache, config, 1.0),
                      block_state_bytes=(block.params - routed) * dense + routed * expert_resident
                      + block.frozen_bytes * frozen,
                      block_host_bytes=(block.params - routed) * states.host + routed * expert_host
                      + block.frozen_bytes * frozen_host,
                      block_optimizer_s=optimizer_time_s(cache, config, block.params, routed),
                      frozen_share=frozen, frozen_host_share=frozen_host)

    def with_options(self, options: list[Option]) -> "GroupProblem":
        """The same group restricted to some of its ZeRO/optimizer-offload options."""
        out = copy.copy(self)
        out.options = list(options)
        return out

    def with_policies(self, policies: tuple[str, ...]) -> "GroupProblem":
        """The same group restricted to some of its recompute policies (one: every block alike), with frontiers of
        its own (``optimizer_frontier`` depends on the policies: a split that fits with one may not with another)."""
        out = copy.copy(self)
        out.policies = tuple(policies)
        out.frontiers = {}
        return out

    def collectives(self, option: Option, bucket: tuple[float, float]) -> tuple[float, float, float]:
        """One layer's data-parallel collectives for its (trainable parameters, frozen bytes)."""
        config = self._with(option.zero, option.optimizer_offload)
        return dp_collectives(self.cache, config, bucket[0], frozen_bytes=bucket[1])

    def block_collectives(self, option: Option) -> tuple[float, float, float]:
        """One block's data-parallel collectives: its dense parameters over dp x cp, its routed experts (under
        expert parallelism) over their expert data-parallel ranks."""
        return self._block(option, dp_collectives)

    def passes(self, option: Option, bucket: tuple[float, float]) -> tuple[float, float]:
        """One layer's data-parallel collectives per micro-batch by the pass they run beside
        (``cost.step.dp_micro_passes``): (forward, backward)."""
        config = self._with(option.zero, option.optimizer_offload)
        return dp_micro_passes(self.cache, config, bucket[0], frozen_bytes=bucket[1])

    def block_passes(self, option: Option) -> tuple[float, float]:
        """``passes`` of one block, its routed experts' over their expert data-parallel ranks."""
        return self._block(option, dp_micro_passes)

    def _block(self, option: Option, seconds) -> tuple[float, ...]:
        """``seconds`` (``dp_collectives`` or ``dp_micro_passes``) of one block's dense parameters plus its routed
        experts'."""
        config = self._with(option.zero, option.optimizer_offload)
        routed = self.block.expert_params
        dense = seconds(self.cache, config, self.block.params - routed, frozen_bytes=self.block.frozen_bytes)
        if not routed:
            return dense
        return tuple(a + b for a, b in zip(dense, seconds(self.cache, config, routed, expert=True)))

    @property
    def has_dp(self) -> bool:
        """Whether any parameter has a data-parallel group: dp x cp > 1, or routed experts an expert one."""
        lay = self.layout
        return lay.dp * lay.cp > 1 or (self.block.expert_params > 0 and expert_shard(self.base, self.space.w.framework) > 1)

    def first_layer_params(self, rank: int) -> tuple[float, float]:
        """(Trainable parameters, frozen bytes) of the rank's first layer: the prefix's first on rank 0, else a
        block."""
        if rank == 0 and self.shape.prefix:
            first = self.cache.layer(self.shape.prefix[0], self.ctx)
            return first.params, first.frozen_bytes
        return self.block.params - self.block.expert_params, self.block.frozen_bytes

    # -- solutions ----------------------------------------------------------------------------
    def config(self, counts: list[dict[str, int]], option: Option) -> ParallelConfig:
        """The ParallelConfig of per-stage block counts by policy."""
        stage_layers = []
        policies: list[str] = ["none"] * len(self.shape.prefix)
        for j, stage in enumerate(counts):
            n = sum(stage.values())
            extra = (len(self.shape.prefix) if j == 0 else 0) + (len(self.shape.suffix) if j == self.stages - 1 else 0)
            stage_layers.append(n + extra)
            for policy in POLICIES:
                policies += [policy] * stage.get(policy, 0)
        policies += ["none"] * len(self.shape.suffix)
        return self._with(option.zero, option.optimizer_offload).but(
            recompute=summary_policy(policies), recompute_layers=tuple(policies), stage_layers=tuple(stage_layers))

    def _with(self, zero: int, optimizer_offload: bool) -> ParallelConfig:
        """The group's config at one ZeRO/optimizer-offload option: offload to NVMe (fixed on) only where something
        is offloaded."""
        base = self.base
        return base.but(zero=zero, optimizer_offload=optimizer_offload,
                        nvme_offload=base.nvme_offload and (optimizer_offload or base.param_offload))

    def memory_free_split(self) -> list[int]:
        """Blocks per virtual stage minimising the slowest rank with no recompute and no
        memory limit: the exact optimum of the pipeline term when memory does not bind
        (binary search on the slowest rank's time, at least one block per stage)."""
        t_block = self.block.fwd_s + self.block.bwd_s
        fixed = [f.fwd_s + f.bwd_s for f in self.fixed]
        ranks = self.p
        chunks = [self.v] * ranks

        def capacity(cap: float) -> list[int] | None:
            out = []
            for r in range(ranks):
                k = math.floor((cap - fixed[r]) / t_block + 1e-9)
                if k < chunks[r]:
                    return None
                out.append(k)
            return out

        # the search only needs the total: ranks with the same fixed work (all but the ends) at once
        alike: dict[float, int] = {}
        for f in fixed:
            alike[f] = alike.get(f, 0) + 1

        def enough(cap: float) -> bool:
            total = 0
            for f, count in alike.items():
                k = math.floor((cap - f) / t_block + 1e-9)
                if k < self.v:
                    return False
                total += count * k
            return total >= self.num_blocks

        lo = max(fixed[r] + chunks[r] * t_block for r in range(ranks))
        hi = max(fixed) + self.num_blocks * t_block
        for _ in range(40):
            mid = (lo + hi) / 2
            if enough(mid):
                hi = mid
            else:
                lo = mid
        caps = capacity(hi)
        per_rank = list(chunks)
        left = self.num_blocks - sum(per_rank)
        for r in sorted(range(ranks), key=lambda r: fixed[r]):      # fill the lightest ranks first
            add = min(left, caps[r] - per_rank[r])
            per_rank[r] += add
            left -= add
        return self._spread(per_rank)

    def spread_counts(self, per_rank: list[dict[str, int]]) -> list[dict[str, int]]:
        """Per-rank counts by policy to per-virtual-stage counts (full recompute first)."""
        stages = [{c: 0 for c in self.policies} for _ in range(self.stages)]
        for r, counts in enumerate(per_rank):
            sizes = self._spread_one(sum(counts.values()))
            left = dict(counts)
            for size, j in zip(sizes, self.rank_stages[r]):
                for c in sorted(self.policies, key=lambda c: c != "full"):
                    take = min(left[c], size)
                    stages[j][c] += take
                    left[c] -= take
                    size -= take
        return stages

    def _spread_one(self, total: int) -> list[int]:
        base, extra = divmod(total, self.v)
        return [base + (1 if i < extra else 0) for i in range(self.v)]

    def _spread(self, per_rank: list[int]) -> list[int]:
        """Per-rank block counts to per-virtual-stage counts (a rank's blocks across its chunks)."""
        stages = [0] * self.stages
        for r, total in enumerate(per_rank):
            for size, j in zip(self._spread_one(total), self.rank_stages[r]):
                stages[j] = size
        return stages


def regime_problems(space: Space, cache: CostCache, layout: Layout, schedule: str, vpp: int, sp: bool,
                    shape: Shape, keep=lambda zeros: True) -> list[GroupProblem]:
    """A group's problems, one per eager regime of its ZeRO stages (``CostCache.regime_zeros``: torch's layers run in
    bf16 where FSDP2 or its replicate wraps them, under autocast where not), each pricing its layers once; only
    those whose stages ``keep`` takes."""
    at = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep)
    return [GroupProblem(space, cache, layout, schedule, vpp, sp, shape, zeros=zeros)
            for zeros in cache.regime_zeros(at, space.zeros(layout, schedule)) if keep(zeros)]


def option_lower_bounds(pr: GroupProblem, stop_at: float = math.inf) -> tuple[list[float], list[int]]:
    """Per ZeRO/optimizer-offload option of ``pr.options``, a lower bound on the step time of the
    group's candidates with that option (infinite where none fits), and the memory-free
    split they are built on.

    For each ZeRO/optimizer-offload option k (the bound is the least over them):
    - pipeline: the exact memory-free optimum (``memory_free_split``), combined with
      the recompute that memory forces at least (below) spread as evenly as possible;
    - recompute: a continuous relaxation. Rank r can hold C0 blocks without recompute;
      each block beyond costs at least (bytes it needs) x (cheapest recompute seconds
      per byte freed), up to the blocks it holds fully recomputed; blocks go greedily
      to the cheapest ranks. Infeasible when even full recompute everywhere cannot fit;
    - optimizer: at least the average rank's parameters;
    - data parallel: rank 0 waits for its own exposed share with at least v blocks.

    Returns as soon as the memory-free pipeline alone reaches ``stop_at`` (no option can
    then do better), and leaves out the data-parallel scan of an option whose other terms
    already reach it (its bound is then those terms).
    """
    block, L, p, v, m = pr.block, pr.num_blocks, pr.p, pr.v, pr.m
    cap = pr.cache.usable_bytes
    split = pr.memory_free_split()
    t_block = block.fwd_s + block.bwd_s
    fixed_t = [f.fwd_s + f.bwd_s for f in pr.fixed]
    per_rank = [sum(split[j] for j in pr.rank_stages[r]) for r in range(p)]
    times = [per_rank[r] * t_block + fixed_t[r] for r in range(p)]
    work = sum(times)
    floor = _pipeline(pr, max(times), work)
    if floor + pr.tied_s >= stop_at:
        return [floor + pr.tied_s] * len(pr.options), split
    a_none = block.policy("none").act_bytes
    savers = [(block.policy(c).recompute_s, a_none - block.policy(c).act_bytes)
              for c in pr.policies if block.policy(c).act_bytes < a_none]
    a_min = min(block.policy(c).act_bytes for c in pr.policies)
    out = []
    for opt in pr.options:
        recompute = 0.0
        cheap = []      # (seconds per extra block, how many) per rank
        free_total = 0.0
        feasible = True
        for r in range(p):
            inf_r = pr.inflight[r]
            base = opt.other_bytes + opt.fixed_state_bytes(pr.fixed[r]) + pr.fixed[r].act_bytes * inf_r
            per_block_none = opt.block_state_bytes + a_none * inf_r
            per_block_min = opt.block_state_bytes + a_min * inf_r
            if pr.fixed[r].extra_bytes:
                base += pr.fixed[r].extra_bytes
            c0, c_full = _blocks_that_fit(cap - base, per_block_none), _blocks_that_fit(cap - base, per_block_min)
            if c_full < v:
                feasible = False
                break
            free_total += c0
            if savers and c_full > c0:
                per_byte = min(rc / (saved * inf_r) for rc, saved in savers)
                cheap.append((per_block_none * per_byte, c_full - c0))
        if not feasible:
            out.append(math.inf)
            continue
        extra = max(0.0, L - free_total)
        for cost, room in sorted(cheap):
            take = min(extra, room)
            recompute += take * cost
            extra -= take
        if extra > 1e-9:
            out.append(math.inf)                      # cannot fit even with recompute
            continue
        total = work + recompute
        pipe = _pipeline(pr, max(max(times), total / p), total)
        optimizer = (L * opt.block_optimizer_s + opt.optimizer_s_per_param * sum(f.params for f in pr.fixed)) / p
        if pipe + optimizer + pr.tied_s >= stop_at:
            out.append(pipe + optimizer + pr.tied_s)  # the scan only adds to it: not needed to rule it out
            continue
        bound = max(pipe, _rank0_scan(pr, opt, recompute)) + optimizer + pr.tied_s
        if bound < stop_at:
            # the slowest rank at least as in the best integer split with each rank's least recompute that fits,
            # with the slowest rank's optimizer step that split leaves (``optimizer_frontier``, the ILP's cuts (m)
            # and (p)): the relaxation above lets the cheapest policy per byte free any number of bytes, this one
            # frees at most what each block's policies can
            frontier = optimizer_frontier(pr, opt)
            bound = max(bound, min((_pipeline(pr, least, max(total, least)) + max(level, optimizer) + pr.tied_s
                                    for level, least in frontier), default=math.inf))
        out.append(bound)
    return out, split


def _blocks_that_fit(room: float, per_block: float) -> float:
    """Blocks of ``per_block`` bytes in ``room`` bytes (fractional); without bytes per block (model states
    and activations both off the device: optimizer offload with activation offload) as many as wanted."""
    if per_block <= 0:
        return math.inf if room >= 0 else 0.0
    return max(0.0, room / per_block)


def _pipeline(pr: GroupProblem, slowest: float, total: float) -> float:
    """The schedule's pipeline (``PipelineSchedule.pipeline_s``) from the slowest rank's time and the
    sum over ranks, both without the stage-boundary sends: where the schedule waits for them, each rank's 2 v
    sends per micro-batch are added to the sum (and so bound them from below); where it runs them beside
    compute, the exposed part (the ILP's y[r]) is at least none. Split-backward schedules take
    ``GroupProblem.wgrad_bound``, at least the weight-gradient time they subtract."""
    sends = pr.p * 2 * pr.v * pr.hop_s if pr.p > 1 and not pr.sends_overlap else 0.0
    return pr.schedule.pipeline_s(slowest=slowest, total=total + sends, m=pr.m, p=pr.p, v=pr.v,
                                  hop_s=pr.hop_s if pr.sends_overlap else 0.0, wgrad_s=pr.wgrad_bound)


def _rank0_scan(pr: GroupProblem, opt: Option, recompute: float) -> float:
    """Pipeline plus rank 0's exposed data-parallel time, least over rank 0's block count.

    Rank 0 finishes last and has no slack, so its exposed share is on the path. Its
    exposure grows with its blocks while the pipeline wants them balanced: scanning
    rank 0's count b gives a bound on both together. The other ranks' slowest is the
    least any integer split of the remaining blocks allows (``_others_slowest``: where the
    head sits on one rank, that rank cannot shed it). The backward window is taken at its
    largest (every block fully recomputed), which only lowers the exposure."""
    block, L, p, v, m = pr.block, pr.num_blocks, pr.p, pr.v, pr.m
    t_block = block.fwd_s + block.bwd_s
    rc_max = max(block.policy(c).recompute_s for c in pr.policies)
    fixed_t = [f.fwd_s + f.bwd_s for f in pr.fixed]
    work = L * t_block + sum(fixed_t) + recompute
    dp = _Rank0Collectives(pr, opt)
    if p == 1:
        fwd = L * block.fwd_s + pr.fixed[0].fwd_s
        return m * (L * t_block + fixed_t[0] + recompute) + dp.floor(L, fwd, L * (block.bwd_s + rc_max)
                                                                    + pr.fixed[0].bwd_s)
    others = _others_slowest(pr)
    best = math.inf
    for b in range(v, L - (p - 1) * v + 1):     # the others' step function is not convex in b: every b
        t0 = b * t_block + fixed_t[0]
        pipe = _pipeline(pr, max(t0, others[L - b], work / p), work)
        if pipe >= best:
            continue            # the exposure only adds to it
        fwd = b * block.fwd_s + pr.fixed[0].fwd_s
        best = min(best, pipe + dp.floor(b, fwd, b * (block.bwd_s + rc_max) + pr.fixed[0].bwd_s))
    return best


def _others_slowest(pr: GroupProblem) -> list[float]:
    """Indexed by a block count n: the least possible forward + backward time of the slowest of
    ranks 1 .. p-1 when they hold n blocks between them, at least v each (memory-free, no
    recompute; infinite below (p - 1) v). Blocks of equal cost, added one at a time to the rank
    that is then fastest, give the least maximum at every count (greedy water-filling)."""
    cached = pr.__dict__.get("_others")
    if cached is not None:
        return cached
    block, L, p, v = pr.block, pr.num_blocks, pr.p, pr.v
    t_block = block.fwd_s + block.bwd_s
    loads = [f.fwd_s + f.bwd_s + v * t_block for f in pr.fixed[1:]]
    heapq.heapify(loads)
    start = (p - 1) * v
    out = [math.inf] * (L + 1)
    slowest = max(loads) if loads else 0.0
    if start <= L:
        out[start] = slowest
    for n in range(start + 1, L + 1):
        load = heapq.heappop(loads) + t_block
        heapq.heappush(loads, load)
        slowest = max(slowest, load)
        out[n] = slowest
    pr.__dict__["_others"] = out
    return out


class _Rank0Collectives:
    """Rank 0's data-parallel collectives under one option, as a function of its blocks."""

    def __init__(self, pr: GroupProblem, opt: Option):
        self.active = pr.has_dp
        if not self.active:
            return
        self.m = pr.m
        self.blk = pr.block_collectives(opt)
        fixed = [pr.collectives(opt, bucket) for bucket in pr.fixed[0].buckets]
        self.fixed = [sum(f[i] for f in fixed) for i in range(3)]
        self.overlap, self.once_overlaps = pr.dp_overlaps(opt)
        self.param_gather_overlaps = pr.param_gather_overlaps
        self.first = pr.collectives(opt, pr.first_layer_params(0))
        self.kappa = pr.cache.cluster.comm_sm_fraction
        self.blk_passes = pr.block_passes(opt)
        fixed_passes = [pr.passes(opt, bucket) for bucket in pr.fixed[0].buckets]
        self.fixed_passes = [sum(f[i] for f in fixed_passes) for i in range(2)]
        self.first_passes = pr.passes(opt, pr.first_layer_params(0))

    def floor(self, blocks: int, fwd_s: float, bwd_s: float) -> float:
        """Exposed seconds with ``blocks`` blocks and the given compute windows (``cost.step.exposed_s`` per term:
        each micro-batch's forward and backward collectives, the reduction once, the gather after the optimizer)."""
        if not self.active:
            return 0.0
        totals = [self.blk[i] * blocks + self.fixed[i] for i in range(3)]
        if not self.overlap:
            return self.m * totals[0] + totals[1] + totals[2]
        terms = [(self.m, self.blk_passes[i] * blocks + self.fixed_passes[i], window, self.first_passes[i])
                 for i, window in enumerate((fwd_s, bwd_s))]
        out = 0.0
        for i, window in ((1, bwd_s), (2, fwd_s)):
            if (i == 2 and not self.param_gather_overlaps) or (i == 1 and not self.once_overlaps):
                out += totals[i]            # the step's all-gather ends the optimizer step (cost.step.dp_overlaps)
            else:
                terms.append((1, totals[i], window, self.first[i]))
        for weight, comm, window, last in terms:
            if comm:
                out += weight * max(comm - window, last + self.kappa * comm)
        return out


def most_least_wgrad(block_s: float, fixed_s: list[float], v: int, blocks: int) -> float:
    """The largest the least rank's weight-gradient time ``min_r (fixed_s[r] + block_s n_r)`` can be over the
    integer splits (n_r >= v blocks on each of the ranks, ``blocks`` in all): giving each next block to the rank
    whose time is least raises the least as far as any split can (greedy is exact for a max-min of nondecreasing
    per-rank terms, unit by unit). Memory only narrows the splits, so no plan of the group subtracts more. Their
    mean, which the LP relaxation reaches, can be well above it: Qwen3-235B's 94 blocks over 32 ranks of two
    virtual stages leave one rank with two blocks however they are split, where the mean is 2.9."""
    held = [fixed + block_s * v for fixed in fixed_s]
    heapq.heapify(held)
    for _ in range(blocks - v * len(fixed_s)):
        heapq.heapreplace(held, held[0] + block_s)
    return held[0]


def least_slowest_rank(pr: GroupProblem, opt: Option) -> float:
    """A lower bound on T_max of every integer split under option ``opt`` by rows (a), (b), (f) and (h):
    rank r holding b blocks takes at least g_r(b) = its fixed layers, b blocks and the least recompute
    that fits its device memory with fractions of blocks per policy allowed (``_least_recompute_s``); g_r
    grows with b, so giving each next block to the rank whose g grows least minimises the largest
    (greedy is exact for nondecreasing per-rank costs under a max, with a cap on each rank too). Infinite where a
    rank cannot fit. The search's bounds and the ILP's cut (m) both ask."""
    frontier = optimizer_frontier(pr, opt)
    return frontier[-1][1] if frontier else math.inf


def least_slowest_and_optimizer(pr: GroupProblem, opt: Option, a: float) -> float:
    """A lower bound on ``a`` T_max + O over the integer splits under option ``opt``, O the slowest rank's
    optimizer step (row (k)): the least over ``optimizer_frontier``. The two pull apart where the ranks holding
    the embedding or the head have the largest optimizer step: fewer blocks there lower O and raise T_max, which
    the LP relaxation settles with fractions of blocks (Qwen3-235B on 256 H100 under ZB-V, 94 blocks over 16
    ranks: the relaxation's O is 15% under the integer optimum's)."""
    return min((a * t + o for o, t in optimizer_frontier(pr, opt)), default=math.inf)


def optimizer_frontier(pr: GroupProblem, opt: Option) -> tuple[tuple[float, float], ...]:
    """(O, least T_max) pairs, O ascending and T_max descending: for each level O that the slowest rank's optimizer
    step o_r(b) = (block's) b + (fixed layers') can take, the least slowest rank (``least_slowest_rank``'s greedy)
    of the splits whose every rank stays within it, each rank capped at the blocks whose optimizer step fits
    under O. Every integer split lies under the level of its own largest o_r, so for it T_max >= T(that level);
    levels above the unconstrained split's own largest need no cap. Memoised per option on the group (the
    ``with_options`` copies share it). Empty where no split fits."""
    found = pr.frontiers.get(opt)
    if found is None:
        found = pr.frontiers[opt] = _optimizer_frontier(pr, opt)
    return found


def _optimizer_frontier(pr: GroupProblem, opt: Option) -> tuple[tuple[float, float], ...]:
    p, v, L = pr.p, pr.v, pr.num_blocks
    g = _slowest_costs(pr, opt)
    fixed_o = [opt.optimizer_s_per_param * f.params for f in pr.fixed]
    per_block = opt.block_optimizer_s

    def o(r: int, b: int) -> float:
        return fixed_o[r] + per_block * b

    least, held = _least_slowest_split(pr, g, None)
    if least == math.inf:
        return ()
    top = max(o(r, held[r]) for r in range(p))
    if per_block <= 0:
        return ((top, least),)
    # the lowest level any split reaches: the same greedy on o (nondecreasing, no cap), the largest it leaves
    _, spread = _least_slowest_split(pr, o, None)
    bottom = max(o(r, spread[r]) for r in range(p))
    levels = sorted({o(r, b) for r in range(p) for b in range(v, L - v * (p - 1) + 1) if bottom <= o(r, b) < top})
    out = []
    for level in levels:
        caps = [math.floor((level - fixed_o[r]) / per_block + 1e-9) for r in range(p)]
        slowest, _ = _least_slowest_split(pr, g, caps)
        if slowest < math.inf and (not out or slowest < out[-1][1]):
            out.append((level, slowest))
    if not out or least < out[-1][1]:
        out.append((top, least))
    return tuple(out)


def _slowest_costs(pr: GroupProblem, opt: Option):
    """g_r(b) of ``least_slowest_rank``: rank r's fixed layers, b blocks and the least recompute its memory needs."""
    t_block = pr.block.fwd_s + pr.block.bwd_s
    memo: dict[tuple, float] = {}
    kind = [(pr.fixed[r], pr.inflight[r]) for r in range(pr.p)]    # ranks alike in these have the same g

    def g(r: int, b: int) -> float:
        key = (kind[r], b)
        if key not in memo:
            fixed = pr.fixed[r]
            memo[key] = fixed.fwd_s + fixed.bwd_s + b * t_block + _least_recompute_s(pr, opt, r, b)
        return memo[key]
    return g


def _least_slowest_split(pr: GroupProblem, cost, caps: list[int] | None) -> tuple[float, list[int]]:
    """(the least largest ``cost(r, b_r)``, the split b) over the integer splits with v <= b_r <= caps[r]: each
    next block to the rank whose cost grows least (exact for nondecreasing costs); infinite where none is."""
    held = [pr.v] * pr.p
    if caps is not None and (min(caps) < pr.v or sum(caps) < pr.num_blocks):
        return math.inf, held
    heap = [(cost(r, pr.v + 1), r) for r in range(pr.p) if caps is None or caps[r] > pr.v]
    heapq.heapify(heap)
    for _ in range(pr.num_blocks - pr.p * pr.v):
        _, r = heapq.heappop(heap)
        held[r] += 1
        if caps is None or held[r] < caps[r]:
            heapq.heappush(heap, (cost(r, held[r] + 1), r))
    return max(cost(r, held[r]) for r in range(pr.p)), held


def _least_recompute_s(pr: GroupProblem, opt: Option, r: int, b: int) -> float:
    """The least recompute seconds of b blocks on rank r within its device memory (row (f) under ``opt``):
    every assignment of the policies to the blocks where they are few (exact), else blocks split
    fractionally between policies (a lower bound): for each transient the rank may reach (h), the
    policies whose transient is at most it, two at a time (an LP with two rows mixes at most two)."""
    block, fixed, inflight = pr.block, pr.fixed[r], pr.inflight[r]
    cap = pr.cache.usable_bytes
    base = opt.other_bytes + opt.fixed_state_bytes(fixed) + b * opt.block_state_bytes + inflight * fixed.act_bytes
    cost = {c: (block.policy(c).recompute_s, inflight * block.policy(c).act_bytes, block.policy(c).peak_extra_bytes)
            for c in pr.policies}
    if math.comb(b + len(cost) - 1, len(cost) - 1) <= 1000:
        counts = _compositions_array(b, len(cost))          # every assignment, one row each
        rc, act, extra = (np.array([v[i] for v in cost.values()], dtype=float) for i in range(3))
        transient = np.where(counts > 0, extra, -np.inf).max(axis=1)
        memory = base + counts @ act + np.maximum(transient, fixed.extra_bytes)
        fits = memory <= cap
        return float((counts @ rc)[fits].min()) if fits.any() else math.inf
    best = math.inf
    for level in {fixed.extra_bytes} | {e for _, _, e in cost.values()}:
        room = cap - base - max(level, fixed.extra_bytes)           # for the blocks' activations
        allowed = [(rc, a) for rc, a, e in cost.values() if e <= level]
        for rc1, a1 in allowed:
            for rc2, a2 in allowed:             # x blocks of the second, b - x of the first
                if b * a1 <= room:
                    best = min(best, b * rc1)
                elif a2 < a1 and b * a2 <= room:
                    x = (b * a1 - room) / (a1 - a2)
                    best = min(best, (b - x) * rc1 + x * rc2)
    return best


@lru_cache(maxsize=256)
def _compositions_array(total: int, parts: int) -> np.ndarray:
    """Every way to split ``total`` blocks over ``parts`` policies, one row each (read-only)."""
    rows = np.array(list(compositions(total, parts, 0)), dtype=float).reshape(-1, parts)
    rows.setflags(write=False)
    return rows
