"""plan.json as the executor reads it: the one contract with the planner.

Only plain values cross: the model spec, the parallel config, the stage
boundaries as module paths, the TP style per module path, the recompute policy
per layer, and the estimate to compare against. No import of the search.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from planner.config import ParallelConfig, Workload
from planner.errors import UserError, one_of
from planner.model import ModelSpec, _read_json     # read, parse, check it is an object; UserError naming the file

SUPPORTED_SCHEMA_VERSIONS = (1,)
TP_STYLES = ("colwise", "rowwise", "vocab", "colwise_loss", "sequence")   # planner/plan.py documents each
RECOMPUTE_POLICIES = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What one plan.json asks the executor to run."""

    source: str                           # the file it was read from (for error messages)
    spec: ModelSpec | None                # the architecture of a config model (None: a traced module)
    config: ParallelConfig
    workload: Workload
    stages: tuple[tuple[str, ...], ...]   # module paths per virtual stage; stage j runs on pp rank j % pp
    tp_plan: dict[str, str] = field(default_factory=dict)          # module path -> TP style
    recompute_per_layer: dict[str, str] = field(default_factory=dict)   # layer path -> policy
    estimate: dict = field(default_factory=dict)                   # the planner's prediction, as written

    @property
    def world_size(self) -> int:
        return self.config.world_size


def _require(data: dict, key: str, kind: type, source: str):
    if key not in data:
        raise UserError("missing (required)", source=source, field=key)
    if not isinstance(data[key], kind):
        raise UserError(f"must be a JSON {kind.__name__}, got {type(data[key]).__name__}", source=source, field=key)
    return data[key]


def _spec(model: dict, source: str) -> ModelSpec | None:
    raw = model.get("spec")
    if raw is None:
        return None
    names = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise UserError(f"unknown field(s) {', '.join(unknown)}; allowed: {one_of(sorted(names))}",
                        source=source, field="model.spec")
    try:
        return ModelSpec(**raw).validate(f"{source}: model.spec")
    except TypeError as e:
        raise UserError(str(e), source=source, field="model.spec") from None


def plan_from_json(data: dict, source: str = "plan.json") -> RunPlan:
    """Check and read a plan.json document; errors name the file and the field."""
    version = data.get("schema_version")
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise UserError(f"unsupported schema version {version!r}; this executor reads "
                        f"{one_of(SUPPORTED_SCHEMA_VERSIONS)}", source=source, field="schema_version")
    config = ParallelConfig.from_json(_require(data, "config", dict, source), source)
    workload_raw = _require(data, "workload", dict, source)
    try:
        workload = Workload(**workload_raw)
    except TypeError as e:
        raise UserError(str(e), source=source, field="workload") from None
    stages = _require(data, "stages", list, source)
    if len(stages) != config.pp * config.vpp:
        raise UserError(f"{len(stages)} stages but pp x vpp = {config.pp} x {config.vpp}", source=source,
                        field="stages")
    tp_plan = data.get("tp_plan") or {}
    for path, style in tp_plan.items():
        if style not in TP_STYLES:
            raise UserError(f"{style!r} for {path!r}; allowed: {one_of(TP_STYLES)}", source=source, field="tp_plan")
    recompute = data.get("recompute_per_layer") or {}
    for layer, policy in recompute.items():
        if policy not in RECOMPUTE_POLICIES:
            raise UserError(f"{policy!r} for {layer!r}; allowed: {one_of(RECOMPUTE_POLICIES)}", source=source,
                            field="recompute_per_layer")
    return RunPlan(source=source, spec=_spec(_require(data, "model", dict, source), source), config=config,
                   workload=workload, stages=tuple(tuple(s) for s in stages), tp_plan=dict(tp_plan),
                   recompute_per_layer=dict(recompute), estimate=data.get("estimate") or {})


def load_plan(path: str | Path) -> RunPlan:
    return plan_from_json(_read_json(Path(path)), str(path))
