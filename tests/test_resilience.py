"""When nodes fail (planner/resilience.py): the checkpoint interval of Young 1974 and Daly 2006 against
numbers worked out by hand here, the report's section, and the job planned again with nodes fewer
(planner/replan.py: the knobs a count cannot hold searched instead)."""
from __future__ import annotations

import math

import pytest

from planner import api
from planner.errors import UserError
from planner.replan import replan
from planner.resilience import (LLAMA3_NODE_MTBF_H, daly_interval_s, fewer_nodes, job_mtbf_s, lost_share,
                                young_interval_s)


def test_young_and_daly_against_numbers_worked_by_hand():
    # a 60 s checkpoint, a failure every 50 h (180,000 s): Young sqrt(2 x 60 x 180,000) = sqrt(21,600,000) = 4,647.6 s;
    # Daly: delta / 2M = 1/6,000, sqrt = 0.0129099; x (1 + 0.0129099 / 3 + 1 / 54,000) = 1.0043218, less 60 s
    assert young_interval_s(60, 180_000) == pytest.approx(4647.58, abs=0.01)
    assert daly_interval_s(60, 180_000) == pytest.approx(4647.58 * 1.0043218 - 60, abs=0.05)
    # a checkpoint as long as two mean times between failures, or longer: checkpoint every M (Daly)
    assert daly_interval_s(400, 200) == 200 and daly_interval_s(400, 199) == 199


def test_young_minimises_the_first_order_loss_and_daly_tends_to_it():
    m, delta = 36_000.0, 30.0
    tau = young_interval_s(delta, m)
    assert lost_share(tau, delta, m) < min(lost_share(0.9 * tau, delta, m), lost_share(1.1 * tau, delta, m))
    assert lost_share(tau, delta, m) == pytest.approx(math.sqrt(2 * delta / m))      # delta/tau + tau/2M at the optimum
    assert daly_interval_s(1e-3, 1e9) == pytest.approx(young_interval_s(1e-3, 1e9), rel=1e-5)


def test_the_default_node_mtbf_is_llama3s_and_a_job_fails_as_often_as_its_nodes_together():
    assert LLAMA3_NODE_MTBF_H == pytest.approx(6334.6, abs=0.1)        # 2,048 x 54 x 24 / 419
    assert job_mtbf_s(1000, 10) == 360_000
    with pytest.raises(UserError, match="--node-mtbf"):
        job_mtbf_s(0, 10)


def test_replanning_searches_the_knobs_a_count_cannot_hold_and_keeps_the_others():
    plan = api.plan(api.load_job("llama3-8b", "h100-80g", gpus=16, global_batch=64), api.Knobs(dp=4, zero=1))
    assert plan.knobs == {"dp": 4, "zero": 1} and plan.cluster_source == "h100-80g"
    half = replan(plan, 8)
    assert half.plan.world_size == 8 and half.plan.config.zero == 1 and half.plan.config.dp == 4
    assert half.dropped == ()
    two = replan(plan, 2)
    assert two.plan.world_size == 2 and two.plan.config.zero == 1 and two.plan.knobs == {"zero": 1}
    assert two.dropped == ("--dp 4 searched instead: dp 4 does not divide the 2 GPUs",)


def test_the_report_section_gives_the_step_with_nodes_fewer_and_the_checkpoint_interval():
    from planner.report.document import resilience
    plan = api.plan(api.load_job("llama3-8b", "h100-80g", gpus=16, global_batch=64))
    fewer = [fewer_nodes(plan, lost) for lost in (1, 2)]
    assert fewer[0].plan.world_size == 8 and fewer[1].plan is None and fewer[1].why_not.startswith("no GPU left")
    section = resilience(plan, fewer, node_mtbf_h=1000, mtbf_source="as given")
    rows = section.table.rows
    assert [r[:2] for r in rows] == [("2", "16"), ("1", "8"), ("0", "0")]
    assert rows[1][3] == f"{fewer[0].plan.best.estimate.step_time_s:.3f}" and rows[1][4].startswith("+")
    assert "every 1,000 hours" in section.bullets[0] and "a failure every 500.0 hours" in section.bullets[0]
    tau = daly_interval_s(60, 500 * 3600)
    assert f"checkpoint written in 60 s: every {tau / 60:,.1f} min" in section.bullets[2]
