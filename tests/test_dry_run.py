"""`meshplan run --dry-run`: the job of a plan built at its full world size in one process (fake
process group, meta device), every parameter's placement and shard shape checked against the plan,
per-rank model-state bytes against the prediction (executor/dryrun.py)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import ROOT
from gallery_plans import gallery_plan
from planner.report.gallery import SCENARIOS

pytestmark = pytest.mark.distributed      # dry runs build the world on the fake process group


def _run_plan(doc: dict, source: str):
    from planner.plan import Plan
    return Plan.from_json(doc, source)


def _candidates(name: str) -> list[tuple[str, dict]]:
    """The recommended plan and every runner-up the search lists, each as the plan.json it makes."""
    from planner import api
    plan = gallery_plan(name)
    job = api.Job(model_source=plan.model_source, spec=plan.spec, graph=plan.graph, cluster=plan.cluster,
                  workload=plan.workload)
    out = [("recommended", plan.to_json())]
    for i, alt in enumerate(plan.alternatives):
        out.append((f"runner-up {i + 1}", api.fixed_plan(job, alt.config).to_json()))
    return out


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_every_gallery_plan_and_runner_up_builds_as_planned(scenario):
    from executor.dryrun import dry_run
    for label, doc in _candidates(scenario):
        plan = _run_plan(doc, f"{scenario} {label}")
        reports, seconds = dry_run(plan)
        assert seconds < 60, f"{scenario} {label}: {seconds:.1f} s"
        assert {r.pp_rank for r in reports} == set(range(plan.config.pp))
        for r in reports:
            assert r.problems == [], (scenario, label, r.problems[:5])
            # gradients and optimizer states have no working copies: the built bytes are the prediction's
            # (1/d of each tensor) on the first ranks, which hold the full chunks; the last ranks may hold
            # less where a dimension does not divide (torch.chunk's split)
            first = r.coordinates == {"dp_cp": 0, "tp": 0}
            for key, got in (("grads", r.grads_bytes), ("optimizer", r.optimizer_bytes)):
                want = r.predicted[key]
                assert (abs(got - want) if first else got - want) <= 0.01 * want, (scenario, label, r.rank, key,
                                                                                    got, want)
            # the prediction adds what a step holds beyond the shards (autocast copies, ZeRO-2's gathered ones)
            assert r.params_bytes <= r.predicted["params"] * 1.001, (scenario, label, r.rank)


def test_the_committed_405b_plan_at_16384_ranks_builds_in_under_a_minute(cli, tmp_path):
    plan = ROOT / "reports" / "llama3-405b-16384-h100" / "plan.json"
    out = cli("run", "--plan", str(plan), "--model", "llama3-405b", "--dry-run", "--json", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["seconds"] < 60
    pp = json.loads(plan.read_text())["config"]["pp"]
    assert len(doc["ranks"]) == 2 * pp                  # every stage, as the first and as the last rank
    assert {r["rank"] for r in doc["ranks"]} >= {0, 16383}


def test_expected_shards_by_hand():
    """Llama-3 8B's q_proj weight (4096 x 4096), colwise under tp 2, ZeRO-3 over dp 2 x cp 2:
    rows split by TP (2048), then FSDP's dim-0 chunks over the 4 dp_cp ranks (512)."""
    from executor.dryrun import expected_shards
    from executor.mesh import ParallelDims
    plan = _run_plan(_candidates("llama3-8b-8-h100")[0][1], "p.json")
    plan = replace(plan, tp_plan={"layers.0.attn.q_proj": "colwise", "layers.0.attn.o_proj": "rowwise"},
                   best=replace(plan.best, config=replace(plan.config, zero=3)))
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=2, world_size=8)
    coords = {"dp_cp": 3, "tp": 1}
    assert expected_shards("layers.0.attn.q_proj.weight", torch.Size([4096, 4096]), plan, dims, coords) == (
        {"tp": 0, "dp_cp": 0}, (512, 4096))
    assert expected_shards("layers.0.attn.o_proj.weight", torch.Size([4096, 4096]), plan, dims, coords) == (
        {"tp": 1, "dp_cp": 0}, (1024, 2048))
    # 5 rows over 4 ranks: torch.chunk gives 2, 2, 1, 0
    assert expected_shards("norm.weight", torch.Size([5]), plan, dims, coords) == ({"dp_cp": 0}, (0,))


def test_a_dry_run_needs_no_steps_and_a_run_does(cli, tmp_path):
    plan = ROOT / "reports" / "llama3-8b-8-h100" / "plan.json"
    out = cli("run", "--plan", str(plan), "--model", "llama3-8b")
    assert out.returncode == 2
    assert out.stderr.strip() == "meshplan run: error: --steps: required unless --dry-run: the optimizer steps to run"


def test_an_offloaded_zero3_plan_keeps_its_model_states_in_host_memory(cli, tmp_path):
    """FSDP2's CPU offload at ZeRO-3: no parameter, gradient or optimizer byte on the GPU (the plan's
    prediction), and on the host each rank's share of 16 bytes per parameter (fp32 weights, gradients,
    two Adam moments) of Llama-3 8B's 8.03e9 over tp 2 x dp 4."""
    from executor.dryrun import dry_run
    from executor.plan_file import load_plan
    out = cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--global-batch", "64",
              "--tp", "2", "--zero", "3", "--optimizer-offload", "on", "--out", str(tmp_path / "plan.json"))
    assert out.returncode == 0, out.stderr
    reports, _ = dry_run(load_plan(str(tmp_path / "plan.json")))
    for r in reports:
        assert r.problems == [] and (r.params_bytes, r.grads_bytes, r.optimizer_bytes) == (0, 0, 0)
        assert r.predicted["params"] == r.predicted["grads"] == r.predicted["optimizer"] == 0
        assert abs(r.host_bytes - 8.03e9 * 16 / 8) <= 0.01 * 8.03e9 * 16 / 8, r.host_bytes


@pytest.mark.parametrize("knobs", [{"pp": 1, "zero": 0}, {"pp": 2, "zero": 1}, {"pp": 1, "zero": 3, "tp": 2}],
                         ids=["ddp", "zero1-pp2", "zero3-tp2"])
def test_a_lora_plan_builds_with_its_base_frozen_in_bf16_as_planned(knobs):
    """LoRA on Llama 2 7B, 8 A100 in bf16: the adapters take their base's layout, the frozen base is stored in bf16
    (PEFT's base dtype, the planner's price), and each rank's parameter, gradient (adapters only) and optimizer
    (their two AdamW moments) bytes are the plan's within 1%."""
    from executor.dryrun import dry_run
    from planner import api
    job = api.load_job("llama2-7b", cluster="a100-80g", gpus=8, global_batch=64, finetune="lora")
    plan = api.plan(job, api.Knobs(**knobs), top_k=0)
    reports, _ = dry_run(_run_plan(json.loads(json.dumps(plan.to_json())), "lora"))     # as plan.json reads
    for r in reports:
        assert r.problems == [], r.problems[:5]
        for key, got in (("params", r.params_bytes), ("grads", r.grads_bytes), ("optimizer", r.optimizer_bytes)):
            assert got == pytest.approx(r.predicted[key], rel=0.01), (r.rank, key, got, r.predicted[key])
        assert r.grads_bytes < r.params_bytes / 100        # the adapters alone hold gradients


def test_a_dry_run_fails_where_a_rank_holds_more_states_than_the_plan_says():
    """The bytes a dry run of Mixtral 8x7B without ep at dp 64, ZeRO-3, built on rank 0 while FSDP2 sharded the stack
    of 8 experts along dim 0 (a padded eighth of each on every rank; executor/zero1.py expert_dim since): gradients
    and AdamW states 7.8 times the plan's. Such a rank is reported and `meshplan run --dry-run` exits 1; within 5%
    (AdamW's step counts, rounding) it is not."""
    from executor.dryrun import RankReport
    predicted = {"params": 2_918_924_544, "grads": 2_918_924_544, "optimizer": 5_837_849_088}
    padded = RankReport(rank=0, pp_rank=0, coordinates={"dp_cp": 0, "tp": 0}, grads_bytes=22_649_389_312,
                        optimizer_bytes=45_298_779_916, predicted=predicted)
    over = padded.over_plan()
    assert [line.split(":")[0] for line in over] == ["grads", "optimizer"] and "(+676%)" in over[0]
    close = RankReport(rank=0, pp_rank=0, coordinates={"dp_cp": 0, "tp": 0}, grads_bytes=int(1.04 * 2_918_924_544),
                       optimizer_bytes=5_838_767_884, predicted=predicted)
    assert close.over_plan() == []


def test_mixtral_without_ep_over_64_ranks_builds_within_its_plan(cli, tmp_path):
    plan = tmp_path / "plan.json"
    made = cli("plan", "--model", "mixtral-8x7b", "--cluster", "h100-80g", "--gpus", "64", "--ep", "1", "--zero", "3",
               "--tp", "1", "--pp", "1", "--out", str(plan))
    assert made.returncode == 0, made.stderr
    out = cli("run", "--plan", str(plan), "--model", "mixtral-8x7b", "--dry-run")
    assert out.returncode == 0 and "no rank holds more than the plan predicts" in out.stdout, out.stdout[-1500:]
