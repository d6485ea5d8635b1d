"""Is this plan.json for what it is asked to run?

The planner writes ``fingerprints`` into plan.json (planner/fingerprint.py): the
model's (its layer graph: layers, parameters, operator shapes), the cluster's and
the world size. The executor recomputes the model's from the model it is asked
to run and compares the live world size, and refuses a mismatch naming what
differs:

- model: ``--model`` (a zoo name or config.json) is loaded, its layer graph built
  as the planner builds it (``build_layer_graph(load_model(...))``) and
  fingerprinted; the spec fields that differ are named first where the plan
  carries a spec. A traced module's plan is refused by ``meshplan run`` (run it
  with ``auto_parallelize``, which plans the module it is given);
- world size: ``fingerprints.world_size`` against the processes launched (the
  CLI) and the live process group (every rank);
- cluster: not compared. The executor cannot tell which cluster it runs on from
  inside the job, and running a plan made for a GPU cluster on CPU processes is
  how plans are rehearsed (the tests do it). The field is still validated.

Imports no torch (``meshplan run`` checks before it launches anything).
"""
from __future__ import annotations

from dataclasses import fields

from planner.errors import UserError
from planner.fingerprint import model_fingerprint
from planner.layers import build_layer_graph
from planner.model import load_model
from planner.plan import Plan


# Fields that describe the training run rather than the architecture: a plan for a
# shorter sequence runs the same model.
_RUN_FIELDS = ("name", "seq_len", "source")


def check_model(plan: Plan, model: str) -> Plan:
    """The architecture --model names must be the one the plan was made for."""
    if plan.spec is None:
        raise UserError("the plan is for a traced module; run it with executor.auto_parallelize inside your "
                        "own torchrun script", source=plan.source, field="model.spec")
    given = load_model(model)
    diffs = [f"{f.name} {getattr(given, f.name)!r} != {getattr(plan.spec, f.name)!r}" for f in fields(given)
             if f.name not in _RUN_FIELDS and getattr(given, f.name) != getattr(plan.spec, f.name)]
    if diffs:
        raise UserError(f"--model {model} is not the model this plan was made for: {'; '.join(diffs)}",
                        source=plan.source, field="model.spec")
    fingerprint = model_fingerprint(build_layer_graph(given))
    if fingerprint != plan.fingerprints.model:
        raise UserError(f"--model {model} has model fingerprint {fingerprint}, the plan was made for "
                        f"{plan.fingerprints.model}: another model (or an edited plan); re-plan with "
                        f"`meshplan plan --model {model} --out`", source=plan.source, field="fingerprints.model")
    return plan


def check_world_size(plan: Plan, world_size: int, where: str) -> None:
    """The plan splits the training over fingerprints.world_size processes; ``where`` has ``world_size``."""
    want = plan.fingerprints.world_size
    if world_size != want:
        c = plan.config
        raise UserError(f"the plan was made for {want} processes (dp x tp x pp x cp = {c.dp} x {c.tp} x {c.pp} x "
                        f"{c.cp}) but {where} has {world_size}; allowed: {want} processes, or re-plan with "
                        f"`meshplan plan --gpus {world_size}`", source=plan.source, field="fingerprints.world_size")
