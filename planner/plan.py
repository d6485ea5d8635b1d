"""The Plan: the winning config, its estimate, the runners-up; serialised as plan.json.

plan.json is the one contract between the planner and the executor (see
../shared/DESIGN.md): versioned, plain JSON, no objects.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .cluster import Cluster
from .config import ParallelConfig, Workload
from .layers import LayerGraph
from .search.enumerate import Candidate, SearchResult

PLAN_SCHEMA_VERSION = 1


def config_json(config: ParallelConfig) -> dict:
    """The config as the CLI's --json documents it."""
    return {
        "dp": config.dp, "tp": config.tp, "pp": config.pp, "cp": config.cp, "zero": config.zero,
        "micro_batch": config.micro_batch, "num_microbatches": config.num_microbatches, "vpp": config.vpp,
        "schedule": config.schedule, "recompute": config.recompute, "sequence_parallel": config.sequence_parallel,
        "offload": config.offload,
        **({"recompute_layers": list(config.recompute_layers)} if config.recompute_layers else {}),
        **({"stage_layers": list(config.stage_layers)} if config.stage_layers else {}),
    }


@dataclass(frozen=True, kw_only=True)
class Plan:
    model_name: str
    model_params: int
    graph: LayerGraph
    cluster: Cluster
    workload: Workload
    best: Candidate
    alternatives: tuple[Candidate, ...]
    search_seconds: float
    candidates: int
    evaluated: int

    @classmethod
    def from_search(cls, result: SearchResult, *, model_name: str, graph: LayerGraph, cluster: Cluster,
                    workload: Workload, seconds: float | None = None) -> "Plan":
        assert result.best is not None
        return cls(model_name=model_name, model_params=graph.num_params, graph=graph, cluster=cluster,
                   workload=workload, best=result.best, alternatives=result.alternatives,
                   search_seconds=result.seconds if seconds is None else seconds, candidates=result.candidates,
                   evaluated=result.evaluated)

    def stage_modules(self) -> list[list[str]]:
        """Module paths of each virtual stage, in order (what the executor splits on)."""
        from .cost.step import assign_layers
        placement = assign_layers(self.graph, self.best.config)
        stages = []
        for chunk in range(self.best.config.vpp):
            for rank in range(self.best.config.pp):
                stages.append([self.graph.layers[i].name for i in placement[rank][chunk]])
        return stages

    def to_json(self) -> dict:
        """The document `meshplan plan --json` prints and `--out` writes."""
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "model": {"name": self.model_name, "params": int(self.model_params)},
            "cluster": {"name": self.cluster.name, "gpus": self.cluster.num_gpus,
                        "gpus_per_node": self.cluster.gpus_per_node},
            "workload": asdict(self.workload),
            "config": config_json(self.best.config),
            "estimate": self.best.estimate.to_json(),
            "stages": self.stage_modules(),
            "alternatives": [{"config": config_json(c.config), "estimate": c.estimate.to_json()}
                             for c in self.alternatives],
            "search": {"seconds": self.search_seconds, "candidates": self.candidates, "evaluated": self.evaluated},
        }

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")
