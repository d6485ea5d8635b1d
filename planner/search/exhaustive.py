"""The reference solver: every choice the stage ILP makes, enumerated one by one.

For a group it lists every way to give each rank at least v blocks (its virtual
stages one each), every recompute assignment of each rank's blocks, and every ZeRO
/ offload option, and prices each with the cost model's ``estimate``. It is as slow
as that sounds and exists to prove the ILP right on small models
(``meshplan plan --exhaustive``, tests/test_ilp.py).
"""
from __future__ import annotations

import itertools

from ..cost.step import estimate
from .stages import GroupProblem, compositions


def solve_group_exhaustively(pr: GroupProblem):
    """(counts per virtual stage by policy, option, step time, proven: True) of the best candidate that
    fits, or None (``ilp.solve_group``'s shape)."""
    cache = pr.cache
    best = None
    for per_rank_blocks in compositions(pr.num_blocks, pr.p, pr.v):
        per_rank_choices = [
            [dict(zip(pr.policies, split)) for split in compositions(blocks, len(pr.policies), 0)]
            for blocks in per_rank_blocks]
        for assignment in itertools.product(*per_rank_choices):
            counts = pr.spread_counts(list(assignment))
            for option in pr.options:
                config = pr.config(counts, option)
                est = estimate(cache.graph, cache.cluster, cache.workload, config, cache)
                if est.fits and (best is None or est.step_time_s < best[2]):
                    best = (counts, option, est.step_time_s, True)
    return best
