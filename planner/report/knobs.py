"""The next knob to turn: small changes to the winning plan, each predicted by the cost
model and the simulation (memory from the estimate, time from the simulated step)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import check_config
from ..cost.step import CostCache
from ..describe import gib
from ..errors import UserError
from ..runtimes import RUNTIMES
from ..schedules import SCHEDULES
from ..search.space import max_stages
from ..simulate import simulated_estimate


@dataclass(frozen=True, kw_only=True)
class Knob:
    name: str                 # what to change, e.g. "micro-batch 2 -> 4"
    step_time_s: float        # simulated
    tokens_per_s: float
    gain_pct: float           # throughput against the winner, percent
    memory_bytes: float       # the most loaded GPU
    fits: bool

    def describe(self, capacity_bytes: float) -> str:
        memory = (f"{gib(self.memory_bytes)} GiB per GPU" if self.fits else
                  f"needs {gib(self.memory_bytes)} GiB per GPU, {gib(self.memory_bytes - capacity_bytes)} "
                  "more than the device has")
        return f"{self.name}: {self.gain_pct:+.1f}% tokens/s ({self.step_time_s:.3g} s per step), {memory}"


def _config_variants(plan) -> list[tuple[str, object]]:
    """(name, ParallelConfig) of the plan's own knobs, one step each way."""
    c = plan.best.config
    out = []
    if c.num_microbatches % 2 == 0:
        out.append((f"micro-batch {c.micro_batch} -> {2 * c.micro_batch}",
                    replace(c, micro_batch=2 * c.micro_batch, num_microbatches=c.num_microbatches // 2)))
    if c.micro_batch % 2 == 0:
        out.append((f"micro-batch {c.micro_batch} -> {c.micro_batch // 2}",
                    replace(c, micro_batch=c.micro_batch // 2, num_microbatches=2 * c.num_microbatches)))
    if SCHEDULES[c.schedule].virtual_stages:
        out.append((f"virtual stages {c.vpp} -> {2 * c.vpp}", replace(c, vpp=2 * c.vpp, stage_layers=None)))
        if c.vpp >= 4:
            out.append((f"virtual stages {c.vpp} -> {c.vpp // 2}", replace(c, vpp=c.vpp // 2, stage_layers=None)))
    if c.recompute != "none" or (c.recompute_layers and set(c.recompute_layers) != {"none"}):
        out.append(("no activation recompute", replace(c, recompute="none", recompute_layers=None)))
    if c.optimizer_offload:
        out.append(("optimizer states on the GPU (no optimizer offload)", replace(c, optimizer_offload=False)))
    if c.zero >= 2:
        out.append((f"ZeRO-{c.zero} -> ZeRO-1", replace(c, zero=1, optimizer_offload=False)))
    return out


def _legal(plan, config) -> bool:
    g, w = plan.graph, plan.workload
    try:
        can = RUNTIMES[w.framework].on(plan.cluster.device_kind)
        check_config(config, num_gpus=plan.cluster.num_gpus, global_batch=w.global_batch, seq_len=w.seq_len,
                     num_heads=g.num_heads, num_kv_heads=g.num_kv_heads, num_blocks=g.num_blocks,
                     framework=w.framework, device_kind=plan.cluster.device_kind,
                     max_stages=max_stages(g, can.stages_without_blocks), num_experts=g.num_experts,
                     latent_attention=g.latent_attention, fp8=w.fp8, compile=w.compile,
                     ep_comm_overlap=w.ep_comm_overlap)
    except UserError:
        return False
    return True


def next_knobs(plan, cache: CostCache | None = None) -> list[Knob]:
    """Every one-step change that is legal, best throughput first: the plan's own knobs, twice
    the global batch (more micro-batches to fill the pipeline), twice the inter-node bandwidth and, under expert
    parallelism, the runtime's other token dispatchers.
    ``cache`` (the plan's graph, cluster and workload) only memoises, for the trials on the plan's
    own cluster and workload."""
    base = plan.best.estimate
    own = cache or CostCache(plan.graph, plan.cluster, plan.workload)
    trials = [(name, config, plan.cluster, plan.workload) for name, config in _config_variants(plan)
              if _legal(plan, config)]
    c, w = plan.best.config, plan.workload
    trials.append((f"global batch {w.global_batch} -> {2 * w.global_batch}",
                   replace(c, num_microbatches=2 * c.num_microbatches), plan.cluster,
                   replace(w, global_batch=2 * w.global_batch)))
    if plan.cluster.num_nodes > 1 and plan.cluster.nics_per_node:
        faster = replace(plan.cluster, nic=replace(plan.cluster.nic, bytes_per_s=2 * plan.cluster.nic.bytes_per_s))
        trials.append(("twice the inter-node bandwidth", c, faster, w))
    # under expert parallelism, the runtime's other token dispatchers (Megatron-LM's flex: DeepEP's kernels) that
    # run with the plan's workload (--ep-comm-overlap: api.check_ep_comm_overlap)
    if c.ep > 1 and w.framework in RUNTIMES:
        from ..api import check_ep_comm_overlap
        for dispatcher in RUNTIMES[w.framework].on(plan.cluster.device_kind).expert_dispatchers:
            if dispatcher == w.expert_dispatcher:
                continue
            if w.ep_comm_overlap:
                try:
                    check_ep_comm_overlap(w.framework, plan.cluster, plan.graph.num_experts, dispatcher)
                except UserError:
                    continue
            trials.append((f"--expert-dispatcher {dispatcher}", c, plan.cluster,
                           replace(w, expert_dispatcher=dispatcher)))
    out = []
    for name, config, cluster, workload in trials:
        same = cluster is plan.cluster and workload is plan.workload
        trial_cache = own if same else CostCache(plan.graph, cluster, workload)
        est = simulated_estimate(plan.graph, cluster, workload, config, trial_cache)
        out.append(Knob(name=name, step_time_s=est.step_time_s, tokens_per_s=est.tokens_per_s,
                        gain_pct=100 * (est.tokens_per_s / base.tokens_per_s - 1), memory_bytes=est.memory.total,
                        fits=est.fits))
    return sorted(out, key=lambda k: -k.gain_pct)
