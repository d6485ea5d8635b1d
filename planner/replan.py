"""The same job on another number of GPUs: what `meshplan run --elastic` asks when nodes leave or join.

A plan.json says what it was planned from: the model (``model.source``), the cluster profile
(``cluster.source``, else its name), the workload (global batch, sequence length, precision, runtime and
the rest of ``workload``) and the knobs the user fixed (``knobs``). ``replan`` plans that job again for
``gpus`` GPUs through the library's front door (``api.plan``, the search `meshplan plan --gpus N` runs,
with the same knobs), so its answer is the search's. A fixed knob the new count cannot hold (a degree
that does not divide it, a micro-batch its data-parallel degree cannot split the batch into: the
search's own checks, planner/search/space.py, say which) is searched instead, with a note naming the
knob and why. ``fewest_gpus`` counts up from a number of GPUs to the fewest the same job and knobs fit on.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .errors import NoFeasiblePlan, UserError, one_of
from .plan import Plan

# the degrees a count must hold together ("--dp/--tp/--pp/--cp"): dp is searched first, then cp, pp, tp
_DEGREES = ("dp", "cp", "pp", "tp")


@dataclass(frozen=True, kw_only=True)
class Replanned:
    """The plan for the new count, and each fixed knob that was searched instead (why, in a sentence)."""

    plan: Plan
    dropped: tuple[str, ...] = ()


def inputs_of(plan: Plan, gpus: int, model: str | None = None):
    """The ``api.JobInputs`` of ``plan``'s job on ``gpus`` GPUs (``model``: where the model is now, default the
    plan's ``model.source``)."""
    from .api import JobInputs
    w = plan.workload
    return JobInputs(model=model or plan.model_source, cluster=plan.cluster_source or plan.cluster_name, gpus=gpus,
                     global_batch=w.global_batch, seq_len=w.seq_len, precision=w.precision_name,
                     framework=w.framework, attention=w.attention, overlap_grad_reduce=w.overlap_grad_reduce,
                     tp_comm_overlap=w.tp_comm_overlap, ep_comm_overlap=w.ep_comm_overlap,
                     memory_headroom=w.memory_headroom,
                     expert_imbalance=w.expert_imbalance, expert_dispatcher=w.expert_dispatcher, compile=w.compile,
                     fp8_param_gather=w.fp8_param_gather, grad_reduce_in_bf16=w.grad_reduce_in_bf16,
                     finetune=w.finetune, lora_rank=w.lora_rank or None, lora_targets=w.lora_targets or None)


def knobs_of(plan: Plan):
    """The ``Knobs`` plan.json's ``knobs`` fixed (none where the file does not record them)."""
    from .api import Knobs
    names = [f.name for f in fields(Knobs)]
    unknown = sorted(set(plan.knobs or {}) - set(names))
    if unknown:
        raise UserError(f"unknown knob(s) {', '.join(unknown)}; allowed: {one_of(names)}", source=plan.source,
                        field="knobs")
    return Knobs(**(plan.knobs or {}))


def _held_back(field: str | None, knobs) -> str | None:
    """The fixed knob a search error's flag (``UserError.field``) names, None when it names none."""
    if field == "--dp/--tp/--pp/--cp":
        return next((name for name in _DEGREES if getattr(knobs, name) is not None), None)
    name = (field or "").removeprefix("--").replace("-", "_")
    return name if name in {f.name for f in fields(knobs)} and getattr(knobs, name) is not None else None


def plan_knobs(inputs, knobs, plan_one) -> Replanned:
    """``plan_one(inputs, knobs)``, each fixed knob the search refuses for ``inputs``' count searched instead;
    a plan that does not fit raises NoFeasiblePlan (a fully fixed config is estimated, not searched: api.plan)."""
    dropped: list[str] = []
    while True:
        try:
            found = plan_one(inputs, knobs)
        except NoFeasiblePlan:
            raise
        except UserError as e:
            name = _held_back(e.field, knobs)
            if name is None:
                raise
            dropped.append(f"--{name.replace('_', '-')} {getattr(knobs, name)} searched instead: {e.detail}")
            knobs = replace(knobs, **{name: None})
            continue
        e = found.best.estimate
        if not e.fits:          # every knob fixed: estimated, not searched
            from .cluster import GiB
            from .describe import short_config
            raise NoFeasiblePlan(f"its fixed knobs ({short_config(found.best.config)}) need {e.memory.total / GiB:.3g} "
                                 f"GiB per GPU against {e.usable_bytes / GiB:.3g} GiB usable")
        return Replanned(plan=found, dropped=tuple(dropped))


def replan(plan: Plan, gpus: int, *, model: str | None = None) -> Replanned:
    """``plan``'s job planned again for ``gpus`` GPUs with its fixed knobs (those the count cannot hold
    searched instead). Raises NoFeasiblePlan when nothing fits, UserError when the job cannot be loaded."""
    from . import api
    return plan_knobs(inputs_of(plan, gpus, model), knobs_of(plan), lambda at, fixed: api.plan(at.load(), fixed))


def fewest_gpus(plan: Plan, *, above: int, model: str | None = None) -> int | None:
    """The fewest GPUs of ``plan``'s cluster profile, more than ``above`` and at most the plan's own, on which its
    job fits with its knobs (each count planned as ``replan`` plans it): one node's 1, 2, 4, ... GPUs, then whole
    nodes (planner/fitmin.py ``counts``), in order; None when none does. Counting up from the GPUs there are keeps
    it to the few searches between them and the plan's world, which rank 0 of a stopping job runs while the
    others wait."""
    from . import api
    from .cluster import load_cluster
    from .fitmin import counts
    node = load_cluster(plan.cluster_source or plan.cluster_name, None).gpus_per_node
    tried = sorted({*counts(node), *range(node, plan.world_size + 1, node)})
    knobs = knobs_of(plan)
    for gpus in (n for n in tried if above < n <= plan.world_size):
        try:
            plan_knobs(inputs_of(plan, gpus, model), knobs, lambda at, fixed: api.plan(at.load(), fixed, top_k=1))
        except UserError:           # does not fit, or this count cannot run the job (NoFeasiblePlan among them)
            continue
        return gpus
    return None
