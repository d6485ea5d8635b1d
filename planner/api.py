"""The planner as a library call: a layer graph in, a plan.json document out.

This is how ``executor.auto_parallelize`` plans a live job without importing the
search itself: the contract between planner and executor stays the plan.json
document (a plain dict), exactly what ``meshplan plan --out`` writes.
"""
from __future__ import annotations

from .cluster import Cluster, load_cluster
from .config import Workload
from .errors import NoFeasiblePlan
from .layers import LayerGraph
from .plan import Plan
from .search import Knobs, default_solver, search


def plan_json(graph: LayerGraph, cluster: Cluster | str, workload: Workload, *, gpus: int | None = None,
              knobs: Knobs | None = None, solver: str | None = None, model_source: str = "module") -> dict:
    """The fastest plan that fits, as the plan.json document.

    ``cluster`` is a Cluster or a profile name / TOML path (then ``gpus`` says how many).
    Raises NoFeasiblePlan (with the least memory any candidate needs) when nothing fits.
    """
    if isinstance(cluster, str):
        cluster = load_cluster(cluster, gpus)
    elif gpus is not None and gpus != cluster.num_gpus:
        cluster = cluster.with_gpus(gpus)
    solver = solver or default_solver()
    result = search(graph, cluster, workload, knobs or Knobs(), top_k=1, solver=solver)
    if result.best is None:
        need = result.least_memory.estimate.memory.total / 2**30 if result.least_memory else float("nan")
        raise NoFeasiblePlan(f"no plan fits: the least memory any candidate needs is {need:.2f} GiB per device "
                             f"against {cluster.device.memory_bytes / 2**30:.2f} GiB")
    plan = Plan.from_search(result, model_name=graph.name, model_source=model_source, spec=None, graph=graph,
                            cluster=cluster, workload=workload, solver=solver)
    return plan.to_json()
