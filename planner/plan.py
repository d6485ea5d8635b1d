"""The Plan: the winning config, its estimate, the runners-up; serialised as plan.json.

plan.json is the one contract between the planner and the executor (see
../shared/DESIGN.md): versioned, plain JSON, no objects.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .cluster import Cluster
from .explain import gains, limits, lost_on
from .fingerprint import cluster_fingerprint, model_fingerprint
from .config import PLAN_SCHEMA_VERSION, TP_STYLES, ParallelConfig, Workload  # noqa: F401  (TP_STYLES re-exported)
from .layers import LayerGraph
from .model import ModelSpec
from .estimate import Candidate
from .search.result import SearchResult

MESHPLAN_VERSION = "0.1.0"


def block_shardings(graph: LayerGraph, config: ParallelConfig, cluster: Cluster, workload: Workload) -> dict:
    """The TP sharding ILP's choice for each distinct block signature (solved once each)."""
    from .opgraph import block_graph
    from .search.tp_ilp import Context, solve_sharding

    if config.tp == 1:
        return {}
    ctx = Context(tp=config.tp, tokens=config.micro_batch * workload.seq_len / config.cp,
                  micro_batch=config.micro_batch, seq_len=workload.seq_len // config.cp,
                  precision=workload.precision, attention=workload.attention,
                  sequence_parallel=config.sequence_parallel)
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
    """Module path -> TP style for every module that holds parameters (empty without TP):
    blocks as their sharding ILP chose, the embedding vocabulary-parallel, the head
    column-parallel with a vocabulary-parallel loss."""
    if config.tp == 1:
        return {}
    styles = {"column": "colwise", "row": "rowwise", "sequence": "sequence"}
    plan = {}
    for layer in graph.layers:
        if layer.is_block and shardings and layer.signature in shardings:
            model, sharding = shardings[layer.signature]
            for op, ref in zip(layer.ops, model.ops):
                style = styles.get(sharding.strategies.get(ref.name, "replicate"))
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


def config_json(config: ParallelConfig) -> dict:
    """The config as the CLI's --json documents it."""
    return {
        "dp": config.dp, "tp": config.tp, "pp": config.pp, "cp": config.cp, "zero": config.zero,
        "micro_batch": config.micro_batch, "num_microbatches": config.num_microbatches, "vpp": config.vpp,
        "schedule": config.schedule, "recompute": config.recompute, "sequence_parallel": config.sequence_parallel,
        "optimizer_offload": config.optimizer_offload,
        **({"recompute_layers": list(config.recompute_layers)} if config.recompute_layers else {}),
        **({"stage_layers": list(config.stage_layers)} if config.stage_layers else {}),
    }


@dataclass(frozen=True, kw_only=True)
class Plan:
    model_name: str
    model_params: int
    model_source: str                 # what --model was: a zoo name, a config.json path, file.py:factory
    spec: ModelSpec | None            # the architecture of a config model (None for traced modules)
    graph: LayerGraph
    cluster: Cluster
    workload: Workload
    best: Candidate
    alternatives: tuple[Candidate, ...]
    search_seconds: float
    candidates: int
    evaluated: int
    solver: str = "cbc"
    groups: int = 0
    ilp_solves: int = 0

    @classmethod
    def from_search(cls, result: SearchResult, *, model_name: str, model_source: str, spec: ModelSpec | None,
                    graph: LayerGraph, cluster: Cluster, workload: Workload,
                    seconds: float | None = None, solver: str = "cbc") -> "Plan":
        assert result.best is not None
        return cls(model_name=model_name, model_params=graph.num_params, model_source=model_source, spec=spec,
                   graph=graph, cluster=cluster,
                   workload=workload, best=result.best, alternatives=result.alternatives,
                   search_seconds=result.seconds if seconds is None else seconds, candidates=result.candidates,
                   evaluated=result.evaluated, solver=solver, groups=result.groups, ilp_solves=result.ilp_solves)

    def stage_modules(self) -> list[list[str]]:
        """Module paths of each virtual stage, in order (what the executor splits on)."""
        from .cost.step import assign_layers
        placement = assign_layers(self.graph, self.best.config)
        stages = []
        for chunk in range(self.best.config.vpp):
            for rank in range(self.best.config.pp):
                stages.append([self.graph.layers[i].name for i in placement[rank][chunk]])
        return stages

    def recompute_per_layer(self) -> dict[str, str]:
        from .cost.step import layer_policies
        return {layer.name: policy for layer, policy in zip(self.graph.layers, layer_policies(self.graph, self.best.config))}

    def to_json(self) -> dict:
        """The document `meshplan plan --json` prints and `--out` writes."""
        shardings = block_shardings(self.graph, self.best.config, self.cluster, self.workload)
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "meshplan_version": MESHPLAN_VERSION,
            "model": {"name": self.model_name, "params": int(self.model_params), "source": self.model_source,
                      **({"spec": asdict(self.spec)} if self.spec else {})},
            "cluster": {"name": self.cluster.name, "gpus": self.cluster.num_gpus,
                        "gpus_per_node": self.cluster.gpus_per_node},
            "fingerprints": {"model": model_fingerprint(self.graph), "cluster": cluster_fingerprint(self.cluster),
                             "world_size": self.cluster.num_gpus},
            "workload": asdict(self.workload),
            "config": config_json(self.best.config),
            "estimate": self.best.estimate.to_json(),
            "closed_form_step_time_s": self._closed_form_step_s(),
            "stages": self.stage_modules(),
            "tp_plan": tp_plan(self.graph, self.best.config, shardings),
            "tp_sharding": {model.name: {"boundary": sh.boundary, "strategies": sh.strategies}
                            for model, sh in shardings.values()},
            "recompute_per_layer": self.recompute_per_layer(),
            "alternatives": [{"config": config_json(c.config), "estimate": c.estimate.to_json(),
                              "lost_on": lost_on(self.best.estimate, c.estimate)} for c in self.alternatives],
            "limits": limits(self.best.config, self.best.estimate, self.cluster),
            "accuracy": self.accuracy().to_json(),
            "gains": gains(self.graph, self.cluster, self.workload, self.best.config, self.best.estimate),
            "search": {"seconds": self.search_seconds, "candidates": self.candidates, "evaluated": self.evaluated,
                       "solver": self.solver, "global_choices": self.groups, "ilp_solves": self.ilp_solves},
        }

    def accuracy(self):
        """The validation that covers this plan's numbers and how far off it was (planner/accuracy.py)."""
        from .accuracy import accuracy
        return accuracy(self.cluster, self.workload)

    def _closed_form_step_s(self) -> float:
        """The analytical step time of the winner (``estimate`` holds the simulated one when
        the search ranked its finalists by simulation)."""
        from .cost.step import estimate
        return estimate(self.graph, self.cluster, self.workload, self.best.config).step_time_s

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")
