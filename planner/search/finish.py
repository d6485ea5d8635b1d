"""The search's last step: a whole Plan from its result.

Everything plan.json holds beyond the winner's config and estimate is computed here, once: the
tensor-parallel sharding of each distinct block (the sharding ILP, tp_ilp.py), the module paths of
each stage, each layer's recompute policy, the closed form's step time, what each runner-up lost
on, what limits the winner and what its per-stage choices bought (planner/explain.py), and the
validation that covers its numbers (planner/accuracy.py). Serialising the Plan computes nothing.
"""
from __future__ import annotations

from ..accuracy import accuracy
from ..cluster import Cluster, profile_source
from ..config import ParallelConfig, Workload
from ..cost.step import estimate
from ..energy import energy
from ..explain import gains, limits, lost_on
from ..fingerprint import cluster_fingerprint, model_fingerprint
from ..layers import LayerGraph
from ..model import ModelSpec
from ..placement import recompute_per_layer, stage_modules
from ..plan import Alternative, Fingerprints, Plan, SearchStats
from ..runtimes import RUNTIMES
from .result import Choice, SearchResult, mechanisms, memory_left
from .tp_dataflow import block_graph
from .tp_ilp import Context, solve_sharding


def finish(result: SearchResult, *, graph: LayerGraph, cluster: Cluster, workload: Workload, model_name: str,
           model_source: str, spec: ModelSpec | None, solver: str, seconds: float | None = None,
           knobs: dict | None = None) -> Plan:
    """The Plan of ``result``'s winner (which must exist), its runners-up and their explanations; ``knobs``: those
    the user fixed (``Knobs.fixed()``), kept in plan.json so the job can be planned again on other GPUs."""
    if result.best is None:
        raise ValueError("finish needs a result with a winner")
    checked = accuracy(cluster, workload, moe=graph.num_experts > 0)
    best = result.best
    config = best.config
    shardings = block_shardings(graph, config, cluster, workload)
    closed_form = estimate(graph, cluster, workload, config)
    return Plan(
        model_name=model_name, model_params=graph.num_params, model_source=model_source, spec=spec,
        cluster_name=cluster.name, gpus_per_node=cluster.gpus_per_node, cluster_source=profile_source(cluster),
        knobs=knobs, fingerprints=Fingerprints(model=model_fingerprint(graph), cluster=cluster_fingerprint(cluster),
                                  world_size=cluster.num_gpus),
        workload=workload, best=best, closed_form_step_time_s=closed_form.step_time_s,
        stages=tuple(tuple(s) for s in stage_modules(graph, config)),
        tp_plan=tp_plan(graph, config, shardings),
        tp_sharding={layer.name: {"boundary": sh.boundary, "strategies": sh.strategies}
                     for layer, sh in shardings.values()},
        recompute_per_layer=recompute_per_layer(graph, config),
        alternatives=tuple(Alternative(config=c.config, estimate=c.estimate, lost_on=lost_on(best.estimate, c.estimate))
                           for c in result.alternatives),
        choice=choice_json(result.choice, best) if result.choice else {},
        limits=limits(config, best.estimate, cluster), accuracy=checked.to_json(),
        energy=_energy_json(best.estimate, cluster, workload),
        # closed form against closed form: the balanced and fully recomputed variants are priced that way
        gains=gains(graph, cluster, workload, config, closed_form),
        search=SearchStats(seconds=result.seconds if seconds is None else seconds, candidates=result.candidates,
                           evaluated=result.evaluated, solver=solver, global_choices=result.groups,
                           ilp_solves=result.ilp_solves, ilp_unproven=result.ilp_unproven),
        graph=graph, cluster=cluster)


def _energy_json(est, cluster: Cluster, workload: Workload) -> dict:
    found = energy(est, cluster, workload)
    return found.to_json() if found else {}


def choice_json(choice: Choice, chosen) -> dict:
    """plan.json's ``choice``: the rule that chose, the band, how many plans it held, the fastest by the
    model and the mechanisms each rests on."""
    out = choice.to_json()
    out["fastest"]["mechanisms"] = list(mechanisms(choice.fastest.config))
    out["fastest"]["memory_left_bytes"] = int(memory_left(choice.fastest))
    out["chosen"] = {"mechanisms": list(mechanisms(chosen.config)), "memory_left_bytes": int(memory_left(chosen)),
                     "step_time_s": chosen.estimate.step_time_s}
    out["within_band_step_times_s"] = [c.estimate.step_time_s for c in choice.within]
    return out


def block_shardings(graph: LayerGraph, config: ParallelConfig, cluster: Cluster, workload: Workload) -> dict:
    """The TP sharding ILP's choice for each distinct block signature (solved once each):
    {signature: (the layer it was solved for, its Sharding)}."""
    if config.tp == 1:
        return {}
    ctx = Context(tp=config.tp, tokens=config.micro_batch * workload.seq_len / config.cp,
                  micro_batch=config.micro_batch, seq_len=workload.seq_len // config.cp,
                  precision=workload.precision, attention=workload.attention,
                  sequence_parallel=config.sequence_parallel,
                  attention_kernel=RUNTIMES[workload.framework].attention_kernel)
    out = {}
    for layer in graph.layers:
        if layer.is_block and layer.signature not in out:
            try:
                dataflow = block_graph(layer, graph.hidden)
            except (AttributeError, TypeError):
                continue        # not the analytical block's shape: its ops keep the roles they were given
            out[layer.signature] = (layer, solve_sharding(dataflow, ctx, cluster))
    return out


def tp_plan(graph: LayerGraph, config: ParallelConfig, shardings: dict | None = None) -> dict[str, str]:
    """Module path -> TP style for every module that holds parameters (empty without TP): blocks as
    their sharding ILP chose (a linear its dataflow graph does not hold, as a mixture of experts' shared experts
    and router: its own role, as the cost model prices it), the embedding vocabulary-parallel, the head
    column-parallel with a vocabulary-parallel loss."""
    if config.tp == 1:
        return {}
    styles = {"column": "colwise", "row": "rowwise", "sequence": "sequence"}
    plan = {}
    for layer in graph.layers:
        if layer.is_block and shardings and layer.signature in shardings:
            model, sharding = shardings[layer.signature]
            for op, ref in zip(layer.ops, model.ops):
                own = op.tp if op.kind == "linear" else "replicate"
                style = styles.get(sharding.strategies.get(ref.name, own))
                if style and (op.params or style != "sequence"):
                    plan[op.name] = style
            continue
        for op in layer.ops:
            if op.kind == "embedding":
                plan[op.name] = "vocab"
            elif op.kind == "linear" and op.tp != "replicate":
                plan[op.name] = ("colwise_loss" if layer.kind == "head" else
                                 "colwise" if op.tp == "column" else "rowwise")
            elif config.sequence_parallel and op.norm:
                plan[op.name] = "sequence"
    return plan
