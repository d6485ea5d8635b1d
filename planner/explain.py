"""Why a plan won: what each runner-up lost on, and what limits the winner."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from .cluster import GiB, Cluster, builtin_profiles, load_cluster
from .config import ParallelConfig, knob_flag
from .cost.step import estimate
from .placement import balanced_stage_layers, layer_policies
from .estimate import Estimate, StepTime
from . import network
from .recompute import POLICIES, policy_rank
from .runtimes import RUNTIMES, config_refusals

PARTS = {
    "compute": "compute", "recompute": "recompute", "tp_comm": "exposed TP communication",
    "cp_comm": "exposed CP communication", "ep_comm": "expert all-to-all", "pp_comm": "pipeline sends", "bubble": "pipeline bubble",
    "dp_comm": "exposed data-parallel communication", "optimizer": "optimizer step",
    "host_wait": "waiting for the host to issue kernels",
}


def time_deltas(winner: StepTime, other: StepTime) -> list[tuple[str, float]]:
    """(part, seconds the other plan spends more than the winner), largest first."""
    out = [(f.name, getattr(other, f.name) - getattr(winner, f.name)) for f in fields(StepTime)]
    return sorted(out, key=lambda item: -item[1])


def lost_on(winner: Estimate, other: Estimate) -> str:
    """One sentence with numbers: where the runner-up's extra time goes, and its memory; for one the
    model puts faster (a plan chosen within the error band for its safety), what it would save."""
    slower = other.step_time_s - winner.step_time_s
    if slower < 0:
        gained = [(name, -d) for name, d in time_deltas(winner.time, other.time) if -d > 1e-3 * winner.step_time_s]
        parts = ", ".join(f"{PARTS[n]} {d:.3g} s" for n, d in gained[:3]) or "no single part"
        return (f"faster by {-slower:.3g} s per step ({100 * -slower / winner.step_time_s:.1f}%, within the model's "
                f"error): it saves {parts}; {_left(other):.1f} GiB of usable memory left against the chosen plan's "
                f"{_left(winner):.1f}")
    worse = [(name, d) for name, d in time_deltas(winner.time, other.time) if d > 1e-3 * winner.step_time_s]
    parts = ", ".join(f"{PARTS[name]} +{d:.3g} s" for name, d in worse[:3]) or "no single part"
    gained = [(name, -d) for name, d in time_deltas(winner.time, other.time) if -d > 1e-3 * winner.step_time_s]
    saved = (", though it saves " + ", ".join(f"{PARTS[n]} {d:.3g} s" for n, d in gained[:2])) if gained else ""
    return (f"{slower:+.3g} s per step ({100 * slower / winner.step_time_s:+.1f}%): {parts}{saved}; "
            f"{_left(other):.1f} GiB of usable memory left against the winner's {_left(winner):.1f}")


def _left(e: Estimate) -> float:
    """GiB below the usable memory (the device's less the headroom)."""
    return (e.usable_bytes - e.memory.total) / GiB


def _link(cluster: Cluster, size: int, stride: int) -> str:
    """Which fabric a group of ``size`` ranks spaced ``stride`` apart crosses."""
    grp = network.group(cluster, size, stride)
    if grp.nodes > 1:
        return f"the network ({cluster.nics_per_node} x {cluster.nic.bytes_per_s * 8 / 1e9:.0f} Gb/s per node)"
    return {"nvswitch": "NVLink", "mesh": "the node's GPU-to-GPU links", "pcie": "PCIe",
            "loopback": "loopback"}[cluster.fabric]


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
        "ep_comm": _link(cluster, config.ep, 1),
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
    others = _other_schedules(graph, cluster, workload, config, est)
    if others:
        out["schedules"] = others
    return out


def _flag_value(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _other_schedules(graph, cluster, workload, config: ParallelConfig, est: Estimate) -> dict | None:
    """The winner's layout under each other schedule its runtime runs (planner/schedules.py; a dominated one
    left out), on balanced stages with the same recompute per block, and the chosen schedule on balanced stages
    too, so that the schedule alone differs: which is faster and which holds more memory (the closed form)."""
    from .schedules import SCHEDULES
    if config.pp < 2:
        return None
    can = RUNTIMES[workload.framework].on(cluster.device_kind)
    policies = _rebalanced(graph, config)
    base = estimate(graph, cluster, workload, replace(config, stage_layers=None, recompute_layers=policies))
    tried, refused = [], {}
    for name in can.schedules:
        record = SCHEDULES[name]
        if name == config.schedule or record.dominated_by or record.compile_refusal(workload.compile):
            continue
        if record.virtual_stages and config.pp < can.virtual_stages_min_pp:
            continue
        # virtual stages: the record's, else every count the stages allow (one layer each at most), the fastest
        most = len(graph.layers) if can.stages_without_blocks else graph.num_blocks
        vpps = ([record.stages_per_rank] if record.stages_per_rank else range(2, most // config.pp + 1)) \
            if record.virtual_stages else [1]
        found = None
        for vpp in vpps:
            if config.pp * vpp > most or record.refusal(pp=config.pp, vpp=vpp, m=config.num_microbatches):
                continue
            trial = replace(config, schedule=name, vpp=vpp, stage_layers=None, recompute_layers=policies)
            why = config_refusals(trial, workload.framework, cluster.device_kind, fp8=workload.fp8,
                                  compile=workload.compile, ep_comm_overlap=workload.ep_comm_overlap)
            if why:             # the runtime does not run this schedule with the plan's other knobs
                knob = why[0][0]
                refused.setdefault(name, f"{knob_flag(knob)} {_flag_value(getattr(trial, knob))}")
                continue
            other = estimate(graph, cluster, workload, trial)
            if found is None or (other.fits, -other.step_time_s) > (found[1].fits, -found[1].step_time_s):
                found = (vpp, other)
        if found:
            refused.pop(name, None)
            vpp, other = found
            tried.append({"schedule": name, "vpp": vpp, "step_time_s": other.step_time_s, "fits": other.fits,
                          "memory_bytes": other.memory.total, "bubble_s": other.time.bubble})
    if not tried and not refused:
        return None
    return {"schedule": config.schedule, "vpp": config.vpp, "step_time_s": base.step_time_s,
            "memory_bytes": base.memory.total, "bubble_s": base.time.bubble, "usable_bytes": base.usable_bytes,
            "microbatches": config.num_microbatches, "pp": config.pp, "others": tried, "refused": refused}


def schedule_sentence(won: dict) -> str | None:
    """``gains["schedules"]`` in words (``_schedule_sentence``); None where the plan has no such comparison."""
    return _schedule_sentence(won["schedules"]) if "schedules" in won else None


def _schedule_sentence(found: dict) -> str:
    """``gains["schedules"]`` in words: each other schedule's step and memory against the chosen one's on the
    same balanced stages, why the split-backward schedules gain little where interleaved 1F1B's bubble is
    already small, and which faster schedule the memory rules out."""
    from .schedules import SCHEDULES
    t0, m0 = found["step_time_s"], found["memory_bytes"]

    def name(item) -> str:
        return item["schedule"] + (f" (vpp {item['vpp']})" if SCHEDULES[item["schedule"]].virtual_stages else "")

    parts = []
    for o in sorted(found["others"], key=lambda o: o["step_time_s"]):
        dm = (o["memory_bytes"] - m0) / GiB
        parts.append(f"{name(o)} {100 * (o['step_time_s'] / t0 - 1):+.1f}% ({dm:+.1f} GiB"
                     + ("" if o["fits"] else ", does not fit") + ")")
    out = (f"{name(found)} against the other schedules, all on balanced stages: " + ", ".join(parts)
           if parts else f"{name(found)}: no other schedule runs with these knobs")
    by_knob: dict[str, list[str]] = {}
    for n, knob in (found.get("refused") or {}).items():
        by_knob.setdefault(knob, []).append(n)
    for knob, names in by_knob.items():
        out += f"; {', '.join(names)}: not on this runtime with {knob}"
    chosen = SCHEDULES[found["schedule"]]
    p, m = found["pp"], found["microbatches"]
    interleaved = [o for o in found["others"] if SCHEDULES[o["schedule"]].virtual_stages
                   and SCHEDULES[o["schedule"]].backward == "whole"]
    split = [o for o in found["others"] if SCHEDULES[o["schedule"]].backward == "split"]
    if chosen.virtual_stages and chosen.backward == "whole" and split:
        best = min(split, key=lambda o: o["step_time_s"])
        v = found["vpp"]
        out += (f"; splitting the backward would save at most {100 * max(0.0, 1 - best['step_time_s'] / t0):.1f}%: "
                f"interleaved 1F1B's bubble is already (p - 1)/(v m) = {p - 1}/({v} x {m}) = "
                f"{100 * (p - 1) / (v * m):.1f}% of the pipeline's passes")
    elif chosen.backward == "split" and interleaved:
        best = min(interleaved, key=lambda o: o["step_time_s"])
        gain = best["step_time_s"] / t0 - 1
        bubble = (f"(p - 1)/(v m) = {p - 1}/({best['vpp']} x {m}) = {100 * (p - 1) / (best['vpp'] * m):.1f}% of the "
                  "pipeline's passes")
        if gain > 0:
            out += (f"; it gains {100 * gain:.1f}% over {name(best)}, whose bubble {bubble} is all the weight "
                    "gradients can fill")
        else:
            out += (f"; {name(best)} is as fast ({100 * gain:+.1f}%): its bubble is already {bubble}, so deferring "
                    "the weight gradients has little to fill")
    if chosen.backward == "split" and chosen.placement == "v" and m < p * found["vpp"]:
        out += (f"; with {m} micro-batches for its {p * found['vpp']} stages the V has no steady state for the weight "
                "gradients to fill: the first micro-batch's way through every stage and back, and the last rank's "
                f"{m} weight gradients after it, are on the path (more micro-batches per step would shrink its bubble)")
    faster_too_big = [o for o in found["others"] if o["step_time_s"] < t0 and not o["fits"]]
    if faster_too_big:
        o = min(faster_too_big, key=lambda o: o["step_time_s"])
        out += (f"; {name(o)} would be {100 * (1 - o['step_time_s'] / t0):.1f}% faster but needs "
                f"{(o['memory_bytes'] - found['usable_bytes']) / GiB:.1f} GiB more than is usable: its extra memory "
                "does not pay")
    return out


def gain_sentences(won: dict) -> list[str]:
    """``gains`` in words, one sentence each, never a negative saving: what the per-stage choice buys, or
    what it costs where the plain alternative does not fit (memory decided it) or the simulation ranked it."""
    out = []
    for key, what, s, against in (("non_uniform_stages", "unequal stages", "", "balanced ones"),
                                  ("partial_recompute", "recomputing {recomputed_layers} of {blocks} blocks", "s",
                                   "recomputing every block")):
        if key not in won:
            continue
        g = won[key]
        subject = what.format(**g)
        if key == "partial_recompute" and set(g.get("by_policy", ())) == {"activation-offload"}:
            subject = "offloading the activations of {recomputed_layers} of {blocks} blocks".format(**g)
        if g["saved_s"] >= 0:
            out.append(f"{subject} save{s} {g['saved_s']:.3g} s per step ({g['saved_pct']:.1f}%) against {against}"
                       + ("" if g.get("balanced_fits", True) else ", which would not even fit"))
        elif not g.get("balanced_fits", True):
            out.append(f"{subject} take{s} {-g['saved_s']:.3g} s per step ({-g['saved_pct']:.1f}%) more than "
                       f"{against}, which would not fit: memory decided")
        else:
            out.append(f"{subject} take{s} {-g['saved_s']:.3g} s per step ({-g['saved_pct']:.1f}%) more than "
                       f"{against} in the closed form; the simulated step ranked them first")
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


@dataclass(frozen=True, kw_only=True)
class Fix:
    """One change tried when nothing fits, and what the search found with it."""

    change: str                         # the flags that make the change, e.g. "--gpus 16"
    fits: bool
    memory_bytes: float                 # the best plan's (fits), else the least any candidate needs
    capacity_bytes: float
    usable_bytes: float                 # the capacity less the headroom
    host_bytes_per_node: float = 0.0
    host_capacity_bytes: float = 0.0
    step_time_s: float | None = None    # the best plan's, where one fits
    config: ParallelConfig | None = None

    def line(self) -> str:
        if self.fits:
            c = self.config
            return (f"{self.change} fits ({self.step_time_s:.3g} s per step, {self.memory_bytes / GiB:.1f} of "
                    f"{self.usable_bytes / GiB:.1f} usable GiB, dp {c.dp} tp {c.tp} pp {c.pp} cp {c.cp} ZeRO-{c.zero})")
        host = (f" and {self.host_bytes_per_node / GiB:.1f} GiB of host memory per node"
                if self.host_bytes_per_node > self.host_capacity_bytes else "")
        return f"{self.change} still needs {self.memory_bytes / GiB:.1f} GiB{host}"

    def to_json(self) -> dict:
        return {"change": self.change, "fits": self.fits, "memory_bytes": int(self.memory_bytes),
                "capacity_bytes": int(self.capacity_bytes), "usable_bytes": int(self.usable_bytes),
                "host_bytes_per_node": int(self.host_bytes_per_node),
                "host_capacity_bytes": int(self.host_capacity_bytes), "step_time_s": self.step_time_s,
                "config": self.config.to_json() if self.config else None}


def fixes_for_no_fit(graph, cluster, workload, knobs, need_bytes: float = 0.0) -> list[Fix]:
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
        found = result.best or result.least_memory
        if found is not None:
            e = found.estimate
            out.append(Fix(change=label, fits=result.best is not None, memory_bytes=e.memory.total,
                           capacity_bytes=e.capacity_bytes, usable_bytes=e.usable_bytes,
                           host_bytes_per_node=e.host_bytes_per_node,
                           host_capacity_bytes=e.host_capacity_bytes,
                           step_time_s=e.step_time_s if result.best is not None else None,
                           config=found.config if result.best is not None else None))
    return out


@dataclass(frozen=True, kw_only=True)
class NoFit:
    """Why nothing fits: the candidate that needs the least memory, against the device's, and the changes
    tried (``fixes_for_no_fit``). ``message`` is the one line the CLI prints; ``to_json`` what --json does."""

    least: object | None                # a Candidate (None: no legal configuration at all)
    capacity_bytes: float
    usable_bytes: float                 # the capacity less the workload's memory headroom
    headroom: float
    fixes: tuple[Fix, ...] = ()
    refused: str = ""                   # with no legal configuration: what the runtime refuses of the fixed knobs

    def message(self) -> str:
        if self.least is None:
            return "no legal configuration exists for these knobs" + (f": {self.refused}" if self.refused else "")
        c, e = self.least.config, self.least.estimate
        host = (f" and {e.host_bytes_per_node / GiB:.1f} GiB of host memory per node against "
                f"{e.host_capacity_bytes / GiB:.1f} GiB" if e.host_bytes_per_node > e.host_capacity_bytes else "")
        return (f"no plan fits: the least memory any candidate needs is {e.memory.total / GiB:.1f} GiB per GPU "
                f"(dp {c.dp} tp {c.tp} pp {c.pp} cp {c.cp}, ZeRO-{c.zero}, recompute {c.recompute}, "
                f"optimizer offload {'on' if c.optimizer_offload else 'off'}, micro-batch {c.micro_batch}) against "
                f"{usable_line(self.capacity_bytes, self.usable_bytes, self.headroom)}{host}; "
                + ("what would change it: " + "; ".join(f.line() for f in self.fixes) if self.fixes else
                   "no single change tried (more GPUs, a shorter sequence, more memory) makes it fit"))

    def to_json(self) -> dict:
        least = None if self.least is None else {"config": self.least.config.to_json(),
                                                 "estimate": self.least.estimate.to_json()}
        return {"least_memory": least, "capacity_bytes": int(self.capacity_bytes),
                "usable_bytes": int(self.usable_bytes), "memory_headroom": self.headroom,
                "what_would_fit": [f.to_json() for f in self.fixes if f.fits],
                "tried": [f.to_json() for f in self.fixes]}


def no_fit(result, graph, cluster, workload, knobs) -> NoFit:
    """``NoFit`` of a search ``result`` whose best is None."""
    least = result.least_memory
    fixes = () if least is None else tuple(fixes_for_no_fit(graph, cluster, workload, knobs,
                                                              need_bytes=least.estimate.memory.total))
    from .cost.step import usable_bytes
    return NoFit(least=least, capacity_bytes=cluster.device.memory_bytes, usable_bytes=usable_bytes(cluster, workload),
                 headroom=workload.memory_headroom, fixes=fixes,
                 refused=_refused(graph, cluster, workload, knobs) if least is None else "")


def _refused(graph, cluster, workload, knobs) -> str:
    """What the runtime table refuses of the knobs given (planner/runtimes.py ``refusals``), in its words, with
    the flag: why no configuration is legal where the knobs alone say it."""
    from .config import knob_flag
    from .runtimes import RUNTIMES, refusals
    if workload.framework not in RUNTIMES:
        return ""
    given = {name: getattr(knobs, name) for name in ("zero", "tp", "pp", "cp", "schedule", "optimizer_offload",
                                                      "param_offload", "sequence_parallel", "recompute", "ep", "dp")
             if getattr(knobs, name, None) is not None}
    found = refusals(workload.framework, cluster.device_kind, num_kv_heads=graph.num_kv_heads,
                     num_experts=graph.num_experts or None, fp8=workload.fp8,
                     ep_comm_overlap=workload.ep_comm_overlap, **given)
    return "; ".join(f"{why} ({knob_flag(knob)})" for knob, why in found[:2])


def usable_line(capacity_bytes: float, usable_bytes: float, headroom: float) -> str:
    """'68.0 GiB usable (80.0 GiB less the 18% memory headroom)', or '80.0 GiB' without a headroom."""
    if headroom <= 0:
        return f"{capacity_bytes / GiB:.1f} GiB"
    return (f"{usable_bytes / GiB:.1f} GiB usable ({capacity_bytes / GiB:.1f} GiB less the {100 * headroom:.0f}% "
            "memory headroom)")


def ranking_sentence(choice: dict, chosen: Estimate, runners_up) -> str | None:
    """Where runners-up lie within the model's step-time error of the fastest: says the ranking is
    within the error, which rule chose (planner/search/result.py ``choose``) and the mechanism that
    separates the chosen plan from the nearest runner-up (their largest step-time difference). None
    where no runner-up is within the band. ``runners_up``: the plan's Alternatives."""
    if not choice or choice.get("within_band", 1) <= 1 or not runners_up:
        return None
    band, fastest = choice["band"], choice["fastest"]
    near = min(runners_up, key=lambda a: abs(a.estimate.step_time_s - chosen.step_time_s))
    deltas = sorted(time_deltas(chosen.time, near.estimate.time), key=lambda item: -abs(item[1]))
    name, d = deltas[0]
    which = "more" if d > 0 else "less"
    gap = f"{100 * (near.estimate.step_time_s / chosen.step_time_s - 1):+.1f}%"
    tied = abs(near.estimate.step_time_s - chosen.step_time_s) < 1e-4 * chosen.step_time_s
    if tied and abs(d) < 1e-4 * chosen.step_time_s:      # no part of the step tells them apart
        separates = f"the nearest ({gap}) prices the same step, part by part"
    else:
        separates = f"what separates it from the nearest ({gap}) is {PARTS[name]}: {abs(d):.3g} s {which}"
    head = (f"{choice['within_band']} plans lie within the model's step-time error (±{100 * band:.1f}%, the "
            "validation's median) of the fastest: the ranking among them is within the model's error")
    if choice["rule"] == "fastest":
        return f"{head}; the fastest is kept (none of the others has fewer mechanisms and as much memory left); {separates}"
    mech = ", ".join(choice["chosen"]["mechanisms"]) or "none beyond data parallelism"
    return (f"{head}; chosen by the rule more-headroom-within-band: {choice['chosen']['memory_left_bytes'] / GiB:.1f} "
            f"GiB left against the fastest's {fastest['memory_left_bytes'] / GiB:.1f}, mechanisms it rests on: {mech} "
            f"(the fastest's: {', '.join(fastest['mechanisms']) or 'none beyond data parallelism'}), "
            f"{100 * (chosen.step_time_s / fastest['step_time_s'] - 1):.1f}% slower by the model; {separates}")


def headroom_words(headroom: float, est: Estimate) -> str:
    """'18% headroom: 68.0 GiB usable, 4.3 left' for the plan's memory line."""
    if headroom <= 0:
        return f"no memory headroom: {(est.usable_bytes - est.memory.total) / GiB:.1f} GiB left"
    return (f"{100 * headroom:.0f}% memory headroom: {est.usable_bytes / GiB:.1f} GiB usable, "
            f"{(est.usable_bytes - est.memory.total) / GiB:.1f} left")
