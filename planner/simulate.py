"""One training step, event by event: the Timeline.

The analytical estimate (``cost/step.py``) prices a pipeline in closed form:
``(m - 1) * slowest + sum`` for GPipe and 1F1B, ``m * slowest + (sum - slowest) / v``
for interleaved 1F1B. The latter is exact only when the stages are equal, both only where the
communication hides where the formula assumes. This module runs the schedule
instead: every pipeline rank executes its own ordered list of forward and
backward passes, each waiting for the data it needs; sends, receives and
data-parallel collectives occupy their own streams; the step ends with the
data-parallel tail, the embedding all-reduce and the optimizer.

What it models, each as the runtimes do it:

- Schedules. GPipe: every forward, then every backward (Huang et al. 2019;
  torch.distributed.pipelining's GPipe). 1F1B: ``p - rank - 1`` warm-up
  forwards, then one forward one backward, then the cool-down backwards
  (Narayanan et al. 2021, Sec 2.2.1; Megatron-LM
  ``forward_backward_pipelining_without_interleaving``). Interleaved 1F1B:
  Megatron-LM's ``forward_backward_pipelining_with_interleaving``: warm-up of
  ``2 (p - rank - 1) + (v - 1) p`` chunk passes (all of them when ``m == p``),
  chunk of the k-th pass ``(k mod pv) // p`` (reversed for backward),
  micro-batch ``(k // pv) p + k mod p``.
- Pipeline sends run on their own stream; the receiver waits for the data. In
  GPipe and 1F1B the sender also waits for its send to finish before its next
  pass (Megatron's ``send_forward_recv_backward`` waits on its requests);
  interleaved 1F1B posts them and carries on (Megatron's ``overlap_p2p_comm``),
  except on a runtime that waits on every exchange (Megatron-LM of 2021:
  ``planner.cost.step.sends_overlap``).
  Matching receives are assumed posted ahead (no rendezvous wait).
- Data-parallel / ZeRO collectives run layer by layer on their own stream,
  at each layer's size (Rajbhandari et al. 2020, Sec 5 and 7): gradient
  reductions are issued when a layer's last backward ends, parameter
  all-gathers one layer ahead of use (FSDP2 prefetching; Megatron
  ``--overlap-param-gather``); without overlap (``--no-overlap-grad-reduce``)
  the reductions run after the rank's last backward and the gathers block.
  Compute running beside a collective loses the SMs the collective occupies
  (``comm_sm_fraction``; Rashidi et al., ISCA 2021): it is stretched by that
  fraction of the time they overlap.
- The step's tail: the first and last stage all-reduce the tied embedding's
  gradient; the gradient-norm all-reduce for clipping synchronises every
  rank before the optimizer (Megatron-LM ``clip_grad_norm_fp32``; torchtitan
  ``clip_grad_norm_`` with a pipeline mesh), then each rank steps its own
  parameters.

Compute times are the cost model's own, per layer (``CostCache.layer``): the
simulation changes how they compose, never what a layer costs.
"""
from __future__ import annotations

import functools
import math

from dataclasses import dataclass, fields, replace

from .cluster import Cluster
from .config import ParallelConfig, Workload
from .cost.step import (CostCache, data_parallel_spans_nodes, dp_overlaps, dp_phases, estimate, fetches_per_tensor,
                        gathers_every_microbatch, gathers_forward_every_microbatch, layer_network_busy_s,
                        network_crossing, optimizer_time_s, per_tensor_phases, pipeline_sends_busy_s,
                        played_pipeline_floor_s, played_pipeline_s, rank_costs, rank_pipeline_s,
                        reduces_every_microbatch, sends_overlap, tied_bucket, tied_embedding_sync_s,
                        uneven_virtual_stages)
from .cost.host import host_bound, host_s
from .estimate import Candidate, Estimate, StepTime
from .layers import LayerGraph
from .placement import assign_layers, layer_policies
from .runtimes import RUNTIMES
from .pipeline_orders import SCHEDULE_ORDERS, schedule_order  # noqa: F401  (re-exported)
from .pipeline_play import SEND_NEXT, SEND_PREV, schedule_programs, shorter_runs
from .schedules import DEFAULT as DEFAULT_SCHEDULE

COMPUTE, DP = "compute", "dp"     # a rank's compute and data-parallel streams (its sends: SEND_NEXT, SEND_PREV)
STEP_PARTS = tuple(f.name for f in fields(StepTime))


# -- values ---------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Event:
    """One interval on one stream of one pipeline rank. Every GPU of the rank's
    tensor/context/data-parallel group runs the same events at the same times."""

    device: int              # pipeline rank
    stream: str              # COMPUTE, SEND_NEXT, SEND_PREV or DP
    kind: str                # forward, recompute, backward (whole or input gradient), weight (weight gradient),
                             # send, dp_comm, embedding_allreduce or optimizer
    start_s: float
    end_s: float
    microbatch: int = -1     # -1: not tied to a micro-batch
    chunk: int = -1          # model chunk (virtual stage) on the rank; -1: none


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """The events of one step, its length, and the critical rank's step part by part."""

    events: tuple[Event, ...]
    step_time_s: float
    breakdown: StepTime          # the rank that finishes last; its parts sum to step_time_s
    critical_device: int
    schedule: str
    pp: int
    vpp: int
    num_microbatches: int

    def on(self, device: int, stream: str | None = None) -> list[Event]:
        return [e for e in self.events if e.device == device and (stream is None or e.stream == stream)]


@dataclass(frozen=True, kw_only=True)
class LayerWork:
    """What one layer costs one rank per micro-batch, and its data-parallel collectives."""

    fwd_s: float
    bwd_s: float                 # recompute included
    recompute_s: float = 0.0     # of bwd_s, the forward redone first
    wgrad_s: float = 0.0         # of bwd_s, the weight gradient (W): a pass of its own in split-backward
                                 # schedules, the rest (I) is the input gradient with the recompute
    tp_comm_s: float = 0.0       # of fwd_s + bwd_s, exposed tensor-parallel collectives
    cp_comm_s: float = 0.0       # of fwd_s + bwd_s, exposed context-parallel exchange
    ep_comm_s: float = 0.0       # of fwd_s + bwd_s, expert parallelism's all-to-alls
    gather_fwd_s: float = 0.0    # all-gather of the layer's parameters before its forward
    gather_bwd_s: float = 0.0    # ... before its backward (ZeRO-3)
    reduce_s: float = 0.0        # gradient reduction after its backward
    busy_fwd_s: float = 0.0      # of fwd_s, inter-node traffic on the NICs the data-parallel stream crosses
    busy_bwd_s: float = 0.0      # of bwd_s, likewise (cost.step.layer_network_busy_s)


@dataclass(frozen=True, kw_only=True)
class StepWork:
    """Everything the simulation needs, in seconds: the cost model's numbers, placed."""

    schedule: str                                         # a name of planner/schedules.py
    num_microbatches: int
    chunks: tuple[tuple[tuple[LayerWork, ...], ...], ...]  # [rank][chunk] -> layers, forward order
    hop_s: float = 0.0                                    # one stage-boundary transfer
    blocking_sends: bool = True                           # the sender waits for its send
    gather_every_microbatch: bool = False                 # else before each layer's first forward only
    gather_forward_once: bool = False                     # of those, the forward's only before the first forward
                                                          # (cost.step.gathers_forward_every_microbatch)
    reduce_every_microbatch: bool = False                 # else after each layer's last backward only
    overlap_dp: bool = True                               # collectives overlap compute
    defer_reduce: bool = False                            # but the once-per-step gradient reduction runs after the
                                                          # last backward (cost.step.dp_overlaps)
    overlap_param_gather: bool = True                     # ZeRO-1/2's step gather beside the next forward
    contention: float = 0.0                               # compute slowdown beside a collective
    sends_share_nics: bool = False                        # stage-boundary sends hold the data-parallel NICs
    embedding_allreduce_s: float = 0.0                    # tied embedding, first and last stage
    optimizer_s: tuple[float, ...] = ()                   # per rank

    @functools.cached_property
    def pp(self) -> int:
        return len(self.chunks)

    @functools.cached_property
    def vpp(self) -> int:
        return len(self.chunks[0])


# the schedules' event orders (planner/pipeline_orders.py)

# -- the simulation -------------------------------------------------------------------------------

class _Rank:
    """The streams of one pipeline rank and what it waited for."""

    def __init__(self, rank: int, record: bool = True):
        self.rank = rank
        self.compute_free = 0.0
        self.block_until = 0.0                     # its last blocking send
        self.send_free = {SEND_NEXT: 0.0, SEND_PREV: 0.0}
        self.dp_free = 0.0
        self.dp_busy: list[tuple[float, float]] = []   # collectives, in issue order
        self.deferred_reduce_s: list[float] = []
        self.param_ready: dict[int, list[float]] = {}  # chunk -> when each layer's parameters are gathered
        self.events: list[Event] | None = [] if record else None
        self.waits = {"bubble": 0.0, "pp_comm": 0.0, "dp_comm": 0.0, "contention": 0.0}

    def collective(self, issue_s: float, seconds: float, mb: int, chunk: int) -> float:
        """Queue a collective on the data-parallel stream; its end."""
        start = max(issue_s, self.dp_free)
        self.dp_free = start + seconds
        self.dp_busy.append((start, self.dp_free))
        if self.events is not None:
            self.last_dp_event = len(self.events)
            self.record(stream=DP, kind="dp_comm", start_s=start, end_s=self.dp_free, microbatch=mb, chunk=chunk)
        return self.dp_free

    def record(self, **event) -> None:
        if self.events is not None:
            self.events.append(Event(device=self.rank, **event))

    def yield_network(self, start: float, seconds: float) -> None:
        """Other traffic holds the data-parallel stream's NICs for ``seconds`` from ``start``: a collective
        running then waits that long (one transfer at a time on a NIC, cost.step.network_busy_s), by no more than
        what it had left."""
        if seconds <= 0 or self.dp_free <= start:
            return
        delay = min(seconds, self.dp_free - start)
        self.dp_free += delay
        s, e = self.dp_busy[-1]
        self.dp_busy[-1] = (s, e + delay)
        if self.events is not None:
            event = self.events[self.last_dp_event]
            self.events[self.last_dp_event] = replace(event, end_s=event.end_s + delay)

    def overlap_s(self, start: float, end: float) -> float:
        """How long the data-parallel stream is busy within [start, end)."""
        out, i = 0.0, len(self.dp_busy) - 1
        while i >= 0 and self.dp_busy[i][1] > start:
            s, e = self.dp_busy[i]
            out += max(0.0, min(e, end) - max(s, start))
            i -= 1
        return out

    def wait(self, until: float, cause: str) -> None:
        if until > self.compute_free:
            self.waits[cause] += until - self.compute_free
            self.compute_free = until


def _step_gather_overlaps(work: StepWork) -> bool:
    """Whether the parameter all-gather after the optimizer (ZeRO-1/2) runs beside the next forward."""
    return work.overlap_dp and work.overlap_param_gather


def _param_sync(work: StepWork, st: _Rank, chunk: int, at: float) -> None:
    """Queue the step's all-gather of a chunk's parameters (ZeRO-1/2 after the optimizer,
    overlapped with the forward: Megatron-LM ``--overlap-param-gather``), once."""
    if chunk < work.vpp and chunk not in st.param_ready:
        st.param_ready[chunk] = [st.collective(at, lw.gather_fwd_s, 0, chunk) if lw.gather_fwd_s else at
                                 for lw in work.chunks[st.rank][chunk]]


def _gather_plan(work: StepWork, st: _Rank, op: tuple[str, int, int], start: float) -> tuple[list, list] | None:
    """(seconds of each layer's gather in pass order, when each layer's parameters are
    ready) for this pass, None when it waits for none. The step's gathers are queued once
    (``_param_sync``); per-micro-batch ones (FSDP, ZeRO-3) are issued as the pass runs
    (their readiness None until then)."""
    kind, mb, chunk = op
    layers = work.chunks[st.rank][chunk]
    if kind == "W":                 # the weight gradient reads saved inputs and output gradients, not the weights
        return None
    if not work.gather_every_microbatch:
        if kind != "F" or mb != 0 or not _step_gather_overlaps(work) or not any(lw.gather_fwd_s for lw in layers):
            return None
        _param_sync(work, st, chunk, start)
        return [lw.gather_fwd_s for lw in layers], list(st.param_ready[chunk])
    if kind == "F" and mb and work.gather_forward_once:      # still gathered from the last backward
        return None
    sizes = [lw.gather_fwd_s for lw in layers] if kind == "F" else [lw.gather_bwd_s for lw in layers][::-1]
    return (sizes, [None] * len(sizes)) if any(sizes) else None


_EVENT_KIND = {"F": "forward", "B": "backward", "I": "backward", "W": "weight"}


def _pass_s(kind: str, lw: LayerWork) -> float:
    """One layer's time in a pass: F forward, B whole backward, I its input gradient (the recompute with it),
    W its weight gradient (Qi et al., ICLR 2024, Sec 2.1)."""
    if kind == "F":
        return lw.fwd_s
    if kind == "B":
        return lw.bwd_s
    return lw.bwd_s - lw.wgrad_s if kind == "I" else lw.wgrad_s


def _run_pass(work: StepWork, st: _Rank, op: tuple[str, int, int], ready_s: float) -> None:
    """One forward or backward pass of one chunk, layer by layer where collectives interleave."""
    kind, mb, chunk = op
    layers = work.chunks[st.rank][chunk]
    # wait for the input (another stage: the pipeline's fill and imbalance) or for an own send
    if st.block_until >= ready_s:
        st.wait(ready_s, "bubble")
        st.wait(st.block_until, "pp_comm")
    else:
        st.wait(st.block_until, "pp_comm")
        st.wait(ready_s, "bubble")
    forward = kind == "F"
    order = layers if forward else layers[::-1]
    start = t = st.compute_free
    plan = _gather_plan(work, st, op, start)
    sizes, ready = plan if plan else ([], [])

    def issue(j: int, at: float) -> None:
        ready[j] = st.collective(at, sizes[j], mb, chunk) if sizes[j] else at

    # a layer's gradient is whole after its weight gradient: W, or B that includes it
    reduce = kind in "BW" and (work.reduce_every_microbatch or mb == work.num_microbatches - 1)
    if not plan and not reduce and (not st.dp_busy or st.dp_busy[-1][1] <= t):
        for lw in order:                    # no collective beside it: the layers add up
            t += _pass_s(kind, lw)
        order = ()
    for j, lw in enumerate(order):
        if plan:
            if ready[j] is None:              # issued now (no overlap: when the layer needs it)
                issue(j, t)
            if work.overlap_dp and j + 1 < len(order) and ready[j + 1] is None:
                issue(j + 1, t)               # prefetch the next layer's parameters (FSDP2)
            if ready[j] > t:
                st.waits["dp_comm"] += ready[j] - t
                t = ready[j]
        base = _pass_s(kind, lw)
        if st.dp_busy and st.dp_busy[-1][1] > t:          # a collective runs beside: it slows compute
            st.yield_network(t, lw.busy_fwd_s if kind == "F" else lw.busy_bwd_s if kind in "BI" else 0.0)
            stretch = work.contention * st.overlap_s(t, t + base)
            st.waits["contention"] += stretch
            base += stretch
        t += base
        if reduce and lw.reduce_s:
            if work.overlap_dp and not (work.defer_reduce and not work.reduce_every_microbatch):
                st.collective(t, lw.reduce_s, mb, chunk)
            elif work.reduce_every_microbatch:
                end = st.collective(t, lw.reduce_s, mb, chunk)
                st.waits["dp_comm"] += end - t
                t = end
            else:
                st.deferred_reduce_s.append(lw.reduce_s)
    if st.events is not None:            # the events are kept for the timeline plot only
        rec = sum(lw.recompute_s for lw in layers) if kind in "BI" else 0.0
        if rec:
            st.record(stream=COMPUTE, kind="recompute", start_s=start, end_s=start + rec, microbatch=mb, chunk=chunk)
        st.record(stream=COMPUTE, kind=_EVENT_KIND[kind], start_s=start + rec, end_s=t,
                  microbatch=mb, chunk=chunk)
    st.compute_free = t


def _send(work: StepWork, st: _Rank, op: tuple[str, int, int], target: tuple | None, arrivals: dict) -> None:
    """Pass the pass's output on (``target``: planner/pipeline_play.py ``_send_target``)."""
    if target is None:
        return
    stream, key = target
    _, mb, chunk = op
    if stream is None:              # the next stage is on this rank
        arrivals[key] = st.compute_free
        return
    free = st.send_free[stream]
    start = st.compute_free if st.compute_free > free else free
    end = start + work.hop_s
    st.send_free[stream] = end
    if work.sends_share_nics:               # sends beside compute on the data-parallel NICs (step_work)
        st.yield_network(start, work.hop_s)
    if work.hop_s > 0 and st.events is not None:
        st.record(stream=stream, kind="send", start_s=start, end_s=end, microbatch=mb, chunk=chunk)
    arrivals[key] = end
    if work.blocking_sends:
        st.block_until = end


def _sync_ahead(work: StepWork, st: _Rank, k: int, ready_s: float) -> None:
    """Megatron's interleaved schedule gathers chunk c + 1's parameters when forward
    pass ``k`` with ``k + rank`` the first micro-batch of chunk c comes up (schedules.py,
    'launch param synchronization for next model chunk')."""
    p, v = work.pp, work.vpp
    vid = k + st.rank
    if v > 2 and vid < p * v and vid % p == 0 and 1 < vid // p + 1 < v:
        _param_sync(work, st, vid // p + 1, max(st.compute_free, ready_s, st.block_until))


def simulate_work(work: StepWork, *, record: bool = True) -> Timeline:
    """Run every rank's schedule against the others: a discrete-event simulation of one step.
    ``record=False`` keeps no events (the step time and its parts only)."""
    p = work.pp
    programs, needs, targets = schedule_programs(work.schedule, p, work.vpp, work.num_microbatches)
    ranks = [_Rank(r, record) for r in range(p)]
    arrivals: dict[tuple, float] = {}
    position, forwards = [0] * p, [0] * p
    remaining = sum(len(prog) for prog in programs)
    step_sync = _step_gather_overlaps(work) and not work.gather_every_microbatch
    if step_sync:                   # the first two chunks' parameters, right after the last optimizer step
        for st in ranks:
            for chunk in (0, 1):
                _param_sync(work, st, chunk, 0.0)
    while remaining:
        progressed = False
        for r in range(p):
            st, prog, need_of, target_of = ranks[r], programs[r], needs[r], targets[r]
            while position[r] < len(prog):
                op = prog[position[r]]
                need = need_of[position[r]]
                if need is not None and need not in arrivals:
                    break
                if step_sync and op[0] == "F":
                    _sync_ahead(work, st, forwards[r], arrivals[need] if need is not None else 0.0)
                    forwards[r] += 1
                _run_pass(work, st, op, arrivals[need] if need is not None else 0.0)
                _send(work, st, op, target_of[position[r]], arrivals)
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {work.schedule} deadlocked (a bug in schedule_order)")
    return _finish(work, ranks)


def _finish(work: StepWork, ranks: list[_Rank]) -> Timeline:
    """The data-parallel tail, the tied-embedding all-reduce, the clipping barrier, the optimizer."""
    p = work.pp
    for st in ranks:
        st.wait(st.block_until, "pp_comm")
        for seconds in st.deferred_reduce_s:          # reductions after the last backward (no overlap)
            st.collective(st.compute_free, seconds, -1, -1)
        st.wait(st.dp_free, "dp_comm")
    if work.embedding_allreduce_s and p > 1:
        first, last = ranks[0], ranks[-1]
        start = max(first.compute_free, last.compute_free)
        for st in (first, last):
            st.wait(start, "bubble")
            st.record(stream=DP, kind="embedding_allreduce", start_s=start, end_s=start + work.embedding_allreduce_s)
            st.waits["dp_comm"] += work.embedding_allreduce_s
            st.compute_free = start + work.embedding_allreduce_s
    barrier = max(st.compute_free for st in ranks)
    ends = []
    for st in ranks:
        st.wait(barrier, "bubble")
        opt = work.optimizer_s[st.rank] if work.optimizer_s else 0.0
        if opt:
            st.record(stream=COMPUTE, kind="optimizer", start_s=barrier, end_s=barrier + opt)
        end = barrier + opt
        if not _step_gather_overlaps(work) and not work.gather_every_microbatch:   # all-gather ends the step
            for chunk in work.chunks[st.rank]:
                for lw in chunk:
                    if lw.gather_fwd_s:
                        end = st.collective(end, lw.gather_fwd_s, -1, -1)
        st.waits["dp_comm"] += end - barrier - opt
        ends.append(end)
    critical = max(range(p), key=lambda r: (ends[r], -r))
    st = ranks[critical]
    layers = [lw for chunk in work.chunks[critical] for lw in chunk]
    m = work.num_microbatches
    busy, rec = m * sum(lw.fwd_s + lw.bwd_s for lw in layers), m * sum(lw.recompute_s for lw in layers)
    tp, cp = m * sum(lw.tp_comm_s for lw in layers), m * sum(lw.cp_comm_s for lw in layers)
    ep = m * sum(lw.ep_comm_s for lw in layers)
    breakdown = StepTime(compute=busy - rec - tp - cp - ep, recompute=rec, tp_comm=tp, cp_comm=cp, ep_comm=ep,
                         pp_comm=st.waits["pp_comm"], bubble=st.waits["bubble"],
                         dp_comm=st.waits["dp_comm"] + st.waits["contention"],
                         optimizer=work.optimizer_s[critical] if work.optimizer_s else 0.0)
    events = sorted((e for s in ranks for e in s.events or ()), key=lambda e: (e.device, e.start_s, e.stream))
    return Timeline(events=tuple(events), step_time_s=ends[critical], breakdown=breakdown, critical_device=critical,
                    schedule=work.schedule, pp=p, vpp=work.vpp, num_microbatches=work.num_microbatches)


# -- from a plan to the work ----------------------------------------------------------------------



def step_work(cache: CostCache, config: ParallelConfig) -> StepWork:
    """The cost model's per-layer times and collectives, placed on ranks and chunks."""
    graph, cluster, w = cache.graph, cache.cluster, cache.workload
    ctx = cache.context(config)
    policies = layer_policies(graph, config)
    placement = assign_layers(graph, config)
    tied_extra = graph.tied_params / config.tp if graph.tied_embeddings and config.pp > 1 else 0.0
    # ZeRO-3 one tensor at a time: every fetch and reduction waits for the GPU (cost/fetch.py)
    per_tensor = fetches_per_tensor(config, w.framework)
    # the inter-node traffic that holds the data-parallel stream's NICs (cost.step.network_busy_s)
    shares_nics = data_parallel_spans_nodes(cluster, config)
    crosses = network_crossing(cache, config)
    chunks = []
    for rank, rank_chunks in enumerate(placement):
        out = []
        for chunk in rank_chunks:
            layers = []
            for i in chunk:
                cost = cache.layer(i, ctx)
                p = cost.policy(policies[i])
                g_f, g_b, red = dp_phases(cache, config, cost.params - cost.expert_params,
                                           frozen_bytes=cost.frozen_bytes)
                if cost.expert_params:      # routed experts: over their expert data-parallel group
                    e_f, e_b, e_r = dp_phases(cache, config, cost.expert_params, expert=True)
                    g_f, g_b, red = g_f + e_f, g_b + e_b, red + e_r
                if per_tensor:
                    g_f, g_b, red = per_tensor_phases(cache, config, cache.signatures[i], policies[i])
                if tied_extra and rank == config.pp - 1 and i == len(graph.layers) - 1:
                    bucket = tied_bucket(cache, tied_extra)    # the head's copy of the shared embedding
                    extra = dp_phases(cache, config, bucket[0], frozen_bytes=bucket[1])
                    g_f, g_b, red = g_f + extra[0], g_b + extra[1], red + extra[2]
                busy = layer_network_busy_s(cost, policies[i], *crosses) if shares_nics else (0.0, 0.0)
                layers.append(LayerWork(fwd_s=cost.fwd_s, bwd_s=cost.bwd_s + p.recompute_s,
                                        recompute_s=p.recompute_s, wgrad_s=cost.wgrad_s, tp_comm_s=cost.tp_comm_s,
                                        cp_comm_s=cost.cp_comm_s, ep_comm_s=cost.ep_comm_s, gather_fwd_s=g_f, gather_bwd_s=g_b,
                                        reduce_s=red, busy_fwd_s=busy[0], busy_bwd_s=busy[1]))
            out.append(tuple(layers))
        chunks.append(tuple(out))
    ranks = rank_costs(cache, config)
    overlaps = dp_overlaps(framework=w.framework, device_kind=cluster.device_kind,
                           overlap_grad_reduce=w.overlap_grad_reduce, zero=config.zero, dp=config.dp * config.cp,
                           tp=config.tp, pp=config.pp, ep=config.ep)
    return StepWork(schedule=config.schedule if config.pp > 1 else DEFAULT_SCHEDULE,
                    num_microbatches=config.num_microbatches, chunks=tuple(chunks), hop_s=cache.hop_s(config),
                    blocking_sends=not sends_overlap(config.schedule, w.framework),
                    gather_every_microbatch=gathers_every_microbatch(config, w.framework),
                    gather_forward_once=not gathers_forward_every_microbatch(config, w.framework),
                    reduce_every_microbatch=reduces_every_microbatch(config, w.framework),
                    # torch pipelining runs the deferred ZeRO-2/3 sync after the last backward, the torch
                    # ZeRO-1 one in its optimizer step; FSDP2 on gloo blocks (cost.step.dp_overlaps)
                    overlap_dp=not per_tensor and overlaps[0], defer_reduce=not overlaps[1],
                    contention=cluster.comm_sm_fraction,
                    sends_share_nics=shares_nics and pipeline_sends_busy_s(cache, config) > 0,
                    overlap_param_gather=RUNTIMES[w.framework].timing.overlaps_param_gather,
                    embedding_allreduce_s=tied_embedding_sync_s(cache, config),
                    optimizer_s=tuple(optimizer_time_s(cache, config, r.params, r.routed_params) for r in ranks))


def played_candidate(cache: CostCache, cand: Candidate, bar: float = math.inf) -> Candidate | None:
    """``cand`` with its pipeline as ``play_pipeline`` plays it where the closed form does not hold (virtual stages of
    unequal blocks: cost/step.py ``played_pipeline_s``), the difference in its bubble; else ``cand``. What the search
    ranks its candidates by as it goes, when it ranks its finalists by simulation: a closed form that is short by a
    fifth would fill the finalists with plans the simulation then finds slow, and push out the fastest. None, not
    played, where the pipeline's floor (``pipeline_play.pipeline_floor``) already puts the step at ``bar`` or
    beyond: Qwen3-235B on 256 B200 plays 283 pipelines where it played 833."""
    config = cand.config
    if not uneven_virtual_stages(cache, config):
        return cand
    est = cand.estimate
    closed = rank_pipeline_s(cache, config)
    if bar < math.inf and est.step_time_s - est.time.host_wait + played_pipeline_floor_s(cache, config) - closed >= bar:
        return None
    played = played_pipeline_s(cache, config)
    more = played - closed
    device = est.step_time_s - est.time.host_wait + more
    out = with_simulation(est, device, replace(est.time, bubble=est.time.bubble + more, host_wait=0.0))
    return Candidate(config=config, estimate=host_bound(out, host_s(cache, config)))


def simulate(graph: LayerGraph, cluster: Cluster, workload: Workload, config: ParallelConfig,
             cache: CostCache | None = None) -> Timeline:
    """The Timeline of one step of ``config`` (pure; ``cache`` only memoises)."""
    cache = cache or CostCache(graph, cluster, workload)
    return simulate_work(step_work(cache, config))


def with_simulation(est: Estimate, step_s: float, parts: StepTime) -> Estimate:
    """The estimate with the simulated step time and its parts: throughput, model and
    hardware FLOP/s and MFU are per second of step, so they scale by the ratio."""
    ratio = est.step_time_s / step_s
    return replace(est, step_time_s=step_s, tokens_per_s=est.tokens_per_s * ratio,
                   model_tflops_per_gpu=est.model_tflops_per_gpu * ratio, mfu=est.mfu * ratio,
                   hardware_tflops_per_gpu=est.hardware_tflops_per_gpu * ratio, time=parts)


def step_time(work: StepWork) -> tuple[float, StepTime]:
    """(step time, its parts) of ``work``, as ``simulate_work`` gives them, for less work when the
    step has many micro-batches.

    Past the pipeline's fill, a schedule repeats itself: every group of micro-batches (one
    micro-batch in GPipe and 1F1B, pp of them in interleaved 1F1B) adds the same time to
    every part, and the fill, the drain and the step's tail do not change. So the step is
    simulated at three short lengths m1 < m2 < m3, a group apart; when the parts grow by
    exactly the same amount from m1 to m2 as from m2 to m3 (taken for the steady state),
    the step at m is extrapolated; otherwise all m micro-batches are simulated. The three
    short runs (3 m1 + 3 groups micro-batches) are only taken when they are less work
    than the m micro-batches. That test is not a proof: on 600 random pipelines of unequal stages
    (2 to 16 ranks, 1F1B, GPipe, interleaved 1F1B and ZB) three came out 0.05-1.2% short of the whole
    simulation; the V schedules, which do not repeat so, are always simulated whole
    (planner/pipeline_play.py ``shorter_runs``).
    """
    m = work.num_microbatches
    shorter = shorter_runs(work.schedule, work.pp, m)
    if shorter is None:
        t = simulate_work(work, record=False)
        return t.step_time_s, t.breakdown
    m1, group = shorter
    runs = [simulate_work(replace(work, num_microbatches=n), record=False) for n in (m1, m1 + group, m1 + 2 * group)]
    parts = [[t.step_time_s] + [getattr(t.breakdown, f) for f in STEP_PARTS] for t in runs]
    first, second = ([b - a for a, b in zip(parts[i], parts[i + 1])] for i in (0, 1))
    steady = len({t.critical_device for t in runs}) == 1 and all(
        abs(x - y) <= 1e-9 * max(1.0, parts[2][0]) for x, y in zip(first, second))
    if not steady:
        t = simulate_work(work, record=False)
        return t.step_time_s, t.breakdown
    k = (m - m1) // group
    value = [a + k * d for a, d in zip(parts[0], first)]
    return value[0], StepTime(**dict(zip(STEP_PARTS, value[1:])))


def simulated_estimate(graph: LayerGraph, cluster: Cluster, workload: Workload, config: ParallelConfig,
                       cache: CostCache | None = None) -> Estimate:
    """The estimate with the simulated step time and its parts: what the search ranks by at the end."""
    cache = cache or CostCache(graph, cluster, workload)
    step_s, parts = step_time(step_work(cache, config))
    est = with_simulation(estimate(graph, cluster, workload, config, cache), step_s, parts)
    return host_bound(est, host_s(cache, config))
