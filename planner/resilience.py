"""What node failures cost a job: its step time with one and two nodes fewer, and how often to checkpoint.

With one and two nodes fewer the job is planned again as `meshplan run --elastic` plans it when nodes
are lost (planner/replan.py: the same job and fixed knobs, the search's answer for the GPUs left).

How often to checkpoint: between two checkpoints a job loses, to a failure, the work since the last
one, and each checkpoint costs the time to write it. The interval that loses least is

    Young 1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9):530-531:
        tau = sqrt(2 delta M)
    Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    Future Generation Computer Systems 22(3):303-312, its higher-order estimate:
        tau = sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) + (1/9) (delta / 2M)] - delta   for delta < 2M
        tau = M                                                                             for delta >= 2M

with delta the time to write one checkpoint and M the job's mean time between failures: a node's,
over the job's nodes (failures of independent nodes add up). The share of time lost at an
interval tau is, to first order (Young 1974), delta / tau (writing checkpoints) plus tau / 2M (the
work redone after a failure, half an interval on average).

A node's mean time between failures, when none is given: Llama 3 405B's pre-training (Llama Team 2024,
"The Llama 3 Herd of Models", arXiv:2407.21783, Section 3.3.4) had 419 unexpected interruptions in a
54-day snapshot on 16,384 H100 GPUs, 2,048 nodes of 8: 2,048 x 54 x 24 h / 419 = 6,335 node-hours.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import UserError

LLAMA3_NODE_MTBF_H = 2048 * 54 * 24 / 419       # 6,335 h: see the module docstring
LLAMA3_SOURCE = ("Llama 3 405B's pre-training: 419 unexpected interruptions in 54 days on 2,048 nodes of 8 H100 "
                 "(Llama Team 2024, 'The Llama 3 Herd of Models', Section 3.3.4)")
CHECKPOINT_WRITE_S = (10.0, 60.0, 300.0)       # the writes a report tabulates: a few seconds to minutes


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young 1974: the checkpoint interval that loses least work to first order, sqrt(2 delta M)."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly 2006's higher-order estimate of the optimum checkpoint interval (module docstring)."""
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    r = checkpoint_s / (2 * mtbf_s)
    return young_interval_s(checkpoint_s, mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - checkpoint_s


def lost_share(interval_s: float, checkpoint_s: float, mtbf_s: float) -> float:
    """Young 1974, to first order: the share of time spent writing checkpoints and redoing lost work."""
    return checkpoint_s / interval_s + interval_s / (2 * mtbf_s)


def job_mtbf_s(node_mtbf_h: float, nodes: int) -> float:
    """The job's mean time between failures: a node's over its ``nodes`` (independent failures add up)."""
    if not node_mtbf_h > 0 or math.isinf(node_mtbf_h):
        raise UserError(f"must be a positive number of hours, got {node_mtbf_h!r}", field="--node-mtbf")
    return node_mtbf_h * 3600 / nodes


@dataclass(frozen=True, kw_only=True)
class FewerNodes:
    """The job with ``lost`` nodes fewer: the plan there (None: nothing fits, or no GPU is left) and why not."""

    lost: int
    gpus: int
    plan: object | None = None         # planner.plan.Plan
    why_not: str = ""


def fewer_nodes(plan, lost: int) -> FewerNodes:
    """``plan``'s job planned again with ``lost`` of its nodes gone (planner/replan.py)."""
    from .replan import replan
    gpus = plan.world_size - lost * plan.gpus_per_node
    if gpus < 1:
        return FewerNodes(lost=lost, gpus=gpus, why_not="no GPU left: the job stops")
    try:
        return FewerNodes(lost=lost, gpus=gpus, plan=replan(plan, gpus).plan)
    except UserError as e:          # NoFeasiblePlan among them
        return FewerNodes(lost=lost, gpus=gpus, why_not=e.detail.split("; ")[0])
