"""The memory headroom a plan leaves (planner/config.py DEFAULT_MEMORY_HEADROOM), and the rule that
resolves near-ties within the model's error toward the safer plan (planner/search/result.py choose)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from conftest import ROOT
from planner import api
from planner.config import DEFAULT_MEMORY_HEADROOM
from planner.cost.step import usable_bytes
from planner.estimate import Candidate
from planner.explain import ranking_sentence
from planner.plan import Alternative, Plan
from planner.search.finish import choice_json
from planner.search.result import choose, mechanisms

GiB = 2**30
RESULTS = ROOT / "benchmarks" / "results"


def test_the_default_headroom_is_the_largest_measured_reserved_gap():
    """Recomputed from the H100 runs: the peak torch's allocator reserved over the predicted peak."""
    gaps = []
    for validate, runs in (("gpu_validate.json", "gpu_runs.json"), ("gpu_holdout_validate.json", "gpu_holdout_runs.json")):
        predicted = {r["name"]: r["predicted_peak_bytes"] for r in json.loads((RESULTS / validate).read_text())["rows"]}
        for row in json.loads((RESULTS / runs).read_text())["rows"]:
            gaps.append(row["measured_reserved_bytes"] / predicted[row["name"]] - 1)
    assert len(gaps) == 18
    assert DEFAULT_MEMORY_HEADROOM == math.ceil(max(gaps) * 100) / 100


def _quick_start(*extra: str) -> dict:
    from conftest import run_cli
    out = run_cli("plan", "--model", "gpt3-175b", "--cluster", "a100-80g", "--gpus", "1024", "--global-batch",
                  "1536", "--json", *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_quick_start_leaves_the_headroom_and_says_how_it_chose():
    doc = _quick_start()
    e, reserve = doc["estimate"], 1.0 * GiB           # a100-80g's runtime reserve
    # the tensors' peak over 1.21 of the memory beyond the reserve
    assert reserve + (e["memory_per_gpu_bytes"]["total"] - reserve) * (1 + DEFAULT_MEMORY_HEADROOM) <= 80 * GiB
    assert doc["workload"]["memory_headroom"] == DEFAULT_MEMORY_HEADROOM
    assert doc["choice"]["rule"] in ("fastest", "more-headroom-within-band")
    if doc["choice"]["rule"] == "more-headroom-within-band":
        assert doc["choice"]["chosen"]["memory_left_bytes"] > doc["choice"]["fastest"]["memory_left_bytes"]
        assert doc["estimate"]["step_time_s"] <= doc["choice"]["fastest"]["step_time_s"] * (1 + doc["choice"]["band"])
    # no headroom, the fastest by the model: the plan the Quick start once recommended fills the memory
    bare = _quick_start("--memory-headroom", "0", "--prefer", "fastest")
    assert bare["choice"]["rule"] == "fastest"
    assert bare["estimate"]["memory_per_gpu_bytes"]["total"] > e["memory_per_gpu_bytes"]["total"]


@pytest.mark.parametrize("name", ["gpt3-175b-1024-a100", "llama3-8b-8-h100", "llama3-70b-256-h100",
                                  "llama3-405b-16384-h100"])
def test_no_gallery_plan_leaves_less_than_the_default_headroom(name):
    plan = Plan.read(ROOT / "reports" / name / "plan.json")
    assert plan.workload.memory_headroom >= DEFAULT_MEMORY_HEADROOM
    reserve = plan.estimate.memory.reserve
    assert reserve + (plan.estimate.memory.total - reserve) * (1 + DEFAULT_MEMORY_HEADROOM) \
        <= plan.estimate.capacity_bytes * (1 + 1e-12)


def _job_and_candidates():
    """Two real candidates of one job: the fastest, and a runner-up of the same layout kind."""
    job = api.load_job("llama3-8b", "h100-80g", gpus=8, global_batch=64)
    plan = api.plan(job, prefer="fastest")
    best = plan.best
    other = plan.alternatives[0]
    return job, best, Candidate(config=other.config, estimate=other.estimate)


def test_a_near_tie_within_the_band_goes_to_the_plan_with_more_memory_left():
    _, fastest, runner = _job_and_candidates()
    t = fastest.estimate.step_time_s
    # the runner-up 2% slower, resting on no more mechanisms, with 10 GiB more left: inside a 5% band it wins
    safer = Candidate(config=replace(fastest.config, micro_batch=fastest.config.micro_batch),
                      estimate=replace(fastest.estimate, step_time_s=1.02 * t,
                                       memory=replace(fastest.estimate.memory,
                                                      activations=fastest.estimate.memory.activations - 10 * GiB)))
    slow = Candidate(config=runner.config, estimate=replace(runner.estimate, step_time_s=1.5 * t))
    chosen, choice = choose(fastest, (slow, safer), band=0.05)
    assert chosen is safer and choice.rule == "more-headroom-within-band" and choice.fastest is fastest
    # outside the band (1%), or with a mechanism more, the fastest stays
    assert choose(fastest, (safer,), band=0.01)[0] is fastest
    riskier = Candidate(config=replace(safer.config, optimizer_offload=True), estimate=safer.estimate)
    assert len(mechanisms(riskier.config)) > len(mechanisms(fastest.config))
    assert choose(fastest, (riskier,), band=0.05)[0] is fastest
    # and the plan's message says the ranking is within the model's error, the rule, and what separates them
    doc = choice_json(choice, chosen)
    assert doc["rule"] == "more-headroom-within-band" and doc["within_band"] == 2
    alts = (Alternative(config=fastest.config, estimate=fastest.estimate, lost_on=""),)
    line = ranking_sentence(doc, chosen.estimate, alts)
    assert "within the model's error" in line and "more-headroom-within-band" in line
    assert "what separates it from the nearest (+2.0%)" not in line        # the nearest is the faster one
    assert "what separates it from the nearest (-2.0%)" in line and (" s less" in line or " s more" in line)


def test_the_headroom_changes_what_fits():
    """At no headroom a plan may fill the usable memory; each fraction of headroom shrinks it."""
    job = api.load_job("llama3-8b", "h100-80g", gpus=8, global_batch=64)
    reserve, cap = job.cluster.device.reserved_bytes, job.cluster.device.memory_bytes
    for h in (0.0, 0.1, DEFAULT_MEMORY_HEADROOM):
        workload = replace(job.workload, memory_headroom=h)
        assert usable_bytes(job.cluster, workload) == pytest.approx(reserve + (cap - reserve) / (1 + h))


def test_a_runner_up_that_prices_the_same_step_is_said_to():
    # two layouts whose steps are the same part by part (dp 16 x cp 2 at micro-batch 1 and dp 8 x cp 4 at 2 hold the
    # same tokens a rank): no part separates them, and the line says that rather than "compute: 0 s less"
    _, fastest, _ = _job_and_candidates()
    twin = Candidate(config=replace(fastest.config, micro_batch=fastest.config.micro_batch), estimate=fastest.estimate)
    chosen, choice = choose(fastest, (twin,), band=0.05)
    line = ranking_sentence(choice_json(choice, chosen), chosen.estimate,
                            (Alternative(config=twin.config, estimate=twin.estimate, lost_on=""),))
    assert "the nearest (+0.0%) prices the same step, part by part" in line and "0 s less" not in line
