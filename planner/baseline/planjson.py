"""meshplan's own plan.json (planner/plan.py writes it): the config and workload as they
were planned, the model's architecture, and the fingerprint of the model it was made for.
Everything else in the file (estimate, stages, runners-up) is the planner's output, not a
setting."""
from __future__ import annotations

import json
from dataclasses import fields

from ..config import PLAN_SCHEMA_VERSION, ParallelConfig, Workload
from ..errors import UserError, one_of
from ..fingerprint import model_fingerprint
from ..layers import LayerGraph
from ..model import ModelSpec
from ..trace.load import is_traced_source
from .values import Baseline, Context, FileModel, global_batch, positive_int

FLAGS = {"--dp/--tp/--pp/--cp": "config.dp x tp x pp x cp", "--tp": "config.tp", "--pp": "config.pp",
         "--cp": "config.cp", "--micro-batch": "config.micro_batch", "num_microbatches": "config.num_microbatches",
         "--vpp": "config.vpp", "--schedule": "config.schedule", "--zero": "config.zero",
         "--recompute": "config.recompute", "--sequence-parallel": "config.sequence_parallel",
         "--optimizer-offload": "config.optimizer_offload", "--precision": "workload.precision"}


def parse(text: str, source: str) -> dict:
    from .deepspeed import parse as parse_json
    doc = parse_json(text, source)
    if doc.get("schema_version") != PLAN_SCHEMA_VERSION:
        raise UserError(f"schema version {doc.get('schema_version')!r}; allowed: {PLAN_SCHEMA_VERSION} (this "
                        "meshplan's)", source=source, field="schema_version")
    for key in ("config", "workload", "model"):
        if not isinstance(doc.get(key), dict):
            raise UserError("missing or not an object", source=source, field=key)
    return doc


def model_of(doc: dict, source: str) -> FileModel:
    model, workload = doc["model"], doc["workload"]
    seq = workload.get("seq_len")
    seq_len = ("workload.seq_len", seq) if isinstance(seq, int) and not isinstance(seq, bool) else None
    spec = model.get("spec")
    if isinstance(spec, dict):
        names = {f.name for f in fields(ModelSpec)}
        if set(spec) - names:
            raise UserError(f"unknown field(s) {', '.join(sorted(set(spec) - names))}; allowed: {one_of(sorted(names))}",
                            source=source, field="model.spec")
        try:
            return FileModel(spec=ModelSpec(**spec).validate(source), name_flag="model.spec", seq_len=seq_len)
        except TypeError as e:
            raise UserError(f"incomplete: {e}", source=source, field="model.spec") from None
    named = model.get("source")
    return FileModel(name=None if not isinstance(named, str) or is_traced_source(named) else named,
                     name_flag="model.source", seq_len=seq_len,
                     missing=f"model {named!r} is a traced module, which a plan.json does not describe")


def read(doc: dict, source: str, ctx: Context, graph: LayerGraph) -> Baseline:
    config = ParallelConfig.from_json(doc["config"], source)
    if config.world_size != ctx.gpus:
        raise UserError(f"{config.dp} x {config.tp} x {config.pp} x {config.cp} = {config.world_size} GPUs but --gpus "
                        f"is {ctx.gpus}; allowed: the plan's own {config.world_size}", source=source,
                        field="config.dp x tp x pp x cp")
    planned = doc.get("fingerprints", {}).get("model")
    if planned is not None and planned != model_fingerprint(graph):
        raise UserError(f"the plan was made for another model than {graph.name} (fingerprint {planned}); allowed: "
                        "the model it was planned for", source=source, field="fingerprints.model")
    w = _workload(doc["workload"], source)
    batch = global_batch(source, "workload.global_batch", positive_int(source, "workload.global_batch",
                                                                         w.global_batch), ctx, None)
    return Baseline(source=source, format="plan.json", runtime=w.framework, config=config, global_batch=batch,
                    seq_len=graph.seq_len, precision=w.precision, attention=w.attention,
                    overlap_grad_reduce=w.overlap_grad_reduce, tp_comm_overlap=w.tp_comm_overlap, flags=FLAGS)


def _workload(data: dict, source: str) -> Workload:
    names = {f.name for f in fields(Workload)}
    if set(data) - names:
        raise UserError(f"unknown field(s) {', '.join(sorted(set(data) - names))}; allowed: {one_of(sorted(names))}",
                        source=source, field="workload")
    try:
        return Workload(**data)
    except TypeError as e:
        raise UserError(f"incomplete: {e}", source=source, field="workload") from None
