"""A Plan is whole when the search returns it: serialising computes nothing, and Plan.from_json, the one
reader of plan.json, reads back every field."""
from __future__ import annotations

import json

import pytest

from gallery_plans import gallery_plan
from planner import api
from planner.plan import Plan
from planner.report.gallery import SCENARIOS


def _raise(*args, **kwargs):
    raise AssertionError("serialising a Plan computed something")


def test_to_json_solves_and_estimates_nothing(monkeypatch):
    """With TP (the sharding ILP), a pipeline and runners-up; every solver, estimate and explanation patched
    to raise once the plan is made."""
    import pulp

    import planner.cost.step
    import planner.explain
    import planner.search.finish
    import planner.search.tp_ilp
    import planner.simulate
    job = api.load_job("llama3-8b", "h100-80g", gpus=16, global_batch=64)
    plan = api.plan(job, api.Knobs(tp=2, pp=2))
    assert plan.tp_sharding and plan.alternatives and plan.gains is not None
    before = json.dumps(plan.to_json())
    for module, name in ((planner.search.tp_ilp, "solve_sharding"), (planner.search.finish, "solve_sharding"),
                         (planner.search.finish, "estimate"), (planner.cost.step, "estimate"),
                         (planner.simulate, "simulated_estimate"), (planner.explain, "gains"),
                         (planner.explain, "limits"), (planner.explain, "lost_on"), (pulp.LpProblem, "solve")):
        monkeypatch.setattr(module, name, _raise)
    assert json.dumps(plan.to_json()) == before


def test_the_raising_patch_would_be_seen(monkeypatch):
    import planner.search.finish
    monkeypatch.setattr(planner.search.finish, "solve_sharding", _raise)
    with pytest.raises(AssertionError, match="computed something"):
        api.plan(api.load_job("llama3-8b", "h100-80g", gpus=16, global_batch=64), api.Knobs(tp=2, pp=2))


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_from_json_round_trips_the_gallery_plans(scenario):
    doc = json.loads(json.dumps(gallery_plan(scenario).to_json()))
    read = Plan.from_json(doc, f"{scenario}/plan.json")
    assert read.graph is None and read.cluster is None and read.source == f"{scenario}/plan.json"
    assert json.loads(json.dumps(read.to_json())) == doc
    assert read.config == gallery_plan(scenario).config and read.estimate == Plan.from_json(doc).estimate


def test_a_committed_gallery_plan_reads_with_the_one_reader():
    from conftest import ROOT
    for s in SCENARIOS:
        plan = Plan.read(ROOT / "reports" / s.name / "plan.json")
        assert plan.config.world_size == plan.world_size and len(plan.stages) == plan.config.pp * plan.config.vpp
