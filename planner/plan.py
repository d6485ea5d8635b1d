"""The Plan: the winning config, its estimate, the runners-up and why they lost; plan.json.

plan.json is the one contract between the planner and the executor (see ../shared/DESIGN.md):
versioned, plain JSON, no objects. A Plan is whole when the search makes it
(planner/search/finish.py): the TP sharding, the stage boundaries, the explanation and the error
band are computed once, there. ``to_json`` only writes the fields; ``from_json`` is the one reader
(the executor's and ``meshplan compare``'s), and checks every field, naming the file and the field.
"""
from __future__ import annotations

import json
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from .cluster import Cluster
from .config import FRAMEWORKS, PRECISIONS, TP_STYLES, ZERO_STAGES, ParallelConfig, Workload
from . import finetune as finetune_modes
from .errors import UserError, one_of
from .estimate import Candidate, Estimate
from .layers import LayerGraph
from .model import ModelSpec
from .precision import RECIPES
from .recompute import POLICIES, canonical

MESHPLAN_VERSION = "0.1.0"
PLAN_SCHEMA_VERSION = 2     # 2: config.optimizer_offload (1 said "offload": "none" | "optimizer")
READS_SCHEMA_VERSIONS = (1, 2)
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_WORKLOAD_CHOICES = {"precision": PRECISIONS, "framework": FRAMEWORKS, "attention": ("flash", "unfused"),
                     "optimizer": ("adamw",), "expert_dispatcher": ("alltoall", "allgather", "flex"),
                     "fp8": ("", *RECIPES)}


@dataclass(frozen=True, kw_only=True)
class Fingerprints:
    """What the plan was made for (planner/fingerprint.py computes them)."""

    model: str          # 16 hex digits: model_fingerprint(layer graph)
    cluster: str        # 16 hex digits: cluster_fingerprint(cluster); informative (executor/integrity.py)
    world_size: int     # processes the plan splits the training over


@dataclass(frozen=True, kw_only=True)
class Alternative(Candidate):
    """A runner-up: the best plan of another layout, and what it lost on against the winner."""

    lost_on: str


@dataclass(frozen=True, kw_only=True)
class SearchStats:
    """How much of the space the search covered and how."""

    seconds: float
    candidates: int                 # legal configurations covered (estimated or bounded out exactly)
    evaluated: int                  # estimated in full
    solver: str                     # the stage ILPs' solver, "exhaustive" or "uniform"
    global_choices: int = 0         # groups of global choices the stage search looked at
    ilp_solves: int = 0             # stage ILPs run (the others were bounded out)
    ilp_unproven: int = 0           # of which stopped at their time limit (--time-limit): the plan is the best
                                    # found, not proven the cost model's best

    def line(self) -> str:
        """What the search covered, in one line (`meshplan plan`'s last, the report's)."""
        out = (f"{self.candidates:.3g} candidates ({self.global_choices:,} global choices, {self.ilp_solves} stage "
               f"ILPs, {self.evaluated:,} estimated in full) in {self.seconds:.2f} s")
        if self.ilp_unproven:
            out += (f"; {self.ilp_unproven} stage ILP(s) stopped at the time limit, the best plans of their groups "
                    "not proven found (raise --time-limit)")
        return out


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything plan.json holds, and (for a plan the search just made) what it was made from."""

    model_name: str
    model_params: int
    model_source: str                 # what --model was: a zoo name, a config.json path, file.py:factory
    spec: ModelSpec | None            # the architecture of a config model (None for traced modules)
    cluster_name: str
    gpus_per_node: int
    fingerprints: Fingerprints
    workload: Workload
    best: Candidate
    closed_form_step_time_s: float    # the closed form's step (``best.estimate`` holds the simulated one)
    stages: tuple[tuple[str, ...], ...]     # module paths per virtual stage, in order (placement.rank_stages: where)
    tp_plan: dict[str, str]           # module path -> TP style (planner/config.py TP_STYLES)
    tp_sharding: dict[str, dict]      # block signature's layer -> the TP sharding ILP's choice
    recompute_per_layer: dict[str, str]     # layer path -> recompute policy
    alternatives: tuple[Alternative, ...] = ()
    choice: dict = field(default_factory=dict)      # how it was chosen among near-ties (search/finish.py)
    energy: dict = field(default_factory=dict)      # its power and energy (planner/energy.py; {}: no [power])
    limits: str = ""                  # what binds the winner (planner/explain.py)
    accuracy: dict = field(default_factory=dict)    # the validation that covers it (planner/accuracy.py)
    gains: dict = field(default_factory=dict)       # what the per-stage choices bought (planner/explain.py)
    precisions: dict = field(default_factory=dict)  # --precision left out: each precision tried, its best step in
                                                    # seconds (None: nothing fits) and why the winner won (api.py)
    search: SearchStats
    knobs: dict | None = None         # the knobs the user fixed ({flag's field: value}, planner.search.Knobs's
                                      # fields; {}: none, all searched); None: not recorded (a plan.json written
                                      # before they were). Re-planning the same job on other GPUs reads them
    cluster_source: str = ""          # what --cluster was, to load it again: a built-in name or a TOML's path
    meshplan_version: str = MESHPLAN_VERSION
    source: str = ""                  # the file it was read from ("" when the search made it)
    graph: LayerGraph | None = None   # what it was planned from; a plan read from plan.json has neither
    cluster: Cluster | None = None

    @property
    def config(self) -> ParallelConfig:
        return self.best.config

    @property
    def estimate(self) -> Estimate:
        return self.best.estimate

    @property
    def world_size(self) -> int:
        return self.fingerprints.world_size

    # -- plan.json ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """The document `meshplan plan --json` prints and `--out` writes: the fields, nothing computed."""
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "meshplan_version": self.meshplan_version,
            "model": {"name": self.model_name, "params": int(self.model_params), "source": self.model_source,
                      **({"spec": spec_json(self.spec)} if self.spec else {})},
            "cluster": {"name": self.cluster_name, "gpus": self.world_size, "gpus_per_node": self.gpus_per_node,
                        **({"source": self.cluster_source} if self.cluster_source else {})},
            "fingerprints": asdict(self.fingerprints),
            **({"knobs": dict(self.knobs)} if self.knobs is not None else {}),
            "workload": {k: v for k, v in asdict(self.workload).items()      # the expert settings said only
                         if (k, v) not in (("expert_imbalance", 1.0), ("expert_dispatcher", "alltoall"),
                                           ("ep_comm_overlap", False),
                                           ("compile", False), ("fp8", ""), ("fp8_param_gather", False),
                                           ("grad_reduce_in_bf16", False), ("finetune", "full"),
                                           ("lora_rank", 0), ("lora_targets", ()))},  # off default
            "config": self.config.to_json(),
            "estimate": self.estimate.to_json(),
            "closed_form_step_time_s": self.closed_form_step_time_s,
            "stages": [list(s) for s in self.stages],
            "tp_plan": dict(self.tp_plan),
            "tp_sharding": dict(self.tp_sharding),
            "recompute_per_layer": dict(self.recompute_per_layer),
            "alternatives": [{"config": a.config.to_json(), "estimate": a.estimate.to_json(), "lost_on": a.lost_on}
                             for a in self.alternatives],
            "choice": self.choice,
            "energy": self.energy,
            "limits": self.limits,
            "accuracy": self.accuracy,
            "gains": self.gains,
            **({"precisions": self.precisions} if self.precisions else {}),
            "search": {"seconds": self.search.seconds, "candidates": self.search.candidates,
                       "evaluated": self.search.evaluated, "solver": self.search.solver,
                       "global_choices": self.search.global_choices, "ilp_solves": self.search.ilp_solves,
                       **({"ilp_unproven": self.search.ilp_unproven} if self.search.ilp_unproven else {})},
        }

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: dict, source: str = "plan.json") -> "Plan":
        """Check and read a plan.json document; errors name the file and the field (one line, exit code 2).
        Reads schema versions 1 and 2 (``READS_SCHEMA_VERSIONS``) and a recompute policy's earlier names."""
        if not isinstance(data, dict):
            raise UserError(f"expected a JSON object, got {type(data).__name__}", source=source)
        version = data.get("schema_version")
        if version not in READS_SCHEMA_VERSIONS or isinstance(version, bool):
            raise UserError(f"unsupported schema version {version!r}; this meshplan reads "
                            f"{one_of(READS_SCHEMA_VERSIONS)} (re-create the plan with this meshplan's "
                            "`meshplan plan --out`)", source=source, field="schema_version")
        written_by = data.get("meshplan_version")
        if written_by is not None and not isinstance(written_by, str):
            raise UserError(f"must be a string, got {written_by!r}", source=source, field="meshplan_version")
        model = _require(data, "model", dict, source)
        fingerprints = _fingerprints(data, source)
        workload = _workload(_require(data, "workload", dict, source), source)
        config = _config(data, workload, fingerprints, source)
        cluster = data.get("cluster") if isinstance(data.get("cluster"), dict) else {}
        search = data.get("search") if isinstance(data.get("search"), dict) else {}
        estimate = Estimate.from_json(data.get("estimate"), source)
        return cls(
            model_name=str(model.get("name", "")), model_params=_int(model.get("params", 0)),
            model_source=str(model.get("source", "")), spec=_spec(model, source),
            cluster_name=str(cluster.get("name", "")), gpus_per_node=_int(cluster.get("gpus_per_node", 0)),
            cluster_source=str(cluster.get("source", "")), knobs=_fixed_knobs(data, source),
            fingerprints=fingerprints, workload=workload, best=Candidate(config=config, estimate=estimate),
            closed_form_step_time_s=float(data.get("closed_form_step_time_s") or estimate.step_time_s),
            stages=_stages(data, config, source),
            tp_plan=_string_map(data, "tp_plan", TP_STYLES, source),
            tp_sharding=data.get("tp_sharding") if isinstance(data.get("tp_sharding"), dict) else {},
            recompute_per_layer=_string_map(data, "recompute_per_layer", POLICIES, source, canonical),
            alternatives=tuple(_alternative(a, i, source) for i, a in enumerate(data.get("alternatives") or ())),
            limits=str(data.get("limits", "")),
            accuracy=data.get("accuracy") if isinstance(data.get("accuracy"), dict) else {},
            gains=data.get("gains") if isinstance(data.get("gains"), dict) else {},
            choice=data.get("choice") if isinstance(data.get("choice"), dict) else {},
            precisions=data.get("precisions") if isinstance(data.get("precisions"), dict) else {},
            energy=data.get("energy") if isinstance(data.get("energy"), dict) else {},
            search=SearchStats(seconds=float(search.get("seconds", 0.0)), candidates=_int(search.get("candidates", 0)),
                               evaluated=_int(search.get("evaluated", 0)), solver=str(search.get("solver", "")),
                               global_choices=_int(search.get("global_choices", 0)),
                               ilp_solves=_int(search.get("ilp_solves", 0)),
                               ilp_unproven=_int(search.get("ilp_unproven", 0))),
            meshplan_version=written_by or "", source=source)

    @classmethod
    def read(cls, path: str | Path) -> "Plan":
        """``from_json`` of the file at ``path``."""
        from .model import read_json
        return cls.from_json(read_json(Path(path)), str(path))


# -- reading plan.json, field by field --------------------------------------------------------------

def _fixed_knobs(data: dict, source: str) -> dict | None:
    """The fixed knobs, {name: integer, string or boolean} (their names are checked where they are used:
    ``planner.replan``); None where the file does not record them."""
    raw = data.get("knobs")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, (int, str, bool))
                                            for k, v in raw.items()):
        raise UserError(f"must be a JSON object {{knob: integer, string or boolean}}, got {raw!r}", source=source,
                        field="knobs")
    return dict(raw)


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _require(data: dict, key: str, kind: type, source: str, prefix: str = ""):
    if key not in data:
        raise UserError("missing (required)", source=source, field=prefix + key)
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UserError(f"must be a JSON {_json_kind(kind)}, got {value!r}", source=source, field=prefix + key)
    return value


def _json_kind(kind: type) -> str:
    return {dict: "object", list: "array", str: "string", int: "integer", bool: "boolean"}.get(kind, kind.__name__)


def spec_json(spec: ModelSpec) -> dict:
    """A model spec as plan.json holds it: every field but those at their default (a dense model says nothing
    of experts or latent attention; reading fills them back in)."""
    defaults = {f.name: f.default for f in fields(ModelSpec) if f.default is not MISSING}
    return {k: v for k, v in asdict(spec).items() if k not in defaults or v != defaults[k] or k == "source"}


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
    for name in ("overlap_grad_reduce", "tp_comm_overlap", "ep_comm_overlap", "compile", "fp8_param_gather",
                 "grad_reduce_in_bf16"):
        if name in raw and not isinstance(raw[name], bool):
            raise UserError(f"must be true or false, got {raw[name]!r}", source=source, field=f"workload.{name}")
    if "memory_headroom" in raw:
        value = raw["memory_headroom"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise UserError(f"must be a fraction from 0 to 1, got {value!r}", source=source,
                            field="workload.memory_headroom")
    else:       # written before the headroom existed: the plan was made without one
        raw = {**raw, "memory_headroom": 0.0}
    if "lora_targets" in raw:       # a JSON list
        targets = raw["lora_targets"]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise UserError(f"must be a list of LoRA targets, got {targets!r}", source=source,
                            field="workload.lora_targets")
        raw = {**raw, "lora_targets": tuple(targets)}
    finetune_modes.check(raw.get("finetune", "full"), raw.get("lora_rank", 0), raw.get("lora_targets", ()),
                         source=source, prefix="workload.")
    if "expert_imbalance" in raw:
        value = raw["expert_imbalance"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
            raise UserError(f"must be a number of at least 1, got {value!r}", source=source,
                            field="workload.expert_imbalance")
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


def _alternative(raw, index: int, source: str) -> Alternative:
    where = f"alternatives[{index}]"
    if not isinstance(raw, dict):
        raise UserError(f"must be a JSON object, got {raw!r}", source=source, field=where)
    config = ParallelConfig.from_json(_require(raw, "config", dict, source, f"{where}."), source)
    return Alternative(config=config, estimate=Estimate.from_json(raw.get("estimate"), source, f"{where}.estimate"),
                       lost_on=str(raw.get("lost_on", "")))
