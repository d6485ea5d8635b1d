"""A whole training step of one ParallelConfig: the Estimate.

Composition, in order: layers are placed on pipeline ranks (and virtual
chunks); each rank's forward/backward time per micro-batch is the sum of its
layers' costs plus pipeline sends; the schedule turns those into the pipeline
time; data-parallel/ZeRO communication and the optimizer step follow.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..cluster import DTYPE_BYTES, Cluster
from ..config import RECOMPUTES, ParallelConfig, Workload
from ..estimate import Estimate, Memory, StepTime
from ..layers import LayerGraph
from ..pipeline_play import pipeline_floor, play_pipeline
from ..placement import assign_layers, holds_head_copy, last_stage_rank, layer_policies, placement_of
from .. import finetune, network
from .. import precision as fp8_recipes
from ..runtimes import RUNTIMES, expert_data_parallel, lora_style, priced_as
from ..schedules import SCHEDULES
from . import fetch
from .host import host_bound, host_s
from .eager import eager_regime, eager_s, layer_eager_regime, step_param_bytes, wraps_in_fsdp
from .layer import Context, LayerCost, fp8_converts, layer_cost, residual_bytes
from .memory import (frozen_share, grad_comm_bytes_per_param, resident_bytes_per_param, state_bytes_per_param,
                     working_copy_bytes_per_param)

# Adam(W) step, per parameter it updates: reads fp32 param, grad, two moments (16 B),
# writes param and moments (12 B); mixed precision also writes the 16-bit copy (2 B).
# Streams through memory (fused/foreach kernels are bandwidth-bound).
ADAM_BYTES_PER_PARAM = 28.0
# ZeRO-Infinity's NVMe offload (ParallelConfig.nvme_offload), with DeepSpeed's config defaults (deepspeed.ai/docs/
# config-json, "Parameter offloading" and "Optimizer offloading"; deepspeed/runtime/zero/offload_config.py):
# the fp32 master weights and Adam's two moments stay on NVMe and are swapped in and out around each sub-group's CPU
# step (12 bytes a parameter each way); the parameters are read for every gather and the updated ones written back
# once a step; the host keeps the swap buffers: offload_param's buffer_count 5 x buffer_size 1e8 elements at the
# training dtype, and the sub-group the CPU optimizer steps (sub_group_size 1e9 elements) with its fp32 gradient.
NVME_OPTIMIZER_BYTES = 12.0
NVME_PARAM_BUFFER_ELEMS = 5 * 100_000_000
NVME_SUB_GROUP_ELEMS = 1_000_000_000


# -- the estimate -------------------------------------------------------------------------------

def fp8_param_share(graph: LayerGraph, workload: Workload) -> float:
    """The share of the model's parameters in linears its FP8 recipe converts (planner/cost/layer.py fp8_converts):
    what --fp8-param-gather gathers in FP8. One share for every layer: the embedding's and head's ranks gather a
    little more in bf16 than this charges them."""
    total = sum(layer.params for layer in graph.layers)
    converted = sum(op.params for layer in graph.layers for op in layer.ops
                    if op.kind == "linear" and fp8_converts(op, workload.fp8, workload.framework))
    return converted / total if total else 0.0


class CostCache:
    """Memo of costs for one (graph, cluster, workload): pure results only, so it never
    changes an answer, only how often the same sums are computed."""

    def __init__(self, graph: LayerGraph, cluster: Cluster, workload: Workload):
        self.graph, self.cluster, self.workload = graph, cluster, workload
        self.usable_bytes = usable_bytes(cluster, workload)
        self.signatures = [layer.signature for layer in graph.layers]
        self.representative: dict[str, int] = {}
        self.signature_counts: dict[str, int] = {}
        for i, sig in enumerate(self.signatures):
            self.representative.setdefault(sig, i)
            self.signature_counts[sig] = self.signature_counts.get(sig, 0) + 1
        # which parameters train (planner/finetune.py: the mode, and a traced module's own frozen ones)
        self.adapters = finetune.of(workload.finetune, workload.lora_rank, workload.lora_targets,
                                    lora_style(workload.framework))
        self.model_flops_per_token = finetune.model_flops_per_token(graph, workload.seq_len, self.adapters)
        # bytes per parameter of the distributed optimizer's parameter all-gather: the compute dtype's, or with
        # Megatron-LM's --fp8-param-gather the recipe's (one byte; MXFP8's bf16) for the parameters of the linears
        # its FP8 recipe converts
        dt = DTYPE_BYTES[workload.precision]
        self.gather_bytes_per_param = dt if not workload.fp8_param_gather else \
            dt - (dt - fp8_recipes.RECIPES[workload.fp8].te_param_gather_bytes) * fp8_param_share(graph, workload)
        # the recompute policies the runtime runs here: the least activations any of them leaves bound memory
        self.policies = RUNTIMES[workload.framework].on(cluster.device_kind).recomputes \
            if workload.framework in RUNTIMES else RECOMPUTES
        self._layer: dict[Context, dict[str, LayerCost]] = {}
        # signatures whose layer holds no expert op: expert parallelism changes nothing of their cost, so they are
        # priced once for every ep (``signature_cost``)
        self._without_experts = {sig for sig, i in self.representative.items()
                                 if not any(op.expert for op in graph.layers[i].ops)}
        self._no_ep: dict[Context, Context] = {}
        self._phases: dict[tuple, tuple[float, float, float]] = {}
        self._groups: dict[tuple, list] = {}
        self._ranks: dict[tuple, list] = {}
        self._largest: dict[Context, float] = {}
        self._dp: dict[tuple, tuple[float, float]] = {}
        self._totals: dict[Context, tuple[float, float, float, float]] = {}
        self._contexts: dict[tuple, Context] = {}
        self._regimes: dict[tuple, str] = {}
        self._regime_zeros: dict[tuple, list] = {}
        self._rank_sums: dict[tuple, tuple] = {}
        self._optimizer_rates: dict[tuple, float] = {}

    def context(self, config: ParallelConfig) -> Context:
        key = (config.micro_batch, config.tp, config.cp, config.sequence_parallel, config.dp, config.pp, config.ep,
               config.zero)     # the stage sets the eager regime (``regime``); those of one regime share a Context
        ctx = self._contexts.get(key)
        if ctx is None:
            ctx = self._contexts[key] = self._context(config)
        return ctx

    def regime(self, config: ParallelConfig) -> str:
        """The torch eager regime ``config``'s layers run in (``cost.eager.layer_eager_regime``; '' for the other
        runtimes)."""
        key = (config.zero, config.dp * config.cp, config.tp, config.pp, config.ep)
        out = self._regimes.get(key)
        if out is None:
            w = self.workload
            out = self._regimes[key] = layer_eager_regime(framework=w.framework, precision=w.precision,
                                                          zero=config.zero, dp=key[1], tp=config.tp, pp=config.pp,
                                                          ep=config.ep)
        return out

    def regime_zeros(self, config: ParallelConfig, zeros) -> list[tuple[int, ...]]:
        """``zeros`` (ZeRO stages) grouped by the eager regime ``config`` at each runs its layers in, in their
        order: one group where the regime does not depend on the stage (every runtime but torch's), else the stages
        FSDP2 or its replicate wraps (bf16 layers) apart from those it does not (autocast): executor/parallelize.py
        ``dp_wrapper``."""
        key = (config.dp * config.cp, config.tp, config.pp, config.ep, tuple(zeros))
        out = self._regime_zeros.get(key)
        if out is None:
            groups: dict[str, list[int]] = {}
            for zero in zeros:
                groups.setdefault(self.regime(config.but(zero=zero)), []).append(zero)
            out = self._regime_zeros[key] = [tuple(g) for g in groups.values()]
        return out

    def contexts(self, config: ParallelConfig, zeros) -> list[Context]:
        """The contexts of ``config`` at each of the ZeRO stages ``zeros`` (one per regime): a bound over those
        stages takes the least over these (``config``'s own where ``zeros`` is empty)."""
        return [self.context(config.but(zero=group[0])) for group in self.regime_zeros(config, zeros)] \
            or [self.context(config)]

    def bound_config(self, config: ParallelConfig, zeros) -> ParallelConfig | None:
        """``config`` at the first of ``zeros`` whose eager regime prices every layer no dearer than the others of
        ``zeros`` do (``_no_dearer``): bounds on rank costs priced there hold at every one of ``zeros``, so a search
        bounds them once. None where no regime is the cheapest in all of these."""
        groups = self.regime_zeros(config, zeros)
        if len(groups) <= 1:
            return config.but(zero=groups[0][0]) if groups else config
        key = (config.micro_batch, config.tp, config.cp, config.sequence_parallel, config.dp, config.pp, config.ep,
               tuple(groups))
        memo = self.__dict__.setdefault("_bound_configs", {})
        if key not in memo:
            configs = [config.but(zero=g[0]) for g in groups]
            contexts = [self.context(c) for c in configs]
            # and its stage-boundary sends no larger (a rank's sends fill what its compute leaves)
            memo[key] = next((c for c, ctx in zip(configs, contexts)
                              if all(self._no_dearer(ctx, other) and self.hop_s(c) <= self.hop_s(o)
                                     for o, other in zip(configs, contexts) if other is not ctx)), None)
        found = memo[key]
        return None if found is None else config.but(zero=found.zero)

    def _no_dearer(self, ctx: Context, other: Context) -> bool:
        """Whether every layer costs no more in ``ctx`` than in ``other`` as rank costs add them up (``_rank_sums``:
        a rank's time is its forward plus backward, with each policy's recompute; its sends only fill what those
        leave): forward + backward, the linear floor, and for each recompute policy that sum with its recompute and
        its device and host bytes; parameters and weight gradients alike."""
        def within(a: float, b: float) -> bool:
            return a <= b * (1 + 1e-12) + 1e-15
        for sig in self.representative:
            a, b = self.signature_cost(sig, ctx), self.signature_cost(sig, other)
            work_a, work_b = a.fwd_s + a.bwd_s, b.fwd_s + b.bwd_s
            if not (within(work_a, work_b) and within(a.work_floor_s, b.work_floor_s) and a.params == b.params
                    and within(a.wgrad_s, b.wgrad_s) and within(b.wgrad_s, a.wgrad_s)
                    and set(a.by_policy) == set(b.by_policy)):
                return False
            for name, pa in a.by_policy.items():
                pb = b.by_policy[name]
                if not (within(work_a + pa.recompute_s, work_b + pb.recompute_s) and pa.act_bytes <= pb.act_bytes
                        and pa.peak_extra_bytes <= pb.peak_extra_bytes and pa.host_bytes <= pb.host_bytes):
                    return False
        return True

    def _context(self, config: ParallelConfig) -> Context:
        w = self.workload
        return Context(micro_batch=config.micro_batch, seq_len=w.seq_len, tp=config.tp, cp=config.cp,
                       sequence_parallel=config.sequence_parallel, precision=w.precision, attention=w.attention,
                       framework=w.framework, tp_comm_overlap=w.tp_comm_overlap,
                       ep_comm_overlap=w.ep_comm_overlap and config.ep > 1,
                       eager_regime=self.regime(config),
                       ep=config.ep, expert_imbalance=w.expert_imbalance, expert_dispatcher=w.expert_dispatcher,
                       fp8=w.fp8, finetune=w.finetune, lora_rank=w.lora_rank, lora_targets=w.lora_targets,
                       compiled=w.compile)

    def signature_cost(self, signature: str, ctx: Context) -> LayerCost:
        if ctx.ep > 1 and signature in self._without_experts:     # every ep prices such a layer as ep 1 does
            plain = self._no_ep.get(ctx)
            if plain is None:
                plain = self._no_ep[ctx] = ctx._replace(ep=1, ep_comm_overlap=False)     # as ``_context`` at ep 1
            ctx = plain
        costs = self._layer.get(ctx)
        if costs is None:
            costs = self._layer[ctx] = {}
        cost = costs.get(signature)
        if cost is None:
            layer = self.graph.layers[self.representative[signature]]
            cost = costs[signature] = layer_cost(layer, ctx, self.cluster)
        return cost

    def totals(self, ctx: Context) -> tuple[float, float, float, float]:
        """Summed over every layer: (forward + backward seconds without recompute, the least
        saved-activation bytes any policy leaves, parameters, the work's linear floor), per
        micro-batch."""
        out = self._totals.get(ctx)
        if out is None:
            work = act = params = floor = 0.0
            for sig, n in self.signature_counts.items():
                c = self.signature_cost(sig, ctx)
                work += n * (c.fwd_s + c.bwd_s)
                act += n * min(c.policy(p).act_bytes for p in self.policies)
                params += n * c.params
                floor += n * c.work_floor_s
            out = self._totals[ctx] = (work, act, params, floor)
        return out

    def buffer_params(self, ctx: Context) -> tuple[float, float]:
        """Summed over every layer: (dense, routed experts') trainable parameters one rank holds (``LayerCost.params``,
        of which ``expert_params``), whose gradients a runtime that reduces a whole buffer at once reduces."""
        memo = self.__dict__.setdefault("_buffer_params", {})
        if ctx not in memo:
            costs = [(n, self.signature_cost(sig, ctx)) for sig, n in self.signature_counts.items()]
            memo[ctx] = (sum(n * (c.params - c.expert_params) for n, c in costs),
                         sum(n * c.expert_params for n, c in costs))
        return memo[ctx]

    def wgrad_total(self, ctx: Context) -> float:
        """Summed over every layer: the weight-gradient seconds of one micro-batch (``LayerCost.wgrad_s``), which
        the split-backward schedules take out of the bubble (planner/search bounds them with it)."""
        memo = self.__dict__.setdefault("_wgrad_totals", {})
        if ctx not in memo:
            memo[ctx] = sum(n * self.signature_cost(sig, ctx).wgrad_s for sig, n in self.signature_counts.items())
        return memo[ctx]

    def layer(self, index: int, ctx: Context) -> LayerCost:
        return self.signature_cost(self.signatures[index], ctx)

    def hop_s(self, config: ParallelConfig) -> float:
        """One stage-boundary transfer of a micro-batch's hidden states (the residual stream, in its dtype).

        Megatron's scatter/gather optimisation and sequence parallelism send 1/tp of
        them per rank (Narayanan et al. 2021, Sec 4.1)."""
        if config.pp == 1:
            return 0.0
        w = self.workload
        nbytes = config.micro_batch * w.seq_len / config.cp * self.graph.hidden \
            * residual_bytes(self.regime(config), w.precision)
        if config.sequence_parallel or RUNTIMES[w.framework].timing.pp_sends_tp_shards:
            nbytes /= config.tp
        return network.p2p_s(self.cluster, nbytes, same_node=stages_share_a_node(self.cluster, config))

    def largest_layer_params(self, ctx: Context) -> float:
        if ctx not in self._largest:
            self._largest[ctx] = max(self.signature_cost(sig, ctx).params for sig in self.representative)
        return self._largest[ctx]

    def largest_layer_frozen_bytes(self, ctx: Context) -> float:
        """The most frozen-parameter bytes of one layer on one rank (planner/finetune.py; 0 where all of them
        train)."""
        memo = self.__dict__.setdefault("_largest_frozen", {})
        if ctx not in memo:
            memo[ctx] = max(self.signature_cost(sig, ctx).frozen_bytes for sig in self.representative)
        return memo[ctx]

    def groups(self, config: ParallelConfig) -> list:
        """Per rank: {(signature, policy): count}, chunks, layers (placement and policies only)."""
        key = (config.pp, config.vpp, placement_of(config), config.stage_layers, policies_key(config))
        out = self._groups.get(key)
        if out is None:
            policies = layer_policies(self.graph, config)
            out = []
            for chunks in assign_layers(self.graph, config):
                counts: dict[tuple[str, str], int] = {}
                for chunk in chunks:
                    for i in chunk:
                        k = (self.signatures[i], policies[i])
                        counts[k] = counts.get(k, 0) + 1
                first = next((self.signatures[c[0]] for c in chunks if c), None)
                out.append((tuple(counts.items()), len(chunks), sum(len(c) for c in chunks), first))
            self._groups[key] = out
        return out


def policies_key(config: ParallelConfig):
    """What of ``config`` says each layer's recompute policy (the ILP's per-layer choice, else the one for all)."""
    return config.recompute_layers if config.recompute_layers is not None else config.recompute


@dataclass(frozen=True)
class RankCost:
    """One pipeline rank for one micro-batch (all its chunks)."""

    fwd_s: float
    bwd_s: float                 # recompute included
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    p2p_s: float                 # sends and receives per micro-batch, forward + backward
    act_bytes: float
    peak_extra_bytes: float
    params: float
    matmul_flops: float          # per micro-batch, forward + backward + recompute
    num_layers: int
    buckets: tuple[tuple[tuple[float, float], int], ...] = ()   # ((trainable parameters of one layer, its frozen
                                                  # bytes), layers like it): one data-parallel collective per layer
    first_bucket: tuple[float, float] = (0.0, 0.0)    # that of the rank's first layer: its gather opens the
                                 # forward, its reduction closes the backward
    host_act_bytes: float = 0.0  # activations offloaded to host memory per micro-batch (recompute "activation-offload")
    layers: tuple[tuple[tuple[str, str], int], ...] = ()    # ((signature, recompute policy), how many) it holds
    expert_params: float = 0.0   # of ``params``, routed experts' under expert parallelism (their own data-parallel
                                 # group: ``expert_shard``)
    expert_buckets: tuple[tuple[float, int], ...] = ()      # (a layer's expert parameters, layers like it)
    routed_params: float = 0.0   # of ``params``, the trained routed experts' at any ep (``LayerCost.routed_params``)
    ep_comm_s: float = 0.0       # expert all-to-alls per micro-batch (in fwd_s + bwd_s)
    wgrad_s: float = 0.0         # of ``bwd_s``, the weight-gradient GEMMs (W; ``LayerCost.wgrad_s``) that
                                 # split-backward schedules run apart from the input gradient
    frozen_bytes: float = 0.0    # frozen parameters' bytes it stores before ZeRO sharding (``LayerCost.frozen_bytes``)


def rank_costs(cache: CostCache, config: ParallelConfig) -> list[RankCost]:
    ctx = cache.context(config)
    # the schedule matters through where stages sit and whether sends overlap compute (``_rank_costs``)
    key = (ctx, config.dp, config.pp, config.vpp, placement_of(config), SCHEDULES[config.schedule].overlaps_sends,
           config.stage_layers, policies_key(config))
    out = cache._ranks.get(key)
    if out is None:
        out = cache._ranks[key] = _rank_costs(cache, config, ctx)
    return out


def _rank_costs(cache: CostCache, config: ParallelConfig, ctx: Context) -> list[RankCost]:
    graph = cache.graph
    one_p2p = cache.hop_s(config)
    out = []
    same: dict[tuple, RankCost] = {}     # ranks with the same layers cost the same (the middle stages)
    head_copy = [holds_head_copy(graph, config, rank) for rank in range(config.pp)] if graph.tied_embeddings else None
    for rank, group in enumerate(cache.groups(config)):
        tied = head_copy is not None and head_copy[rank]
        if not tied and group in same:
            out.append(same[group])
            continue
        counts, chunks, layers, first = group
        (fwd, bwd, rec, tp, cp, act, extra, params, flops, buckets, host, experts, expert_buckets,
         ep_comm, wgrad, frozen, routed) = _rank_sums(cache, ctx, counts, tied, config.tp)
        # per micro-batch each chunk receives/sends once forward and once backward. 1F1B and
        # GPipe wait for them; the interleaved schedule posts them asynchronously and runs
        # another chunk meanwhile (Megatron-LM overlap_p2p_comm; torch's interleaved
        # schedule likewise), so only what exceeds a chunk's compute is exposed, unless the
        # runtime waits on every exchange (``sends_overlap``)
        p2p = 2 * chunks * one_p2p
        if sends_overlap(config.schedule, cache.workload.framework):
            p2p = 2 * chunks * max(0.0, one_p2p - (fwd + bwd) / (2 * chunks))
        out.append(RankCost(fwd_s=fwd, bwd_s=bwd, recompute_s=rec, tp_comm_s=tp, cp_comm_s=cp,
                            p2p_s=p2p, act_bytes=act, peak_extra_bytes=extra, params=params,
                            matmul_flops=flops, num_layers=max(1, layers), buckets=buckets,
                            first_bucket=_dense(cache.signature_cost(first, ctx)) if first else (0.0, 0.0),
                            host_act_bytes=host, layers=counts, expert_params=experts,
                            expert_buckets=expert_buckets, ep_comm_s=ep_comm, wgrad_s=wgrad, frozen_bytes=frozen,
                            routed_params=routed))
        if not tied:
            same[group] = out[-1]
    return out


def _rank_sums(cache: CostCache, ctx: Context, counts: tuple, tied: bool, tp_degree: int) -> tuple:
    """A rank's layer sums for one micro-batch (forward, backward with recompute, recompute, TP and CP
    communication, activations, transient, parameters, FLOPs, buckets), memoised on what they depend
    on: the layers it holds and their policies, not how they are cut into chunks (virtual stages of
    the same rank share them)."""
    key = (ctx, counts, tied)       # the context holds the TP degree
    out = cache._rank_sums.get(key)
    if out is not None:
        return out
    fwd = bwd = rec = tp = cp = act = extra = params = flops = host = experts = ep_comm = wgrad = frozen = routed = 0.0
    buckets: dict[tuple[float, float], int] = {}
    expert_buckets: dict[float, int] = {}
    for (sig, policy), n in counts:
        cost = cache.signature_cost(sig, ctx)
        buckets[_dense(cost)] = buckets.get(_dense(cost), 0) + n
        if cost.expert_params:
            expert_buckets[cost.expert_params] = expert_buckets.get(cost.expert_params, 0) + n
            experts += n * cost.expert_params
            ep_comm += n * cost.ep_comm_s
        p = cost.policy(policy)
        fwd += n * cost.fwd_s
        bwd += n * (cost.bwd_s + p.recompute_s)
        wgrad += n * cost.wgrad_s
        rec += n * p.recompute_s
        tp += n * cost.tp_comm_s
        cp += n * cost.cp_comm_s
        act += n * p.act_bytes
        extra = max(extra, p.peak_extra_bytes)
        params += n * cost.params
        routed += n * cost.routed_params
        frozen += n * cost.frozen_bytes
        bwd_flops = 2 * cost.matmul_flops_fwd if cost.matmul_flops_bwd is None else cost.matmul_flops_bwd
        flops += n * (cost.matmul_flops_fwd + bwd_flops + p.recompute_flops)
        host += n * p.host_bytes
    if tied:
        shared = cache.graph.tied_params / tp_degree     # the head's copy of the shared embedding
        bucket = tied_bucket(cache, shared)
        params, frozen = params + bucket[0], frozen + bucket[1]
        buckets[bucket] = buckets.get(bucket, 0) + 1
    out = cache._rank_sums[key] = (fwd, bwd, rec, tp, cp, act, extra, params, flops, tuple(sorted(buckets.items())),
                                   host, experts, tuple(sorted(expert_buckets.items())), ep_comm, wgrad, frozen,
                                   routed)
    return out


def _dense(cost: LayerCost) -> tuple[float, float]:
    """(A layer's trainable parameters on one rank that the dense data-parallel group reduces: all but its routed
    experts under expert parallelism; its frozen parameters' bytes, which ZeRO-3 gathers too)."""
    return cost.params - cost.expert_params, cost.frozen_bytes


def tied_bucket(cache: CostCache, params: float) -> tuple[float, float]:
    """(trainable parameters, frozen bytes) of the head's copy of a tied embedding of ``params`` parameters per rank:
    frozen, at the compute dtype's bytes, where the training mode freezes the base or the traced module froze the
    table (planner/finetune.py ``Adapters.trains_tied``)."""
    if cache.adapters.trains_tied(cache.graph):
        return params, 0.0
    return 0.0, params * DTYPE_BYTES[cache.workload.precision]


def expert_shard(config: ParallelConfig, framework: str) -> int:
    """The ranks routed experts' gradients are reduced over and, with ZeRO, their states sharded over: the expert
    data-parallel size (planner/runtimes.py ``expert_data_parallel``); the dense layers' dp x cp where ep is 1."""
    if config.ep == 1:
        return config.dp * config.cp
    return expert_data_parallel(framework, ep=config.ep, dp=config.dp, cp=config.cp, tp=config.tp)


def routed_state_shard(cache: CostCache, config: ParallelConfig) -> float:
    """What routed experts' ZeRO-sharded states are divided by on the most loaded rank: ``expert_shard`` (n ranks),
    but where the runtime shards each tensor by itself (FSDP2, and meshplan's ZeRO-1 likewise: the torch runtime's)
    a stack of e = E / ep local experts goes along ``expert_dim`` (executor/zero1.py): the experts where n divides
    them, else an expert's output features where n divides those, else the experts unevenly, each rank holding
    ceil(e / n) of the stack's e experts (FSDP2 pads the last ranks' shards to as many): more than 1 / n (16 local
    experts over 9 ranks: 2 each, 1/8). Averaged over a MoE block's routed linears by their parameters. Runtimes
    that shard flat buffers (Megatron-LM's distributed optimizer, DeepSpeed) divide evenly: ``expert_shard``."""
    n = expert_shard(config, cache.workload.framework)
    if n <= 1 or config.zero == 0 or priced_as(cache.workload.framework) != "torch" or not cache.graph.num_experts:
        return float(n)
    e = cache.graph.num_experts // config.ep
    block = next((layer for layer in cache.graph.layers if any(op.routed for op in layer.ops)), None)
    stacks = [op for op in block.ops if op.routed and op.params] if block is not None else []
    held = sum(op.params * (1 / n if e % n == 0 or op.out_features % n == 0 else math.ceil(e / n) / e)
               for op in stacks)
    return sum(op.params for op in stacks) / held if held else float(n)


def sends_overlap(schedule: str, framework: str) -> bool:
    """Whether a rank's stage-boundary sends run beside its compute: the schedule posts them and goes on
    (``PipelineSchedule.overlaps_sends``) and the runtime does not wait on every exchange (``Timing.pp_sends_block``:
    Megatron-LM of 2021)."""
    rt = RUNTIMES.get(framework)
    return SCHEDULES[schedule].overlaps_sends and not (rt is not None and rt.timing.pp_sends_block)


def fill_hop_s(cache: CostCache, config: ParallelConfig) -> float:
    """The stage-boundary transfer the interleaved schedule's fill and drain wait for on top of its slowest rank
    (``PipelineSchedule.pipeline_s``'s ``hop_s``) where sends overlap compute; where they block, each rank's
    sends are already in its time per micro-batch (``RankCost.p2p_s``), the fill's and drain's with them."""
    return cache.hop_s(config) if sends_overlap(config.schedule, cache.workload.framework) else 0.0


def pipeline_s(per_rank_s: list[float], config: ParallelConfig, hop_s: float = 0.0,
               wgrad_s: list[float] | None = None) -> float:
    """Time of the pipeline for m micro-batches given each rank's forward + backward time (its sends
    included): the schedule's formula (``PipelineSchedule.pipeline_s``); ``wgrad_s``, each rank's
    weight-gradient share, for the split-backward schedules: the least of any rank's, since the fill and the
    drain pass every rank and each fills its bubble with its own W only (equal to the slowest rank's on
    uniform stages, which the formula assumes; the simulation plays unequal ones). The least keeps the closed
    form linear for the stage ILP (planner/search/ilp.py) and never optimistic."""
    slowest = max(per_rank_s)
    w = min(wgrad_s) if wgrad_s else 0.0
    return SCHEDULES[config.schedule].pipeline_s(slowest=slowest, total=sum(per_rank_s),
                                                 m=config.num_microbatches, p=config.pp, v=config.vpp, hop_s=hop_s,
                                                 wgrad_s=w)


def inflight_microbatches(config: ParallelConfig, rank: int, workload: Workload) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak (the schedule's
    ``PipelineSchedule.inflight``), in units of the rank's layers; with the expert all-to-alls overlapped
    (``Workload.ep_comm_overlap``) one forward more: Megatron-Core runs one extra warm-up forward so that each
    forward has a backward beside it (megatron/core/pipeline_parallel/schedules.py at 92c8482e: one more micro-batch
    of a model chunk under the interleaved schedule; without a pipeline, forward i + 1 before backward i)."""
    held = _inflight(config.schedule, rank, config.pp, config.vpp, config.num_microbatches)
    if workload.ep_comm_overlap and config.ep > 1:
        return min(held + (1.0 / config.vpp if config.pp > 1 else 1.0), float(config.num_microbatches))
    return held


@functools.lru_cache(maxsize=4096)      # pure: a memo of one of the search's most frequent calls
def _inflight(schedule: str, rank: int, pp: int, vpp: int, m: int) -> float:
    return SCHEDULES[schedule].inflight(rank=rank, pp=pp, vpp=vpp, m=m)


def _dp_comm(cache: CostCache, config: ParallelConfig, rank: RankCost) -> tuple[float, float]:
    key = (config.dp, config.cp, config.tp, config.zero, config.num_microbatches, rank.buckets, rank.first_bucket,
           rank.fwd_s, rank.bwd_s, rank.layers, config.ep, rank.expert_buckets,
           _chunk_pass_window(config, 1.0),      # the interleaved schedule's window (pp, vpp, schedule)
           network_busy_s(cache, config, rank))     # the other inter-node traffic it shares NICs with
    out = cache._dp.get(key)
    if out is None:
        out = cache._dp[key] = _dp_comm_uncached(cache, config, rank)
    return out


def gathers_every_microbatch(config: ParallelConfig, framework: str) -> bool:
    """Whether a layer's parameters are all-gathered for every micro-batch (ZeRO-3, and FSDP2's ZeRO-2, which
    re-gathers them every forward) rather than once per step. Under a pipeline that defers the sharded sync
    (``deferred_sharded_sync``: torch.distributed.pipelining sets reshard_after_backward False on every FSDP
    module, stage.py backward_maybe_with_nosync, torch 2.13) the parameters stay gathered after each backward:
    ZeRO-2's, which no forward reshards, once per step; ZeRO-3's, resharded after each forward, again before
    each backward (``gathers_forward_every_microbatch``: not before each forward)."""
    if deferred_sharded_sync(config, framework):
        return config.zero == 3
    return config.zero in RUNTIMES[framework].timing.params_gathered_every_microbatch


def gathers_forward_every_microbatch(config: ParallelConfig, framework: str) -> bool:
    """Whether a layer's parameters are all-gathered before every micro-batch's forward (``gathers_every_microbatch``
    but where a pipeline keeps them gathered from each backward into the next forward)."""
    return gathers_every_microbatch(config, framework) and not deferred_sharded_sync(config, framework)


def reduces_every_microbatch(config: ParallelConfig, framework: str) -> bool:
    """Whether a layer's gradients are reduce-scattered after every micro-batch's backward
    (ZeRO-2 and ZeRO-3 keep only their shard) rather than once after the last (and under a
    pipeline, once, where the runtime defers it: ``deferred_sharded_sync``)."""
    return config.zero in RUNTIMES[framework].timing.grads_reduced_every_microbatch \
        and not deferred_sharded_sync(config, framework)


def dp_overlaps(*, framework: str, device_kind: str, overlap_grad_reduce: bool, zero: int, dp: int, tp: int,
                pp: int, ep: int = 1) -> tuple[bool, bool]:
    """(whether the data-parallel collectives run beside compute at all, whether the once-per-step
    gradient reduction runs beside backward), ``dp`` being data x context parallel.

    Not at all: where the user turned the overlap off, and where the runtime's collectives block the
    thread that issues them on this device (``Timing.fsdp_blocks_on_gloo``: FSDP2 issues its
    all-gathers and reduce-scatters with ``async_op=False``, which a gloo process group runs to the
    end before returning, so on a CPU they stand between the layers). The once-per-step reduction not
    beside backward: where the runtime defers it past the last backward (``deferred_sharded_sync``) or
    runs it in the optimizer step (``Timing.grads_reduced_in_optimizer``)."""
    timing = RUNTIMES[framework].timing
    fsdp = wraps_in_fsdp(zero=zero, dp=dp, tp=tp, pp=pp, ep=ep)
    if not overlap_grad_reduce or (device_kind == "cpu" and timing.fsdp_blocks_on_gloo and fsdp and dp > 1):
        return False, False
    deferred = pp > 1 and zero >= 2 and timing.pp_defers_sharded_dp_sync
    return True, not deferred and zero not in timing.grads_reduced_in_optimizer


def deferred_sharded_sync(config: ParallelConfig, framework: str) -> bool:
    """Whether the ZeRO-2/3 gradient sync waits for the pipeline's last backward and then runs
    alone (``Timing.pp_defers_sharded_dp_sync``: torch.distributed.pipelining)."""
    return config.pp > 1 and config.zero >= 2 and RUNTIMES[framework].timing.pp_defers_sharded_dp_sync


def dp_phases(cache: CostCache, config: ParallelConfig, params: float, expert: bool = False, frozen_bytes: float = 0.0
              ) -> tuple[float, float, float]:
    """(gather before forward, gather before backward, reduction after backward) seconds of one
    layer's data-parallel collectives, for one layer of ``params`` parameters (per TP rank):
    ZeRO-0 all-reduces gradients; ZeRO-1 and 2 reduce-scatter them and all-gather the
    parameters; ZeRO-3 gathers the parameters for forward and again for backward
    (Rajbhandari et al. 2020, Sec 5 and 7). ``params`` are the trainable ones (their gradients reduced,
    their updated values gathered); ``frozen_bytes``, the layer's frozen parameters (planner/finetune.py), are
    gathered with them where the runtime shards parameters at this stage (its ``params_sharded_from``: ZeRO-3,
    FSDP2's ZeRO-2), never reduced. How often each runs: ``gathers_every_microbatch``
    and ``reduces_every_microbatch``. ``expert``: routed experts' parameters under expert parallelism, over
    their expert data-parallel group (``expert_shard`` ranks spaced ep apart: Megatron's expert rank order
    tp-ep-dp-pp with expert tensor parallelism 1) instead of the dense dp x cp ranks spaced tp apart."""
    size, stride = (expert_shard(config, cache.workload.framework), config.ep) if expert else \
        (config.dp * config.cp, config.tp)
    bucket = grad_bucket(cache, config, expert)
    key = (size, stride, config.zero, params, frozen_bytes, bucket)
    out = cache._phases.get(key)
    if out is None:
        out = cache._phases[key] = _dp_phases_uncached(cache, config.zero, size, stride, params, frozen_bytes, bucket)
    return out


def grad_bucket(cache: CostCache, config: ParallelConfig, expert: bool = False) -> float | None:
    """Parameters per data-parallel collective where the runtime issues them in buckets at this ZeRO stage
    (``Timing.grad_buckets``), else None (a layer's at once). A runtime whose buckets are for overlap only
    (``GradBuckets.overlapped_only``: Megatron-LM, and Megatron-LM of 2021's torch DDP against its local one), run
    without --overlap-grad-reduce, reduces each model chunk's whole gradient buffer in one call: one bucket of a
    chunk's parameters: a rank's dense (or ``expert``) ones
    over the pipeline's ``pp x vpp`` chunks, as if the stages were even, so that the closed form, the stage ILP
    and the simulation price the same call."""
    w = cache.workload
    rule = RUNTIMES[w.framework].timing.grad_buckets
    if rule is None or config.zero not in rule.zero_stages:
        return None
    if rule.overlapped_only and not w.overlap_grad_reduce:
        dense, experts = cache.buffer_params(cache.context(config))
        return max((experts if expert else dense) / (config.pp * max(config.vpp, 1)), 1.0)
    return rule.size(config.dp, grad_comm_bytes_per_param(w.framework, w.precision, w.grad_reduce_in_bf16))


def in_buckets(time_s, params: float, bucket: float | None, closes: str) -> float:
    """Seconds of one layer's share of a collective issued in buckets of ``bucket`` parameters, ``time_s(n)`` the
    collective of n parameters: a layer smaller than a bucket shares one with the layers beside it (its share of
    the bucket's collective, its parameters over the bucket's); a larger one is cut into buckets at least as large
    (``closes`` "reaching": floor(params / bucket) of them) or at most as large ("before-exceeding": the ceiling).
    Where parameters fall between tensors of a layer is not modelled: the buckets split the layer evenly."""
    if bucket is None or params <= 0:
        return time_s(params)
    if params <= bucket:
        return params / bucket * time_s(bucket)
    count = math.floor(params / bucket) if closes == "reaching" else math.ceil(params / bucket)
    return count * time_s(params / count)


def _dp_phases_uncached(cache: CostCache, zero: int, size: int, stride: int, params: float, frozen_bytes: float = 0.0,
                        bucket: float | None = None) -> tuple[float, float, float]:
    cluster, w = cache.cluster, cache.workload
    layout = RUNTIMES[w.framework].layout(w.precision)
    if zero < layout.params_sharded_from:
        frozen_bytes = 0.0          # replicated: nothing to gather
    if size == 1 or (params <= 0 and frozen_bytes <= 0):
        return 0.0, 0.0, 0.0
    grp = network.group(cluster, size, stride)
    grad_bytes = grad_comm_bytes_per_param(w.framework, w.precision, w.grad_reduce_in_bf16)
    # parameters held whole (ZeRO-1/2) are gathered back after the optimizer in the dtype they are kept in (meshplan's
    # ZeRO-1 keeps fp32 parameters: executor/zero1.py), where sharded ones in the compute dtype (FSDP2's
    # MixedPrecisionPolicy, ZeRO-3's 16-bit copies); Megatron-LM's --fp8-param-gather sends FP8
    gather_bytes = layout.params_bytes if zero < layout.params_sharded_from and not w.fp8_param_gather \
        else cache.gather_bytes_per_param
    closes = RUNTIMES[w.framework].timing.grad_buckets.closes if bucket is not None else ""

    def bucketed(collective, bytes_per_param: float) -> float:
        return in_buckets(lambda n: collective(cluster, n * bytes_per_param, grp), params, bucket, closes)
    if zero == 0:
        return 0.0, 0.0, bucketed(network.all_reduce_s, grad_bytes) if params > 0 else 0.0
    rs = bucketed(network.reduce_scatter_s, grad_bytes) if params > 0 else 0.0
    if bucket is None or zero >= layout.params_sharded_from:    # sharded parameters: gathered a unit at a time
        ag = network.all_gather_s(cluster, params * gather_bytes + frozen_bytes, grp)
    else:                   # held whole, gathered back after the optimizer (frozen ones never are: no buckets)
        ag = bucketed(network.all_gather_s, gather_bytes)
    if zero == 3:
        return ag, ag, rs
    return ag, 0.0, rs


def dp_collectives(cache: CostCache, config: ParallelConfig, params: float, expert: bool = False,
                  frozen_bytes: float = 0.0) -> tuple[float, float, float]:
    """(per micro-batch, once after backward, once after the optimizer) seconds of the
    data-parallel collectives for one layer of ``params`` parameters (per TP rank): those of
    ``dp_phases`` (memoised there), by when they run.

    ZeRO-0 reduces once after the last backward; ZeRO-1 too, and all-gathers the updated
    parameters after the optimizer; ZeRO-2 reduce-scatters every micro-batch (FSDP2 also
    re-gathers the parameters every forward); ZeRO-3 gathers for forward and again for
    backward and reduce-scatters every micro-batch. Which stage does what every micro-batch
    is the runtime's ``Timing`` (planner/runtimes.py), and under torch's pipelining
    (``deferred_sharded_sync``) one reduction after the last backward and the gathers of
    ``gathers_every_microbatch``; a forward gather not made every micro-batch is priced once after the
    optimizer (FSDP2 under a pipeline makes it in the first forward, beside its compute: priced longer).
    """
    gather_fwd, _, reduce = dp_phases(cache, config, params, expert, frozen_bytes)
    forward, backward = dp_micro_passes(cache, config, params, expert, frozen_bytes)
    framework = cache.workload.framework
    return (forward + backward, 0.0 if reduces_every_microbatch(config, framework) else reduce,
            0.0 if gathers_forward_every_microbatch(config, framework) else gather_fwd)


def dp_micro_passes(cache: CostCache, config: ParallelConfig, params: float, expert: bool = False,
                    frozen_bytes: float = 0.0) -> tuple[float, float]:
    """``dp_collectives``' per micro-batch seconds by the pass they run beside: (the gather before the forward, the
    gather before the backward and the reduction after it). A forward's gathers can hide only behind forward
    compute, the backward's collectives behind backward compute (FSDP2 prefetches the next unit's gather within a
    pass: the pre-forward and pre-backward hooks of its state, torch 2.13)."""
    gather_fwd, gather_bwd, reduce = dp_phases(cache, config, params, expert, frozen_bytes)
    framework = cache.workload.framework
    return (gather_fwd if gathers_forward_every_microbatch(config, framework) else 0.0,
            (gather_bwd if gathers_every_microbatch(config, framework) else 0.0)
            + (reduce if reduces_every_microbatch(config, framework) else 0.0))


def _dp_comm_uncached(cache: CostCache, config: ParallelConfig, rank: RankCost) -> tuple[float, float]:
    """(total, exposed) data-parallel / ZeRO communication of one rank per step.

    Runtimes issue these collectives a layer at a time (an FSDP unit, a DDP or
    Megatron bucket), each at its own size and latency. Overlapped with compute, what
    exceeds the compute it hides behind stays exposed, and at least the first layer's
    share (its gather opens the forward, its reduction closes the backward) cannot
    hide; the compute it runs beside slows down by the SMs the collectives occupy.
    """
    if config.dp * config.cp == 1 and not rank.expert_buckets:
        return 0.0, 0.0
    m = config.num_microbatches
    if fetches_per_tensor(config, cache.workload.framework):
        out = m * _per_tensor_s(cache, config, rank)
        return out, out             # every fetch and reduction waits for the GPU: nothing hides (cost/fetch.py)
    forward = backward = once = after = 0.0
    for expert, buckets in ((False, rank.buckets), (True, rank.expert_buckets)):
        for bucket, count in buckets:
            params, frozen = (bucket, 0.0) if expert else bucket
            _, b, c = dp_collectives(cache, config, params, expert, frozen)
            f, k = dp_micro_passes(cache, config, params, expert, frozen)
            forward, backward = forward + count * f, backward + count * k
            once, after = once + count * b, after + count * c
    total = m * (forward + backward) + once + after
    w = cache.workload
    overlap, once_overlaps = dp_overlaps(framework=w.framework, device_kind=cache.cluster.device_kind,
                                         overlap_grad_reduce=w.overlap_grad_reduce, zero=config.zero,
                                         dp=config.dp * config.cp, tp=config.tp, pp=config.pp, ep=config.ep)
    if not overlap:
        return total, total
    first = dp_collectives(cache, config, rank.first_bucket[0], frozen_bytes=rank.first_bucket[1])
    first_passes = dp_micro_passes(cache, config, rank.first_bucket[0], frozen_bytes=rank.first_bucket[1])
    contention = cache.cluster.comm_sm_fraction
    # seconds per micro-batch of forward and of backward in which the rank's other collectives hold the NICs
    # the data-parallel ones cross (``network_busy_s``): those queue behind them
    busy_fwd, busy_bwd = network_busy_s(cache, config, rank)

    def exposed(comm: float, window: float, last: float, busy: float) -> float:
        return exposed_s(comm, window, last, contention=contention, busy=busy)

    # each micro-batch's collectives beside the pass they belong to: the forward's gathers (the first layer's opens
    # it), the backward's gathers and reductions (the first layer's reduction closes it)
    out = m * ((exposed(forward, rank.fwd_s, first_passes[0], busy_fwd) if forward else 0.0)
               + (exposed(backward, rank.bwd_s, first_passes[1], busy_bwd) if backward else 0.0))
    if once and not once_overlaps:
        out += once                      # after the last backward or in the optimizer step, nothing beside it
    elif once:
        out += exposed(once, _chunk_pass_window(config, rank.bwd_s), first[1],
                       _chunk_pass_window(config, busy_bwd))
    if after and RUNTIMES[cache.workload.framework].timing.overlaps_param_gather:
        # beside the next step's first forwards (--overlap-param-gather)
        out += exposed(after, _chunk_pass_window(config, rank.fwd_s), first[2],
                       _chunk_pass_window(config, busy_fwd))
    elif after:
        out += after                                     # ends the optimizer step
    return total, out


def exposed_s(comm: float, window: float, last: float, *, contention: float, busy: float = 0.0) -> float:
    """What of ``comm`` seconds of overlapped collectives the step waits for: the larger of the part the ``window``
    of compute they run beside cannot hold, and ``last`` (the one that closes it) with the compute they slow by
    the SMs they occupy while they run (``contention``: their share of the SMs). Where the collectives outlast the
    window the compute, slowed or not, ends first and the step waits for the collectives alone: the slowdown
    hides under them (the simulation plays it so; adding both priced FSDP2's ZeRO-2 on Mixtral 8x7B on 64 B200 5%
    slower than its simulation, and the search passed over the fastest plan). ``busy``: seconds of the window in
    which other collectives of the rank hold the same NICs (``network_busy_s``): the collectives queue behind them
    on the link, so only the rest of the window hides them."""
    return max(comm - (window - busy), last + contention * comm)


def network_busy_s(cache: CostCache, config: ParallelConfig, rank: RankCost) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch in which the rank's other inter-node traffic holds the NICs its
    data-parallel collectives cross; (0, 0) where those stay inside a node. One NIC carries one transfer at a time
    at its full rate (NCCL gives each connection the link in turn), so groups that cross it at once take turns
    rather than each keeping its own bandwidth; inside a node NVLink's switch serves every pair at once. The
    traffic: the expert all-to-alls where the expert group spans nodes and the context-parallel exchanges where
    that group does (each layer's spread over its forward and backward, with its recompute, as its time is:
    ``layer_network_busy_s``), and the stage-boundary sends where the stages sit on other nodes and the sends run
    beside compute, one per chunk each way (blocking sends are time of their own, ``RankCost.p2p_s``)."""
    if not data_parallel_spans_nodes(cache.cluster, config):
        return 0.0, 0.0
    crosses = network_crossing(cache, config)
    fwd = bwd = 0.0
    if crosses[0] or crosses[1]:
        ctx = cache.context(config)
        for (sig, policy), n in rank.layers:
            f, b = layer_network_busy_s(cache.signature_cost(sig, ctx), policy, *crosses)
            fwd, bwd = fwd + n * f, bwd + n * b
    sends = pipeline_sends_busy_s(cache, config)
    return fwd + sends, bwd + sends


def data_parallel_spans_nodes(cluster: Cluster, config: ParallelConfig) -> bool:
    """Whether the dense data-parallel group (dp x cp ranks spaced tp apart) crosses the network."""
    return network.group(cluster, config.dp * config.cp, config.tp).nodes > 1


def network_crossing(cache: CostCache, config: ParallelConfig) -> tuple[bool, bool]:
    """(the expert group spans nodes, the context-parallel group does)."""
    cluster = cache.cluster
    return (config.ep > 1 and network.group(cluster, config.ep, 1).nodes > 1,
            config.cp > 1 and network.group(cluster, config.cp, config.tp).nodes > 1)


def layer_network_busy_s(cost: LayerCost, policy: str, ep_crosses: bool, cp_crosses: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's inter-node expert and context-parallel traffic per micro-batch:
    its exchanges' time, split between forward and backward (recompute included) as the layer's time is."""
    busy = (cost.ep_comm_s if ep_crosses else 0.0) + (cost.cp_comm_s if cp_crosses else 0.0)
    if busy <= 0:
        return 0.0, 0.0
    fwd, bwd = cost.fwd_s, cost.bwd_s + cost.policy(policy).recompute_s
    return busy * fwd / (fwd + bwd), busy * bwd / (fwd + bwd)


def pipeline_sends_busy_s(cache: CostCache, config: ParallelConfig) -> float:
    """Seconds per micro-batch, in forward and again in backward, that a rank's stage-boundary sends hold the
    NICs: one transfer per chunk (``hop_s``) where stages sit on other nodes and the sends run beside compute."""
    if config.pp == 1 or stages_share_a_node(cache.cluster, config) \
            or not sends_overlap(config.schedule, cache.workload.framework):
        return 0.0
    return config.vpp * cache.hop_s(config)


def stages_share_a_node(cluster: Cluster, config: ParallelConfig) -> bool:
    """Whether neighbouring pipeline stages sit on one node: a stage's tp x cp x dp ranks fill less than one."""
    return config.tp * config.cp * config.dp < cluster.gpus_per_node


def _chunk_pass_window(config: ParallelConfig, pass_s: float) -> float:
    """The pass a once-per-step collective runs beside, from one micro-batch's ``pass_s``: the gradient reduction
    beside the last micro-batch's backward, in which each layer's gradient becomes final, and the parameter gather of
    --overlap-param-gather beside the first micro-batch's forward, in which each layer first needs its parameters.
    Under the interleaved schedule a chunk's gradients are final once the last group of micro-batches (pp of them,
    Megatron-LM's and torch's rounds) has run its backward through that chunk, and the chunks finish one after
    another: all but the last chunk's reductions also run beside the backward of the group's other micro-batches
    through the chunks after them, ``pass_s (1 + (g - 1)(v - 1) / v)``; mirrored, the first group runs its forwards
    through a chunk before any reaches the next, so all but the first chunk's gathers also run beside the group's
    other forwards through the chunks before them."""
    if config.pp > 1 and config.vpp > 1 and SCHEDULES[config.schedule].virtual_stages:
        group = min(config.pp, config.num_microbatches)
        return pass_s * (1 + (group - 1) * (config.vpp - 1) / config.vpp)
    return pass_s


def _per_tensor_s(cache: CostCache, config: ParallelConfig, rank: RankCost) -> float:
    """One micro-batch's ZeRO-3 fetches and reductions, one tensor at a time (planner/cost/fetch.py)."""
    return sum(n * sum(per_tensor_phases(cache, config, sig, policy)) for (sig, policy), n in rank.layers)


def fetches_per_tensor(config: ParallelConfig, framework: str) -> bool:
    """Whether ZeRO-3 runs one tensor at a time here, every fetch and reduction waiting for the GPU
    (``Timing.zero3_per_tensor``; planner/cost/fetch.py)."""
    return config.zero == 3 and RUNTIMES[framework].timing.zero3_per_tensor is not None


def per_tensor_phases(cache: CostCache, config: ParallelConfig, signature: str, policy: str
                      ) -> tuple[float, float, float]:
    """(forward fetches, backward fetches, reductions) of one layer per micro-batch where the runtime's ZeRO-3
    works one tensor at a time (``Timing.zero3_per_tensor``; planner/cost/fetch.py); zeros elsewhere."""
    if not fetches_per_tensor(config, cache.workload.framework) or config.dp * config.cp == 1:
        return 0.0, 0.0, 0.0
    key = ("per-tensor", config.dp * config.cp, config.tp, signature, policy)
    out = cache._phases.get(key)
    if out is None:
        grp = network.group(cache.cluster, config.dp * config.cp, config.tp)
        grad_bytes = grad_comm_bytes_per_param(cache.workload.framework, cache.workload.precision,
                                                cache.workload.grad_reduce_in_bf16)
        out = cache._phases[key] = fetch.layer_phases(
            cache, cache.graph.layers[cache.representative[signature]], policy, config.tp, grp,
            RUNTIMES[cache.workload.framework].timing.zero3_per_tensor, grad_bytes)
    return out


def optimizer_time_s(cache: CostCache, config: ParallelConfig, params: float, expert_params: float = 0.0) -> float:
    """Seconds of the optimizer step over ``params`` parameters of one rank (its ZeRO share), and of
    the step's parameter-sized casts and gradient accumulation under torch eager mixed precision
    (planner.cost.eager.step_param_bytes; zero for the fused runtimes). Every term is bytes per
    parameter over a bandwidth: linear in ``params``, one rate per configuration (memoised on what
    it depends on). ``expert_params``: of ``params``, routed experts', whose ZeRO share is over their expert
    data-parallel ranks as each rank holds them (``routed_state_shard``)."""
    if params <= 0:
        return 0.0
    dense = _optimizer_rate(cache, config, config.dp * config.cp) * (params - expert_params)
    if not expert_params:
        return dense
    return dense + _optimizer_rate(cache, config, routed_state_shard(cache, config)) * expert_params


def _optimizer_rate(cache: CostCache, config: ParallelConfig, shard: int) -> float:
    key = (shard, config.tp > 1, config.pp > 1, config.num_microbatches, config.zero,
           config.optimizer_offload, config.param_offload, config.dp * config.cp)
    rate = cache._optimizer_rates.get(key)
    if rate is None:
        rate = cache._optimizer_rates[key] = _optimizer_time_s(cache, config, 1.0, shard)
    return rate


def _optimizer_time_s(cache: CostCache, config: ParallelConfig, params: float, shard: int) -> float:
    cluster, w = cache.cluster, cache.workload
    local = params / (shard if config.zero >= 1 else 1)
    dev = cluster.device
    regime = eager_regime(framework=w.framework, precision=w.precision, zero=config.zero,
                          dp=config.dp * config.cp, tp=config.tp, pp=config.pp, ep=config.ep)
    per_param = step_param_bytes(regime, zero=config.zero, num_microbatches=config.num_microbatches)
    casts_s = eager_s({c: params * b for c, b in per_param.items()}, 0, dev)
    timing = RUNTIMES[w.framework].timing
    # parameter offload: the shard up before the gathers of every micro-batch (Timing's
    # param_offload_microbatch_copy_bytes), counted here with the other host copies, unhidden
    param_copies = config.num_microbatches * timing.param_offload_microbatch_copy_bytes if config.param_offload else 0.0
    casts_s += network.host_transfer_s(cluster, local * param_copies) if param_copies else 0.0
    if config.nvme_offload:     # the node's drives serve its ranks: read before they reach the host, then written
        read = param_copies + (NVME_OPTIMIZER_BYTES if config.optimizer_offload else 0.0)
        write = (DTYPE_BYTES[w.precision] if config.param_offload else 0.0) \
            + (NVME_OPTIMIZER_BYTES if config.optimizer_offload else 0.0)
        _, read_rate, write_rate = cluster.job_nvme
        casts_s += cluster.gpus_on_a_node * local * (read / read_rate + write / write_rate)
    if not config.optimizer_offload:
        # at the rate measured for the executor's own AdamW on this device where the profile has one
        # ([gpu.kernels] optimizer_GBps: the CPU's per-parameter loop is far from a memory stream),
        # else streamed at the memory bandwidth (one fused kernel)
        rate = dev.optimizer_bytes_per_s or dev.hbm_bytes_per_s * dev.hbm_efficiency
        return casts_s + local * ADAM_BYTES_PER_PARAM / rate
    # ZeRO-Offload (Ren et al. 2021): gradients down, Adam on the CPU, parameters up, as the
    # runtime copies them (planner/runtimes.py Timing.offload_*_copy_bytes).
    # All GPUs of a node share their hosts' DRAM bandwidth.
    cpu_s = cluster.gpus_on_a_node * local * ADAM_BYTES_PER_PARAM / cluster.job_host_dram_bytes_per_s
    once = timing.offload_step_copy_bytes
    # (the updated parameters stay on the host where they are offloaded: nothing goes up after the step)
    up = 0.0 if config.param_offload else DTYPE_BYTES[w.precision]
    copies = ((4.0 + up) if once is None else once[config.zero]) \
        + config.num_microbatches * timing.offload_microbatch_copy_bytes[config.zero]
    return casts_s + cpu_s + network.host_transfer_s(cluster, local * copies)


def _optimizer_s(cache: CostCache, config: ParallelConfig, rank: RankCost) -> tuple[float, float]:
    """(seconds, host bytes per node) of the optimizer step of one rank."""
    return optimizer_time_s(cache, config, rank.params, rank.routed_params), _host_bytes(cache, config, rank)


def _host_bytes(cache: CostCache, config: ParallelConfig, rank: RankCost) -> float:
    """Bytes the node's host memory holds for this rank's offloaded states, times the node's ranks (with offload to
    NVMe, the swap buffers: ``NVME_*``)."""
    if not config.optimizer_offload and not config.param_offload:
        return 0.0
    if config.nvme_offload:
        local = rank.params / (config.dp * config.cp)
        params = NVME_PARAM_BUFFER_ELEMS * DTYPE_BYTES[cache.workload.precision] if config.param_offload else 0.0
        optimizer = min(local, NVME_SUB_GROUP_ELEMS) * (NVME_OPTIMIZER_BYTES + 4.0) if config.optimizer_offload else 0.0
        return cache.cluster.gpus_on_a_node * (params + optimizer)
    return _offloaded_bytes(cache, config, rank)


def nvme_bytes_per_node(cache: CostCache, config: ParallelConfig, ranks: list[RankCost]) -> float:
    """What the node's NVMe holds with offload to NVMe: the states host memory would hold without it."""
    if not config.nvme_offload:
        return 0.0
    return max(_offloaded_bytes(cache, config, rank) for rank in ranks)


def _offloaded_bytes(cache: CostCache, config: ParallelConfig, rank: RankCost) -> float:
    """The offloaded states of one rank, times the node's ranks."""
    states, experts = state_rates(cache, config)
    return cache.cluster.gpus_on_a_node * ((rank.params - rank.routed_params) * states.host
                                           + rank.routed_params * experts.host
                                           + rank.frozen_bytes * frozen_rates(cache, config)[1])


def _host_bytes_per_node(cache: CostCache, config: ParallelConfig, ranks: list[RankCost]) -> float:
    """Host memory per node: the offloaded model states (``_host_bytes``), and the activations offloaded by
    recompute "activation-offload" of the micro-batches in flight, of the node's GPUs (all alike: the most loaded
    rank's)."""
    if not config.optimizer_offload and not config.param_offload and not any(rank.host_act_bytes for rank in ranks):
        return 0.0                  # nothing in host memory
    per_node = cache.cluster.gpus_on_a_node
    most = 0.0
    for r, rank in enumerate(ranks):
        inflight = inflight_microbatches(config, r, cache.workload)
        most = max(most, _host_bytes(cache, config, rank) + per_node * rank.host_act_bytes * inflight)
    return most


def tied_embedding_sync_s(cache: CostCache, config: ParallelConfig) -> float:
    """The all-reduce of a tied embedding's gradients between the first and the last stage
    (each holds a copy), once per step; zero without tied embeddings or a pipeline, and where one rank holds both
    stages (a V: the two copies' gradients are summed in place, a kernel as long as the optimizer's on that table)."""
    graph, w = cache.graph, cache.workload
    if not graph.tied_embeddings or config.pp == 1 or last_stage_rank(config) == 0 \
            or not cache.adapters.trains_tied(graph):
        return 0.0      # (a frozen embedding has no gradient to sum)
    key = (config.tp, config.cp, config.dp, config.pp)
    memo = cache.__dict__.setdefault("_tied_sync", {})
    if key not in memo:
        nbytes = graph.tied_params / config.tp * grad_comm_bytes_per_param(w.framework, w.precision, w.grad_reduce_in_bf16)
        memo[key] = network.all_reduce_s(cache.cluster, nbytes, network.group(
            cache.cluster, 2, config.tp * config.cp * config.dp * (config.pp - 1)))
    return memo[key]


def rank_pipeline_s(cache: CostCache, config: ParallelConfig) -> float:
    """The pipeline of ``config``'s ranks (forward, backward and sends): a part of its step."""
    ranks = rank_costs(cache, config)
    return pipeline_s([r.fwd_s + r.bwd_s + r.p2p_s for r in ranks], config, hop_s=fill_hop_s(cache, config),
                      wgrad_s=[r.wgrad_s for r in ranks])


def uneven_virtual_stages(cache: CostCache, config: ParallelConfig) -> bool:
    """Whether ``config`` runs several virtual stages per rank that hold different numbers of transformer blocks
    (61 blocks over 16 x 3 stages: 13 of two, 35 of one)."""
    if config.pp < 2 or not SCHEDULES[config.schedule].virtual_stages:
        return False
    key = (config.pp, config.vpp, placement_of(config), config.stage_layers)
    memo = cache.__dict__.setdefault("_uneven_stages", {})
    if key not in memo:
        blocks = {sum(cache.graph.layers[i].is_block for i in chunk)
                  for chunks in assign_layers(cache.graph, config) for chunk in chunks}
        memo[key] = len(blocks) > 1
    return memo[key]


def played_pipeline_s(cache: CostCache, config: ParallelConfig) -> float | None:
    """Where the closed form of a schedule with virtual stages does not hold, the pipeline as the simulation
    plays it (planner/pipeline_play.py ``play_pipeline``: each rank's own order of its chunks' forward and backward
    passes, the sends between them; no data-parallel collectives, no optimizer); None where the closed form holds.

    ``PipelineSchedule.pipeline_s`` takes a rank's chunks to be alike, each a v-th of the rank. Where the
    virtual stages hold different numbers of blocks, each group of pp micro-batches passes a chunk at the pace
    of the slowest rank's copy of it while the ranks whose copy is shorter wait, which the rank sums do not
    show: 61 blocks of DeepSeek-V3 over 16 x 3 stages played in 4.2 s where the closed form gave 3.7 s, and the
    search recommended that layout over a 1F1B one of 3.7 s (both as the simulation plays them). Even stages
    keep the closed form, which equals the simulation there."""
    return play_config_pipeline(cache, config) if uneven_virtual_stages(cache, config) else None


def play_config_pipeline(cache: CostCache, config: ParallelConfig) -> float:
    """The plan's pipeline played pass by pass (``play_pipeline`` on its ``chunk_passes``, its stage sends blocking
    or not as the schedule and runtime run them), whether or not its closed form holds; memoised on the cache."""
    key = (cache.context(config), config.pp, config.vpp, config.schedule, config.num_microbatches,
           config.stage_layers, policies_key(config))
    memo = cache.__dict__.setdefault("_played", {})
    if key not in memo:
        memo[key] = play_pipeline(config.schedule, chunk_passes(cache, config), config.num_microbatches,
                                  hop_s=cache.hop_s(config),
                                  blocking_sends=not sends_overlap(config.schedule, cache.workload.framework))
    return memo[key]


def played_pipeline_floor_s(cache: CostCache, config: ParallelConfig) -> float:
    """At most ``played_pipeline_s``, from sums over the chunks instead of a play (planner/pipeline_play.py
    ``pipeline_floor``)."""
    return pipeline_floor(config.schedule, chunk_passes(cache, config), config.num_microbatches,
                          hop_s=cache.hop_s(config))


def chunk_passes(cache: CostCache, config: ParallelConfig) -> tuple[tuple[tuple[float, float, float], ...], ...]:
    """Per rank, per chunk: (forward, backward with its recompute, of it the weight gradient) seconds of one
    micro-batch, exposed TP, CP and expert communication included."""
    key = (cache.context(config), config.pp, config.vpp, placement_of(config), config.stage_layers,
           policies_key(config))
    memo = cache.__dict__.setdefault("_chunk_passes", {})
    if key not in memo:
        ctx = cache.context(config)
        policies = layer_policies(cache.graph, config)
        out = []
        for rank_chunks in assign_layers(cache.graph, config):
            chunks = []
            for chunk in rank_chunks:
                f = b = w = 0.0
                for i in chunk:
                    cost = cache.layer(i, ctx)
                    f += cost.fwd_s
                    b += cost.bwd_s + cost.policy(policies[i]).recompute_s
                    w += cost.wgrad_s
                chunks.append((f, b, w))
            out.append(tuple(chunks))
        memo[key] = tuple(out)
    return memo[key]


def other_bytes(cache: CostCache, config: ParallelConfig) -> float:
    """Runtime reserve plus communication buffers (the same on every rank)."""
    w = cache.workload
    dt = DTYPE_BYTES[w.precision]
    other = cache.cluster.device.reserved_bytes
    if config.pp > 1:       # send and receive buffers of the stage boundary, forward and backward
        tokens = config.micro_batch * w.seq_len / config.cp
        other += 4 * tokens * cache.graph.hidden * dt / (config.tp if config.sequence_parallel else 1)
    if fetches_per_tensor(config, w.framework) and config.dp * config.cp > 1:
        # one tensor at a time (cost/fetch.py): what a layer holds gathered and reduces at its peak
        spec = RUNTIMES[w.framework].timing.zero3_per_tensor
        grad_bytes = grad_comm_bytes_per_param(w.framework, w.precision, w.grad_reduce_in_bf16)
        other += max(params * dt + grads * grad_bytes for params, grads in (
            fetch.working_set(cache.graph.layers[i], config.tp, cache.graph.hidden, spec)
            for i in cache.representative.values()))
    elif config.zero == 3 and config.dp * config.cp > 1:
        # FSDP/ZeRO-3 gathers a layer's parameters (and prefetches the next); backward
        # also holds the layer's unsharded gradient before the reduce-scatter
        ctx = cache.context(config)
        largest = cache.largest_layer_params(ctx)
        other += largest * (2 * dt + grad_comm_bytes_per_param(w.framework, w.precision, w.grad_reduce_in_bf16))
        other += 2 * cache.largest_layer_frozen_bytes(ctx)      # its frozen parameters gathered (and prefetched)
    return other


def grads_follow_activations(framework: str, config: ParallelConfig) -> bool:
    """Whether a rank's gradients and its activations never coexist: torch eager allocates each
    layer's gradient in its backward, as autograd frees that layer's saved tensors, so with one
    micro-batch and no pipeline the step's peak is the larger of the two (end of forward, or end
    of backward), not their sum. Not under gradient accumulation (earlier micro-batches' gradients
    wait while the next forward runs), a pipeline, DDP's gradient buckets (allocated when DDP wraps
    the model: ZeRO-0 with data parallelism) or Megatron's and DeepSpeed's contiguous gradient
    buffers. Measured on an H100: benchmarks/results/gpu_runs.json (categories against
    torch.cuda.max_memory_allocated)."""
    return grads_follow_activations_at(framework, pp=config.pp, num_microbatches=config.num_microbatches,
                                       shard=config.dp * config.cp, zero=config.zero)


def grads_follow_activations_at(framework: str, *, pp: int, num_microbatches: int, shard: int, zero: int) -> bool:
    """``grads_follow_activations`` from the knobs it depends on (``shard``: dp x cp)."""
    return priced_as(framework) == "torch" and pp == 1 and num_microbatches == 1 and (shard == 1 or zero >= 1)


def state_rates(cache: CostCache, config: ParallelConfig):
    """(StateBytes of the dense parameters, of routed experts'): sharded over dp x cp and, the experts, over the
    expert data-parallel ranks as each rank holds them (``routed_state_shard``)."""
    w = cache.workload

    def at(shard: int):
        return state_bytes_per_param(framework=w.framework, precision=w.precision, zero=config.zero, shard=shard,
                                     optimizer_offload=config.optimizer_offload, pp=config.pp,
                                     param_offload=config.param_offload, grads_16bit=w.grad_reduce_in_bf16)
    return at(config.dp * config.cp), at(routed_state_shard(cache, config))


def frozen_rates(cache: CostCache, config: ParallelConfig) -> tuple[float, float]:
    """(device, host) bytes per byte of frozen parameters (``memory.frozen_share`` at dp x cp)."""
    w = cache.workload
    return frozen_share(framework=w.framework, precision=w.precision, zero=config.zero, shard=config.dp * config.cp,
                        pp=config.pp, optimizer_offload=config.optimizer_offload, param_offload=config.param_offload)


def resident_rates(cache: CostCache, config: ParallelConfig) -> tuple[float, float]:
    """(device bytes per dense parameter, per routed-expert parameter) that scale with the parameters
    (``resident_bytes_per_param`` at dp x cp and at ``routed_state_shard``)."""
    w = cache.workload

    def at(shard: int) -> float:
        return resident_bytes_per_param(framework=w.framework, precision=w.precision, zero=config.zero, shard=shard,
                                        optimizer_offload=config.optimizer_offload, tp=config.tp, pp=config.pp,
                                        param_offload=config.param_offload, grads_16bit=w.grad_reduce_in_bf16)
    return at(config.dp * config.cp), at(routed_state_shard(cache, config))


def _memories(cache: CostCache, config: ParallelConfig, ranks: list[RankCost]) -> list[Memory]:
    w = cache.workload
    states, experts = state_rates(cache, config)
    other = other_bytes(cache, config)
    copy = working_copy_bytes_per_param(framework=w.framework, precision=w.precision, zero=config.zero,
                                        tp=config.tp, pp=config.pp)
    frozen = frozen_rates(cache, config)[0]
    out = []
    for r, rank in enumerate(ranks):
        inflight = inflight_microbatches(config, r, cache.workload)
        dense, routed = rank.params - rank.routed_params, rank.routed_params
        out.append(Memory(params=dense * states.params + routed * experts.params + rank.frozen_bytes * frozen,
                          grads=dense * states.grads + routed * experts.grads,
                          optimizer=dense * states.optimizer + routed * experts.optimizer,
                          activations=rank.act_bytes * inflight + rank.peak_extra_bytes,
                          other=other + rank.params * copy, reserve=cache.cluster.device.reserved_bytes,
                          grads_after_activations=grads_follow_activations(w.framework, config)))
    return out


def peak_memory(cache: CostCache, config: ParallelConfig) -> tuple[float, float]:
    """(bytes on the most loaded GPU, offloaded bytes per node): what `fits` is decided on."""
    ranks = rank_costs(cache, config)
    w = cache.workload
    per_param, per_expert = resident_rates(cache, config)
    frozen = frozen_rates(cache, config)[0]
    if grads_follow_activations(w.framework, config):
        device = max(m.total for m in _memories(cache, config, ranks))
    else:
        device = other_bytes(cache, config) + max(
            rank.params * per_param + rank.routed_params * (per_expert - per_param) + rank.peak_extra_bytes
            + rank.frozen_bytes * frozen
            + rank.act_bytes * inflight_microbatches(config, r, cache.workload) for r, rank in enumerate(ranks))
    return device, _host_bytes_per_node(cache, config, ranks)


def usable_bytes(cluster: Cluster, workload: Workload) -> float:
    """The most a plan's predicted peak may be on one device: the runtime reserve, plus the rest of
    the device's memory over 1 + the workload's headroom (planner/config.py DEFAULT_MEMORY_HEADROOM)."""
    reserve = cluster.device.reserved_bytes
    return reserve + (cluster.device.memory_bytes - reserve) / (1.0 + workload.memory_headroom)


def fits(cache: CostCache, config: ParallelConfig) -> bool:
    device, host = peak_memory(cache, config)
    return device <= cache.usable_bytes and host <= cache.cluster.job_host_memory_bytes


def estimate(graph: LayerGraph, cluster: Cluster, workload: Workload, config: ParallelConfig,
             cache: CostCache | None = None) -> Estimate:
    """Step time, throughput and per-GPU memory of ``config`` (pure; ``cache`` only memoises)."""
    cache = cache or CostCache(graph, cluster, workload)
    ranks = rank_costs(cache, config)
    m = config.num_microbatches
    per_rank = [r.fwd_s + r.bwd_s + r.p2p_s for r in ranks]
    pipe = pipeline_s(per_rank, config, hop_s=fill_hop_s(cache, config), wgrad_s=[r.wgrad_s for r in ranks])
    slow = ranks[per_rank.index(max(per_rank))]
    # data-parallel sync starts when a rank's last backward ends; in 1F1B rank r finishes
    # about r backward passes before rank 0, which hides that much of its sync
    dp_exposed = 0.0
    for r, rank in enumerate(ranks):
        _, exposed = _dp_comm(cache, config, rank)
        slack = r * rank.bwd_s if config.pp > 1 else 0.0
        dp_exposed = max(dp_exposed, exposed - slack)
    opt = [_optimizer_s(cache, config, rank) for rank in ranks]
    opt_s = max(o[0] for o in opt)
    host_bytes = _host_bytes_per_node(cache, config, ranks)
    tied_s = tied_embedding_sync_s(cache, config)
    step = pipe + dp_exposed + opt_s + tied_s
    compute = m * (slow.fwd_s + slow.bwd_s - slow.recompute_s - slow.tp_comm_s - slow.cp_comm_s - slow.ep_comm_s)
    time = StepTime(compute=compute, recompute=m * slow.recompute_s, tp_comm=m * slow.tp_comm_s,
                    cp_comm=m * slow.cp_comm_s, ep_comm=m * slow.ep_comm_s, pp_comm=m * slow.p2p_s, bubble=pipe - m * max(per_rank),
                    dp_comm=dp_exposed + tied_s, optimizer=opt_s)
    memories = tuple(_memories(cache, config, ranks))
    peak = max(memories, key=lambda mem: mem.total)
    n = cluster.num_gpus
    tokens = workload.global_batch * workload.seq_len
    model_flops = cache.model_flops_per_token * tokens
    hw_flops = sum(r.matmul_flops for r in ranks) * m * config.dp * config.cp * config.tp
    capacity, usable = cluster.device.memory_bytes, cache.usable_bytes
    host_capacity, nvme_capacity = cluster.job_host_memory_bytes, cluster.job_nvme[0]
    nvme = nvme_bytes_per_node(cache, config, ranks)
    fits = peak.total <= usable and host_bytes <= host_capacity and nvme <= nvme_capacity
    est = Estimate(step_time_s=step, tokens_per_s=tokens / step, model_tflops_per_gpu=model_flops / step / n / 1e12,
                   mfu=model_flops / step / n / cluster.peak_flops(workload.precision),
                   hardware_tflops_per_gpu=hw_flops / step / n / 1e12, memory=peak, memory_per_stage=memories,
                   time=time, capacity_bytes=capacity, usable_bytes=usable, host_bytes_per_node=host_bytes,
                   host_capacity_bytes=host_capacity, nvme_bytes_per_node=nvme, nvme_capacity_bytes=nvme_capacity,
                   fits=fits)
    return host_bound(est, host_s(cache, config))
