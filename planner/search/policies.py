"""Which recompute policies a group of candidates must decide between, and which is no slower.

The policies (planner/recompute.py) are not a total order: "op" recomputes less than "full" and keeps
more, "activation-offload" may add no time at all and keep nothing on the device but needs host memory and a
transient of two layers. What the search may use, per parallel context (the blocks' costs depend on
tp, sequence parallelism, the micro-batch...):

- a policy whose costs equal another's on every block (seconds added, device bytes kept, transient,
  host bytes) is the same candidate twice: only the first of ``POLICIES`` is kept ("selective" under
  flash attention keeps what "none" keeps and adds nothing);
- ``no_slower(a, b)``: every block adds at most as many seconds under ``a`` as under ``b``. The step
  time grows with the seconds a policy adds (they lengthen every rank's backward: the pipeline's own
  terms, planner/cost/step.py), so a candidate with ``b`` cannot beat the same candidate with ``a``;
  nothing is concluded about memory.
"""
from __future__ import annotations

from ..cost.layer import Context, LayerCost
from ..recompute import POLICIES, every_k


def _block_costs(cache, ctx: Context) -> list[tuple[LayerCost, int]]:
    """(cost, number of blocks like it) per distinct block signature."""
    out = []
    for sig, n in cache.signature_counts.items():
        if cache.graph.layers[cache.representative[sig]].is_block:
            out.append((cache.signature_cost(sig, ctx), n))
    return out


def _profile(costs: list[tuple[LayerCost, int]], policy: str) -> tuple:
    return tuple(c.policy(policy) for c, _ in costs)


def distinct_policies(cache, ctx: Context, policies) -> tuple[str, ...]:
    """``policies`` without exact duplicates, fastest first (by the seconds added over all blocks; ties in
    the order of ``POLICIES``). An ``every-K`` pattern stays as it is."""
    policies = list(policies)
    if any(every_k(p) for p in policies):
        return tuple(policies)
    memo = cache.__dict__.setdefault("_distinct_policies", {})
    key = (ctx, tuple(policies))
    if key not in memo:
        costs = _block_costs(cache, ctx)
        seen, kept = set(), []
        for policy in sorted(policies, key=POLICIES.index):
            profile = _profile(costs, policy)
            if profile not in seen:
                seen.add(profile)
                kept.append(policy)
        added = {p: sum(n * c.policy(p).recompute_s for c, n in costs) for p in kept}
        memo[key] = tuple(sorted(kept, key=lambda p: (added[p], POLICIES.index(p))))
    return memo[key]


def no_slower(cache, ctx: Context, a: str, b: str) -> bool:
    """Whether recomputing every block with ``a`` adds no more seconds than with ``b``, block by block."""
    if a == b:
        return True
    if every_k(a) or every_k(b):
        return False
    return all(c.policy(a).recompute_s <= c.policy(b).recompute_s for c, _ in _block_costs(cache, ctx))
