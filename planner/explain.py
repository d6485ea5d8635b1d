"""Why a plan won: what each runner-up lost on, and what limits the winner."""
from __future__ import annotations

import math
from dataclasses import fields, replace

from .cluster import GiB, Cluster, builtin_profiles, load_cluster
from .config import ParallelConfig
from .cost.step import estimate
from .placement import balanced_stage_layers, layer_policies
from .estimate import Estimate, StepTime
from . import network
from .recompute import POLICIES, policy_rank
from .runtimes import RUNTIMES

PARTS = {
    "compute": "compute", "recompute": "recompute", "tp_comm": "exposed TP communication",
    "cp_comm": "exposed CP communication", "pp_comm": "pipeline sends", "bubble": "pipeline bubble",
    "dp_comm": "exposed data-parallel communication", "optimizer": "optimizer step",
}


def time_deltas(winner: StepTime, other: StepTime) -> list[tuple[str, float]]:
    """(part, seconds the other plan spends more than the winner), largest first."""
    out = [(f.name, getattr(other, f.name) - getattr(winner, f.name)) for f in fields(StepTime)]
    return sorted(out, key=lambda item: -item[1])


def lost_on(winner: Estimate, other: Estimate) -> str:
    """One sentence with numbers: where the runner-up's extra time goes, and its memory."""
    slower = other.step_time_s - winner.step_time_s
    worse = [(name, d) for name, d in time_deltas(winner.time, other.time) if d > 1e-3 * winner.step_time_s]
    parts = ", ".join(f"{PARTS[name]} +{d:.3g} s" for name, d in worse[:3]) or "no single part"
    gained = [(name, -d) for name, d in time_deltas(winner.time, other.time) if -d > 1e-3 * winner.step_time_s]
    saved = (", though it saves " + ", ".join(f"{PARTS[n]} {d:.3g} s" for n, d in gained[:2])) if gained else ""
    headroom = (other.capacity_bytes - other.memory.total) / GiB
    return (f"{slower:+.3g} s per step ({100 * slower / winner.step_time_s:+.1f}%): {parts}{saved}; "
            f"{headroom:.1f} GiB memory headroom against the winner's "
            f"{(winner.capacity_bytes - winner.memory.total) / GiB:.1f}")


def _link(cluster: Cluster, size: int, stride: int) -> str:
    """Which fabric a group of ``size`` ranks spaced ``stride`` apart crosses."""
    grp = network.group(cluster, size, stride)
    if grp.nodes > 1:
        return f"the network ({cluster.nics_per_node} x {cluster.nic.bytes_per_s * 8 / 1e9:.0f} Gb/s per node)"
    return {"nvswitch": "NVLink", "pcie": "PCIe", "loopback": "loopback"}[cluster.fabric]


def limits(config: ParallelConfig, est: Estimate, cluster: Cluster) -> str:
    """The binding constraints of a plan: memory of its fullest stage, and where time goes."""
    stage = est.peak_stage
    mem = est.memory_per_stage[stage]
    used = 100 * mem.total / est.capacity_bytes
    t = est.time
    step = est.step_time_s
    parts = sorted(((getattr(t, f.name), f.name) for f in fields(StepTime) if f.name != "compute"), reverse=True)
    links = {
        "tp_comm": _link(cluster, config.tp, 1),
        "cp_comm": _link(cluster, config.cp, config.tp),
        "dp_comm": _link(cluster, config.dp * config.cp, config.tp),
        "pp_comm": _link(cluster, 2, config.tp * config.cp * config.dp),
    }
    overheads = []
    for seconds, name in parts[:3]:
        if seconds <= 1e-4 * step:
            continue
        where = f" over {links[name]}" if name in links else ""
        overheads.append(f"{PARTS[name]} {100 * seconds / step:.1f}%{where}")
    biggest = max(("activations", mem.activations), ("model states", mem.params + mem.grads + mem.optimizer),
                  key=lambda x: x[1])
    return (f"memory: stage {stage} uses {mem.total / GiB:.1f} of {est.capacity_bytes / GiB:.1f} GiB ({used:.0f}%), "
            f"mostly {biggest[0]} ({biggest[1] / GiB:.1f} GiB); time: compute {100 * t.compute / step:.1f}%"
            + ("".join(f", {o}" for o in overheads)))


def gains(graph, cluster, workload, config: ParallelConfig, est: Estimate) -> dict:
    """What the per-stage choices bought, against the plain alternatives of the same
    global choice: balanced stages, and every block recomputed (the cost model's numbers)."""
    out = {}
    stages = config.pp * config.vpp
    if config.stage_layers is not None and tuple(config.stage_layers) != balanced_stage_layers(graph, stages):
        balanced = estimate(graph, cluster, workload, replace(config, stage_layers=None,
                                                            recompute_layers=_rebalanced(graph, config)))
        out["non_uniform_stages"] = {
            "layers_per_stage": list(config.stage_layers),
            "balanced_step_time_s": balanced.step_time_s, "balanced_fits": balanced.fits,
            "saved_s": balanced.step_time_s - est.step_time_s,
            "saved_pct": 100 * (balanced.step_time_s / est.step_time_s - 1)}
    policies = layer_policies(graph, config)
    blocks = [p for p, layer in zip(policies, graph.layers) if layer.is_block]
    recomputed = [p for p in blocks if p != "none"]
    if recomputed and "none" in blocks:
        everything = estimate(graph, cluster, workload, replace(config, recompute="full", recompute_layers=None))
        out["partial_recompute"] = {
            "recomputed_layers": len(recomputed), "blocks": len(blocks),
            "by_policy": {p: recomputed.count(p) for p in POLICIES if p in recomputed},
            "full_recompute_step_time_s": everything.step_time_s,
            "saved_s": everything.step_time_s - est.step_time_s,
            "saved_pct": 100 * (everything.step_time_s / est.step_time_s - 1)}
    return out


def _rebalanced(graph, config: ParallelConfig):
    """The same number of recomputed blocks per policy, laid over balanced stages."""
    policies = layer_policies(graph, config)
    blocks = sorted((p for p, layer in zip(policies, graph.layers) if layer.is_block),
                    key=lambda p: (p == "none", -policy_rank(p)))
    out, it = [], iter(blocks)
    for layer in graph.layers:
        out.append(next(it) if layer.is_block else "none")
    return tuple(out)


def fixes_for_no_fit(graph, cluster, workload, knobs, need_bytes: float = 0.0) -> list[str]:
    """Changes that would make a plan fit, each re-searched, with its predicted effect:
    more GPUs, a shorter sequence, GPUs with more memory, each fixed memory knob
    (micro-batch, recompute, ZeRO stage) at its most frugal value, optimizer offload,
    no fixed knobs at all."""
    from .search import Knobs, search

    tries = []
    per_node = cluster.gpus_per_node
    # model states shard about 1/n: jump to the power of two the memory ratio suggests
    ratio = max(2.0, need_bytes / cluster.device.memory_bytes) if need_bytes else 2.0
    first = 2 ** max(1, math.ceil(math.log2(ratio)))
    for factor in sorted({2, first, 2 * first}):
        gpus = cluster.num_gpus * factor
        if cluster.max_nodes and gpus > cluster.max_nodes * per_node:
            break
        if workload.global_batch % factor == 0 or gpus <= workload.global_batch:
            tries.append((f"--gpus {gpus}", graph, cluster.with_gpus(gpus), workload, knobs))
    if workload.seq_len >= 256:
        tries.append((f"--seq-len {workload.seq_len // 2}", graph, cluster,
                      replace(workload, seq_len=workload.seq_len // 2), knobs))
    if cluster.fabric != "loopback" and "h200" in builtin_profiles() and cluster.device.memory_bytes < 140 * GiB:
        tries.append(("--cluster h200", graph, load_cluster("h200", cluster.num_gpus), workload, knobs))
    # each fixed memory knob moved alone to its most frugal value
    if knobs.micro_batch is not None and knobs.micro_batch > 1:
        tries.append(("--micro-batch 1", graph, cluster, workload, replace(knobs, micro_batch=1)))
    for frugal in ("full", "activation-offload"):   # the least activations on the device, where the runtime runs them
        if knobs.recompute not in (None, frugal) and frugal in RUNTIMES[workload.framework].on(
                cluster.device_kind).recomputes:
            tries.append((f"--recompute {frugal}", graph, cluster, workload, replace(knobs, recompute=frugal)))
    most_sharded = max(RUNTIMES[workload.framework].on(cluster.device_kind).zero_stages)
    if knobs.zero is not None and knobs.zero < most_sharded:
        tries.append((f"--zero {most_sharded}", graph, cluster, workload, replace(knobs, zero=most_sharded)))
    if not knobs.optimizer_offload:         # ZeRO-Offload: this runtime's, else DeepSpeed's
        offloads = bool(RUNTIMES[workload.framework].on(cluster.device_kind).offload_zero_stages)
        runtime = workload.framework if offloads else "deepspeed"
        label = "--optimizer-offload on" + (f" --framework {runtime}" if runtime != workload.framework else "")
        tries.append((label, graph, cluster, replace(workload, framework=runtime),
                      replace(knobs, optimizer_offload=True, zero=knobs.zero if knobs.zero else None)))
    if knobs.fixed():
        flags = " ".join(f"--{k.replace('_', '-')}" for k in knobs.fixed())
        tries.append((f"without {flags}", graph, cluster, workload, Knobs()))
    out = []
    for label, g, c, w, k in tries:
        try:
            result = search(g, c, w, k, top_k=1, solver="uniform")
        except Exception:           # a change that is itself illegal is simply not suggested
            continue
        if result.best is not None:
            e, cfg = result.best.estimate, result.best.config
            out.append(f"{label} fits ({e.step_time_s:.3g} s per step, {e.memory.total / GiB:.1f} of "
                       f"{e.capacity_bytes / GiB:.1f} GiB, dp {cfg.dp} tp {cfg.tp} pp {cfg.pp} cp {cfg.cp} "
                       f"ZeRO-{cfg.zero})")
        elif result.least_memory is not None:
            e = result.least_memory.estimate
            host = (f" and {e.host_bytes_per_node / GiB:.1f} GiB of host memory per node"
                    if e.host_bytes_per_node > e.host_capacity_bytes else "")
            out.append(f"{label} still needs {e.memory.total / GiB:.1f} GiB{host}")
    return out


def no_fit_message(result, graph, cluster, workload, knobs) -> str:
    """Why nothing fits, in one sentence: the least memory any candidate of ``result`` needs (and host memory
    where that is what misses), against the device's, and what would change it (``fixes_for_no_fit``)."""
    least = result.least_memory
    capacity = cluster.device.memory_bytes / GiB
    if least is None:
        return "no legal configuration exists for these knobs"
    need = least.estimate.memory.total / GiB
    c = least.config
    fixes = fixes_for_no_fit(graph, cluster, workload, knobs, need_bytes=least.estimate.memory.total)
    e = least.estimate
    host = (f" and {e.host_bytes_per_node / GiB:.1f} GiB of host memory per node against "
            f"{e.host_capacity_bytes / GiB:.1f} GiB" if e.host_bytes_per_node > e.host_capacity_bytes else "")
    return (f"no plan fits: the least memory any candidate needs is {need:.1f} GiB per GPU "
            f"(dp {c.dp} tp {c.tp} pp {c.pp} cp {c.cp}, ZeRO-{c.zero}, recompute {c.recompute}, "
            f"optimizer offload {'on' if c.optimizer_offload else 'off'}, micro-batch {c.micro_batch}) against "
            f"{capacity:.1f} GiB{host}; "
            + ("what would change it: " + "; ".join(fixes) if fixes else
               "no single change tried (more GPUs, a shorter sequence, more memory) makes it fit"))

