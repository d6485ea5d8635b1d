"""plan.json as the executor reads it: the one contract with the planner.

Only plain values cross: the model spec, the parallel config, the stage
boundaries as module paths, the TP style per module path, the recompute policy
per layer, the fingerprints of the model and world it was made for, and the
estimate to compare against. No import of the search.

Every field the executor reads is checked here; an error names the file, the
field, the value and what is allowed (``UserError``: one line, exit code 2).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from planner.config import (FRAMEWORKS, PLAN_SCHEMA_VERSION, PRECISIONS, RECOMPUTES, TP_STYLES, ZERO_STAGES,
                            ParallelConfig, Workload)
from planner.errors import UserError, one_of
from planner.model import ModelSpec, read_json
from planner.recompute import canonical     # read, parse, check it is an object; UserError naming the file

SUPPORTED_SCHEMA_VERSIONS = (PLAN_SCHEMA_VERSION,)
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_WORKLOAD_CHOICES = {"precision": PRECISIONS, "framework": FRAMEWORKS, "attention": ("flash", "unfused"),
                     "optimizer": ("adamw",)}


@dataclass(frozen=True, kw_only=True)
class Fingerprints:
    """What the plan was made for (planner/fingerprint.py computes them)."""

    model: str          # 16 hex digits: model_fingerprint(layer graph)
    cluster: str        # 16 hex digits: cluster_fingerprint(cluster); informative only (see executor/integrity.py)
    world_size: int     # processes the plan splits the training over


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What one plan.json asks the executor to run."""

    source: str                           # the file it was read from (for error messages)
    spec: ModelSpec | None                # the architecture of a config model (None: a traced module)
    config: ParallelConfig
    workload: Workload
    stages: tuple[tuple[str, ...], ...]   # module paths per virtual stage; stage j runs on pp rank j % pp
    fingerprints: Fingerprints
    tp_plan: dict[str, str] = field(default_factory=dict)          # module path -> TP style
    recompute_per_layer: dict[str, str] = field(default_factory=dict)   # layer path -> policy
    estimate: dict = field(default_factory=dict)                   # the planner's prediction, as written
    meshplan_version: str | None = None   # the meshplan that wrote the file

    @property
    def world_size(self) -> int:
        return self.config.world_size


def _require(data: dict, key: str, kind: type, source: str, prefix: str = ""):
    if key not in data:
        raise UserError("missing (required)", source=source, field=prefix + key)
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UserError(f"must be a JSON {_json_kind(kind)}, got {value!r}", source=source, field=prefix + key)
    return value


def _json_kind(kind: type) -> str:
    return {dict: "object", list: "array", str: "string", int: "integer", bool: "boolean"}.get(kind, kind.__name__)


def _spec(model: dict, source: str) -> ModelSpec | None:
    raw = model.get("spec")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise UserError(f"must be a JSON object, got {raw!r}", source=source, field="model.spec")
    names = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise UserError(f"unknown field(s) {', '.join(unknown)}; allowed: {one_of(sorted(names))}",
                        source=source, field="model.spec")
    try:
        return ModelSpec(**raw).validate(f"{source}: model.spec")
    except TypeError as e:
        raise UserError(str(e), source=source, field="model.spec") from None


def _workload(raw: dict, source: str) -> Workload:
    names = {f.name for f in fields(Workload)}
    unknown = sorted(set(raw) - names, key=str)
    if unknown:
        raise UserError(f"unknown field(s) {', '.join(map(str, unknown))}; allowed: {one_of(sorted(names))}",
                        source=source, field="workload")
    for name in ("global_batch", "seq_len"):
        value = _require(raw, name, int, source, "workload.")
        if value < 1:
            raise UserError(f"must be a positive integer, got {value!r}", source=source, field=f"workload.{name}")
    for name, allowed in _WORKLOAD_CHOICES.items():
        if name in raw and raw[name] not in allowed:
            raise UserError(f"{raw[name]!r} is not allowed; allowed: {one_of(allowed)}", source=source,
                            field=f"workload.{name}")
    for name in ("overlap_grad_reduce", "tp_comm_overlap"):
        if name in raw and not isinstance(raw[name], bool):
            raise UserError(f"must be true or false, got {raw[name]!r}", source=source, field=f"workload.{name}")
    return Workload(**raw)


def _fingerprints(data: dict, source: str) -> Fingerprints:
    raw = _require(data, "fingerprints", dict, source)
    for name in ("model", "cluster"):
        value = _require(raw, name, str, source, "fingerprints.")
        if not _HEX16.match(value):
            raise UserError(f"{value!r} is not 16 lowercase hex digits (as `meshplan plan` writes)", source=source,
                            field=f"fingerprints.{name}")
    world = _require(raw, "world_size", int, source, "fingerprints.")
    if world < 1:
        raise UserError(f"must be a positive integer, got {world!r}", source=source, field="fingerprints.world_size")
    return Fingerprints(model=raw["model"], cluster=raw["cluster"], world_size=world)


def _config(data: dict, workload: Workload, fingerprints: Fingerprints, source: str) -> ParallelConfig:
    config = ParallelConfig.from_json(_require(data, "config", dict, source), source)
    if config.zero not in ZERO_STAGES:
        raise UserError(f"{config.zero!r} is not a ZeRO stage; allowed: {one_of(ZERO_STAGES)}", source=source,
                        field="config.zero")
    if config.world_size != fingerprints.world_size:
        raise UserError(f"dp x tp x pp x cp = {config.dp} x {config.tp} x {config.pp} x {config.cp} = "
                        f"{config.world_size} but fingerprints.world_size is {fingerprints.world_size}: the file "
                        "was edited; re-create it with `meshplan plan --out`", source=source, field="config")
    per_step = config.dp * config.micro_batch * config.num_microbatches
    if per_step != workload.global_batch:
        raise UserError(f"dp x micro_batch x num_microbatches = {config.dp} x {config.micro_batch} x "
                        f"{config.num_microbatches} = {per_step} but workload.global_batch is "
                        f"{workload.global_batch}; allowed: equal", source=source, field="config.num_microbatches")
    return config


def _stages(data: dict, config: ParallelConfig, source: str) -> tuple[tuple[str, ...], ...]:
    stages = _require(data, "stages", list, source)
    if not all(isinstance(s, list) and all(isinstance(p, str) for p in s) for s in stages):
        raise UserError(f"must be a list of lists of module paths (strings), got {stages!r}", source=source,
                        field="stages")
    if len(stages) != config.pp * config.vpp:
        raise UserError(f"{len(stages)} stages but pp x vpp = {config.pp} x {config.vpp}", source=source,
                        field="stages")
    return tuple(tuple(s) for s in stages)


def _string_map(data: dict, key: str, allowed: tuple[str, ...], source: str, rename=lambda v: v) -> dict[str, str]:
    """An optional {path: choice} object; ``rename`` gives a choice's name now for an earlier one."""
    raw = data.get(key)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"must be a JSON object {{module path: {one_of(allowed)}}}, got {raw!r}", source=source,
                        field=key)
    out = {path: rename(value) for path, value in raw.items()}
    for path, value in out.items():
        if value not in allowed:
            raise UserError(f"{raw[path]!r} for {path!r}; allowed: {one_of(allowed)}", source=source, field=key)
    return out


def _estimate(data: dict, source: str) -> dict:
    raw = data.get("estimate")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"must be a JSON object, got {raw!r}", source=source, field="estimate")
    step = raw.get("step_time_s")
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float)) or step < 0):
        raise UserError(f"must be a non-negative number or null, got {step!r}", source=source,
                        field="estimate.step_time_s")
    stages = raw.get("memory_per_stage_bytes")
    if stages is not None and not (isinstance(stages, list) and all(isinstance(s, dict) for s in stages)):
        raise UserError(f"must be a list of objects (bytes by category) or null, got {stages!r}", source=source,
                        field="estimate.memory_per_stage_bytes")
    return raw


def plan_from_json(data: dict, source: str = "plan.json") -> RunPlan:
    """Check and read a plan.json document; errors name the file and the field."""
    if not isinstance(data, dict):
        raise UserError(f"expected a JSON object, got {type(data).__name__}", source=source)
    version = data.get("schema_version")
    if version not in SUPPORTED_SCHEMA_VERSIONS or isinstance(version, bool):
        raise UserError(f"unsupported schema version {version!r}; this executor reads "
                        f"{one_of(SUPPORTED_SCHEMA_VERSIONS)} (re-create the plan with this meshplan's "
                        "`meshplan plan --out`)", source=source, field="schema_version")
    written_by = data.get("meshplan_version")
    if written_by is not None and not isinstance(written_by, str):
        raise UserError(f"must be a string, got {written_by!r}", source=source, field="meshplan_version")
    model = _require(data, "model", dict, source)
    fingerprints = _fingerprints(data, source)
    workload = _workload(_require(data, "workload", dict, source), source)
    config = _config(data, workload, fingerprints, source)
    return RunPlan(source=source, spec=_spec(model, source), config=config, workload=workload,
                   stages=_stages(data, config, source), fingerprints=fingerprints,
                   tp_plan=_string_map(data, "tp_plan", TP_STYLES, source),
                   recompute_per_layer=_string_map(data, "recompute_per_layer", RECOMPUTES, source, canonical),
                   estimate=_estimate(data, source), meshplan_version=written_by)


def load_plan(path: str | Path) -> RunPlan:
    return plan_from_json(read_json(Path(path)), str(path))


def installed_version() -> str | None:
    """The installed meshplan's version (package metadata), None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("meshplan")
    except PackageNotFoundError:
        return None


def warn_if_other_version(plan: RunPlan, prog: str = "meshplan run") -> None:
    """One line on stderr when another meshplan wrote the plan (the format is versioned by
    schema_version; the cost model and defaults behind the numbers may differ)."""
    mine = installed_version()
    if plan.meshplan_version and mine and plan.meshplan_version != mine:
        sys.stderr.write(f"{prog}: warning: {plan.source}: meshplan_version: written by meshplan "
                         f"{plan.meshplan_version}, this is meshplan {mine}; its estimate may differ from what "
                         "this version predicts (re-plan to compare)\n")
