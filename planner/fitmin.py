"""The smallest machine: the fewest GPUs of a cluster profile on which a job fits (`meshplan plan --fit-min`).

GPU counts are tried in increasing order: within one node 1, 2, 4, ... up to the node, then whole nodes, their
number doubling until a plan fits and then every count between the last two doublings, so the answer is the
fewest GPUs among one node's powers of two and every whole number of nodes (a count of GPUs that the global
batch cannot split, or that the fixed knobs do not divide, does not fit). Each count is planned in full
(``api.plan``, the best plan only); the answer gives that plan, its step time and the host memory per node it
needs (optimizer or parameter offload), and with ``--nvme-offload on`` the NVMe per node, against the profile's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .errors import NoFeasiblePlan, UserError

# what a GPU count can make impossible: the degrees, the batch's split, and knobs that must divide the GPUs
_COUNT_FIELDS = ("--gpus", "--dp", "--tp", "--pp", "--cp", "--ep", "--dp/--tp/--pp/--cp", "--global-batch",
                 "--micro-batch", "--vpp", "--schedule")


@dataclass(frozen=True)
class FitMin:
    """The fewest GPUs that fit: the plan there (None where none up to the limit fits) and every count tried."""

    gpus_per_node: int
    plan: object | None                  # planner.plan.Plan
    tried: tuple[tuple[int, str], ...]   # (GPUs, "fits" / "does not fit" / why the count cannot run)
    limit: int

    @property
    def gpus(self) -> int | None:
        return self.plan.world_size if self.plan is not None else None

    def to_json(self) -> dict:
        out = {"gpus": self.gpus, "gpus_per_node": self.gpus_per_node, "limit": self.limit,
               "tried": [{"gpus": n, "result": r} for n, r in self.tried]}
        if self.plan is not None:
            e = self.plan.best.estimate
            out.update(config=self.plan.best.config.to_json(), step_time_s=e.step_time_s,
                       memory_bytes=e.memory.total, capacity_bytes=e.capacity_bytes,
                       host_bytes_per_node=e.host_bytes_per_node, host_capacity_bytes=e.host_capacity_bytes,
                       **({"nvme_bytes_per_node": e.nvme_bytes_per_node, "nvme_capacity_bytes": e.nvme_capacity_bytes}
                          if e.nvme_bytes_per_node else {}))
        return out


def counts(gpus_per_node: int) -> list[int]:
    """One node's powers of two below the node, then the node."""
    out, n = [], 1
    while n < gpus_per_node:
        out.append(n)
        n *= 2
    return out + [gpus_per_node]


def fit_min(inputs, knobs, *, limit: int = 65536, plan_one: Callable | None = None,
            progress: Callable[[int, str], None] | None = None) -> FitMin:
    """``FitMin`` of ``inputs`` (``api.JobInputs`` whose ``gpus`` is ignored) with ``knobs`` fixed. ``plan_one``:
    (JobInputs, Knobs) -> Plan, raising NoFeasiblePlan where nothing fits (default: ``api.plan``, best plan only)."""
    from . import api
    from .cluster import load_cluster
    if plan_one is None:
        def plan_one(at, fixed):
            return api.plan(at.load(), fixed, top_k=1)
    node = load_cluster(inputs.cluster, None).gpus_per_node
    if inputs.global_batch is None:         # the job's batch must not change with the count: one node's default
        job = replace(inputs, gpus=None).load()
        inputs = replace(inputs, global_batch=job.workload.global_batch)
    tried: list[tuple[int, str]] = []

    def attempt(n: int):
        found = None
        try:
            found = plan_one(replace(inputs, gpus=n), knobs)
        except NoFeasiblePlan:
            result = "does not fit"
        except UserError as e:
            if e.field not in _COUNT_FIELDS:
                raise
            result = f"cannot run ({e.field}: {e.detail})"
        else:
            result = "fits" if found.best.estimate.fits else "does not fit"
        tried.append((n, result))
        if progress:
            progress(n, result)
        return found if result == "fits" else None

    for n in counts(node):
        if n > limit:
            break
        found = attempt(n)
        if found is not None:
            return FitMin(gpus_per_node=node, plan=found, tried=tuple(tried), limit=limit)
    low, nodes = 1, 2                      # one node does not fit: double the nodes, then fill in between
    while nodes * node <= limit:
        found = attempt(nodes * node)
        if found is not None:
            for between in range(low + 1, nodes):
                smaller = attempt(between * node)
                if smaller is not None:
                    return FitMin(gpus_per_node=node, plan=smaller, tried=tuple(tried), limit=limit)
            return FitMin(gpus_per_node=node, plan=found, tried=tuple(tried), limit=limit)
        low, nodes = nodes, nodes * 2
    return FitMin(gpus_per_node=node, plan=None, tried=tuple(tried), limit=limit)
