"""A pipeline schedule and a recompute policy each have one home, their record (planner/schedules.py,
planner/recompute.py), and everything else derives from it: the CLI's choices, what plan.json accepts,
each runtime's offer, the simulation's event orders, the executor's classes and applications, and the
names every export writes."""
from __future__ import annotations

import argparse
import tomllib
from dataclasses import replace

import pytest

from gallery_plans import fixed_plan
from planner.baseline import torchtitan as torchtitan_reader
from planner.cli import build_parser
from planner.config import ParallelConfig
from planner.errors import UserError
from planner.exports import colossalai, deepspeed, megatron, torchtitan
from planner.recompute import ALIASES, POLICY_RECORDS, RECOMPUTE_POLICIES, runs_in
from planner.runtimes import RUNTIMES
from planner.schedules import NAMES, SCHEDULES
from planner.simulate import SCHEDULE_ORDERS, schedule_order

from test_exports import megatron_args


def _option(command: str, flag: str) -> argparse.Action:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return next(a for a in sub._actions if flag in a.option_strings)


def _plan_for(schedule: str, recompute: str = "none"):
    """A fixed Llama-3 8B plan on 8 H100 with ``schedule`` (2 stages, 2 virtual each where it has them)."""
    record = SCHEDULES[schedule]
    vpp = 2 if record.virtual_stages else 1
    config = ParallelConfig(dp=4, tp=1, pp=2, zero=1, micro_batch=1, num_microbatches=4, vpp=vpp, schedule=schedule,
                            recompute=recompute)
    # Megatron-Core's output-discarding checkpoint is Megatron-LM's alone
    return fixed_plan("llama3-8b", "h100-80g", 8, config, framework="megatron" if recompute == "discard" else "torch")


# -- pipeline schedules ------------------------------------------------------------------------------

def test_the_cli_offers_exactly_the_schedule_records():
    assert tuple(_option("plan", "--schedule").choices) == NAMES == tuple(SCHEDULES)
    assert tuple(_option("whatif", "--schedule").choices) == NAMES
    help_text = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    for record in SCHEDULES.values():
        assert record.description in " ".join(help_text.split()), record.name


def test_plan_json_accepts_exactly_the_schedule_records():
    base = {"dp": 1, "tp": 1, "pp": 1}
    for name in NAMES:
        assert ParallelConfig.from_json({**base, "schedule": name}).schedule == name
    with pytest.raises(UserError) as e:
        ParallelConfig.from_json({**base, "schedule": "LoopedBFS"})
    assert all(name in str(e.value) for name in NAMES)


def test_each_runtime_runs_the_schedules_whose_records_name_it():
    # the torch runtime (meshplan's executor) runs every torch.distributed.pipelining schedule
    assert RUNTIMES["torch"].on("cuda").schedules == tuple(n for n, s in SCHEDULES.items() if s.torch_name)
    assert RUNTIMES["megatron"].on("cuda").schedules == tuple(n for n, s in SCHEDULES.items() if s.megatron)
    assert RUNTIMES["deepspeed"].on("cuda").schedules == tuple(n for n, s in SCHEDULES.items() if s.deepspeed)
    assert "1f1b" in RUNTIMES["deepspeed"].on("cuda").schedules and "gpipe" not in RUNTIMES["megatron"].on("cpu").schedules


def test_the_simulation_orders_every_schedule_each_pass_once():
    assert set(SCHEDULE_ORDERS) == set(NAMES)
    for name, record in SCHEDULES.items():
        vpp = 2 if record.virtual_stages else 1
        for rank in range(4):
            passes = schedule_order(name, pp=4, vpp=vpp, num_microbatches=8, rank=rank)
            if record.backward == "split":      # the weight gradient of each: W, or B where it runs whole
                passes = [("B" if kind == "W" else kind, mb, c) for kind, mb, c in passes if kind != "I" or
                          ("W", mb, c) not in passes]
            want = {(kind, mb, chunk) for kind in "FB" for mb in range(8) for chunk in range(vpp)}
            assert len(passes) == len(want) and set(passes) == want, (name, rank)


def test_the_executor_runs_the_torch_class_each_record_names():
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
    for record in SCHEDULES.values():
        cls = get_schedule_class(record.torch_name)
        assert issubclass(cls, PipelineScheduleMulti) == record.virtual_stages, record.name


@pytest.mark.parametrize("schedule", [n for n, s in SCHEDULES.items() if s.backward == "whole"])
def test_every_export_names_the_schedule_as_its_record_does(schedule):
    record, plan = SCHEDULES[schedule], _plan_for(schedule)
    nearest = SCHEDULES[record.nearest] if record.nearest else None
    titan = tomllib.loads(torchtitan(plan).text)["parallelism"]
    assert titan["pipeline_parallel_schedule"] == record.torch_name
    assert torchtitan_reader.SCHEDULES[record.torch_name] == schedule          # and it reads back
    colo = colossalai(plan)
    assert f"pp_style={(record.colossalai or nearest.colossalai)!r}" in colo.text
    assert any(record.title in n for n in colo.notes) == (record.colossalai is None)
    assert any(record.title in n for n in megatron(plan).notes) == (record.megatron is None)
    assert any(record.title in n for n in deepspeed(plan).notes) == (record.deepspeed is None)


def test_pipeline_time_is_the_records_formula():
    """The estimate's pipeline is the record's: GPipe and 1F1B (m - 1) slowest + sum; interleaved
    m slowest + (sum - slowest)/v + 2 (p v - 1) hops (Narayanan et al. 2021, Sec 2.2, with the fill and drain
    through the other ranks): 8 x 2 + 3.5 / 2 + 14 x 0.1 here."""
    from planner.cost.step import pipeline_s
    ranks = [1.0, 2.0, 1.5, 1.0]
    for name, record in SCHEDULES.items():
        vpp = 2 if record.virtual_stages else 1
        config = ParallelConfig(dp=1, tp=1, pp=4, micro_batch=1, num_microbatches=8, vpp=vpp, schedule=name)
        want = 19.15 if record.virtual_stages else 7 * 2.0 + 5.5
        assert pipeline_s(ranks, config, hop_s=0.1) == pytest.approx(want), name


# -- recompute policies ------------------------------------------------------------------------------

def test_the_cli_takes_every_policy_its_earlier_names_and_every_k():
    parse = _option("plan", "--recompute").type
    for record in POLICY_RECORDS:
        assert parse(record.name) == record.name
        for alias in record.aliases:
            assert parse(alias) == record.name
    assert parse("every-3") == "every-3"
    with pytest.raises(argparse.ArgumentTypeError):
        parse("sometimes")
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["plan"].format_help().split())
    for record in POLICY_RECORDS:
        assert record.description in help_text, record.name


def test_plan_json_accepts_every_policy_and_its_earlier_names():
    base = {"dp": 1, "tp": 1, "pp": 1}
    for record in POLICY_RECORDS:
        assert ParallelConfig.from_json({**base, "recompute": record.name}).recompute == record.name
        for alias in record.aliases:
            assert ParallelConfig.from_json({**base, "recompute": alias}).recompute == record.name
            layers = ParallelConfig.from_json({**base, "recompute": alias, "recompute_layers": ["none", alias]})
            assert layers.recompute_layers == ("none", record.name)
    assert ALIASES == {"offload": "activation-offload"}
    with pytest.raises(UserError, match="allowed: none, selective, discard, op, full, activation-offload or every-K"):
        ParallelConfig.from_json({**base, "recompute": "sometimes"})


def test_each_runtime_runs_the_policies_it_has_a_name_for_and_the_executor_applies_each():
    from executor.activations import APPLY
    # all but Megatron-Core's output-discarding checkpoint, which the executor does not implement
    torch_policies = tuple(p for p in RECOMPUTE_POLICIES if p != "discard")
    assert RUNTIMES["torch"].on("cuda").recomputes == torch_policies == tuple(APPLY)
    assert RUNTIMES["megatron"].on("cuda").recomputes == runs_in("megatron") == ("none", "selective", "discard",
                                                                                  "full")
    assert RUNTIMES["deepspeed"].on("cuda").recomputes == runs_in("deepspeed")


def test_the_cost_model_prices_every_policy_by_its_record():
    from planner.cluster import load_cluster
    from planner.cost.layer import Context, layer_cost
    from planner.layers import build_layer_graph
    from planner.model import ZOO
    block = next(layer for layer in build_layer_graph(ZOO["llama3-8b"]).layers if layer.is_block)
    ctx = Context(micro_batch=1, seq_len=8192, tp=1, cp=1, sequence_parallel=False, precision="bf16",
                  attention="flash", framework="megatron", tp_comm_overlap=False)
    cost = layer_cost(block, ctx, load_cluster("h100-80g", 8))
    assert tuple(cost.by_policy) == tuple(RECOMPUTE_POLICIES)
    # full redoes the forward (all of it where the checkpoint does not stop early: Megatron-LM's)
    assert cost.policy("full").recompute_s == pytest.approx(cost.fwd_s)
    assert cost.policy("none").recompute_s == 0.0


@pytest.mark.parametrize("policy", tuple(RECOMPUTE_POLICIES))
def test_every_export_names_the_policy_as_its_record_does(policy):
    record = RECOMPUTE_POLICIES[policy]
    plan = _plan_for("1f1b", policy)
    args = megatron_args(megatron(plan).text)
    if policy == "discard":                     # Llama 3 has no MoE block and no MLA: it frees nothing there
        assert "--recompute-granularity" not in args and "--recompute-modules" not in args
        assert any("frees nothing in this model" in n for n in megatron(plan).notes)
    elif record.megatron:                       # "--recompute-granularity X"
        assert args["--recompute-granularity"] == [record.megatron.split()[-1]]
    elif record.megatron is None:               # no such policy there: whole blocks recomputed, said in a note
        assert args["--recompute-granularity"] == ["full"]
        assert any(record.title in n for n in megatron(plan).notes), policy
    else:
        assert "--recompute-granularity" not in args
    titan = torchtitan(plan)
    settings = tomllib.loads(titan.text)["activation_checkpoint"]
    if record.torchtitan:
        assert settings == dict(record.torchtitan), policy
    else:
        assert any("torchtitan has no" in n for n in titan.notes), policy


def test_a_record_renamed_is_still_read_from_an_earlier_plan_json():
    """A schema-1 plan.json (before the rename) names optimizer offload "offload": "optimizer" and the
    activation policy "offload"; the one reader reads both under their names now."""
    from planner.plan import Plan
    doc = _plan_for("1f1b", "activation-offload").to_json()
    old = replace_json(doc, schema_version=1)
    config = old["config"]
    config["offload"] = "optimizer" if config.pop("optimizer_offload") else "none"
    config["recompute"] = "offload"
    old["recompute_per_layer"] = {k: ("offload" if v == "activation-offload" else v)
                                  for k, v in old["recompute_per_layer"].items()}
    plan = Plan.from_json(old)
    assert plan.config.recompute == "activation-offload" and plan.config.optimizer_offload is False
    assert set(plan.recompute_per_layer.values()) == {"none", "activation-offload"}


def replace_json(doc: dict, **changes) -> dict:
    import json
    return {**json.loads(json.dumps(doc)), **changes}


def test_a_plan_is_made_with_the_schedule_record_it_names():
    plan = _plan_for("interleaved-1f1b")
    assert plan.config.vpp == 2 and len(plan.stages) == 4
    with pytest.raises(UserError, match="virtual stages"):
        fixed_plan("llama3-8b", "h100-80g", 8, replace(plan.config, schedule="1f1b", stage_layers=None),
                   framework="torch")
