"""Activation recompute policies: their names, what each one is (with its source), and the
every-k-th-layer pattern.

A policy decides what one transformer block keeps for backward and what it redoes or moves;
the cost model prices each one (planner/cost/layer.py), the stage ILP chooses one per block
among those the runtime runs (planner/runtimes.py), the executor applies them
(executor/recompute.py). ``every-K`` is not a policy of its own: it is a pattern of the
plan, full recompute on every K-th block and none on the others (torchtitan's layer-wise
selective checkpointing), expanded into the per-layer policies; ``ParallelConfig.recompute`` names it
(``every-K``) beside them.
"""
from __future__ import annotations

import re

from .errors import UserError, one_of

# The per-block policies, in the order the cost model's tuples are indexed by (LayerCost).
POLICIES = ("none", "selective", "op", "full", "offload")

# One line each: the CLI's --recompute help, the README and the reports say the same.
DESCRIPTIONS = {
    "none": "keep every activation autograd saves",
    "selective": "recompute the attention core only (Korthikanti et al. 2022, Sec 5; Megatron-LM "
                 "--recompute-granularity selective); saves nothing under flash attention, which keeps no scores",
    "op": "operator-level selective checkpointing: keep the outputs of matmuls (every other mm), attention and "
          "reduce-scatters, recompute the rest (torchtitan SelectiveAC, selective_ac_option 'op', with "
          "torch.utils.checkpoint.create_selective_checkpoint_contexts)",
    "full": "keep the block's input only and recompute the block before its backward (Chen et al. 2016; "
            "Megatron-LM --recompute-granularity full)",
    "offload": "move the block's saved activations to host memory in forward and back in backward, over the "
               "host link and beside compute (torch saved-tensor hooks; torchtune OffloadActivations)",
}
EVERY_K_DESCRIPTION = "full recompute on every K-th block, none on the others (torchtitan selective_ac_option = 'K')"

_EVERY = re.compile(r"every-(\d+)")


def every_k(policy: str | None) -> int | None:
    """K of an ``every-K`` pattern, or None for a per-block policy (or nothing)."""
    match = _EVERY.fullmatch(policy or "")
    return int(match.group(1)) if match else None


def parse_recompute(text: str, field: str = "--recompute") -> str:
    """A --recompute value: a policy of ``POLICIES`` or ``every-K`` with K >= 1; UserError otherwise."""
    if text in POLICIES:
        return text
    k = every_k(text)
    if k is not None and k >= 1:
        return f"every-{k}"
    if k is not None or text.startswith("every-"):
        raise UserError(f"{text!r}: K must be a positive integer (every-1 is full recompute on every block)",
                        field=field)
    raise UserError(f"{text!r} is not allowed; allowed: {one_of(POLICIES + ('every-K',))}", field=field)


def every_k_layers(graph, k: int) -> tuple[str, ...]:
    """The per-layer policies of ``every-K``: full on the K-th, 2K-th, ... transformer block (counted from 1
    in model order, as torchtitan's ``_apply_layer_sac`` counts the blocks it wraps), none elsewhere."""
    out, n = [], 0
    for layer in graph.layers:
        if layer.is_block:
            n += 1
            out.append("full" if n % k == 0 else "none")
        else:
            out.append("none")
    return tuple(out)


def policy_rank(name: str) -> int:
    """The order of ``POLICIES`` (simplest first), an ``every-K`` pattern ranked with full recompute."""
    return POLICIES.index("full" if every_k(name) else name)


def summary_policy(policies) -> str:
    """One policy naming a per-layer mix (ParallelConfig.recompute): the only one used, else the last of
    ``POLICIES`` among those used (the per-layer list says the rest)."""
    used = set(policies) - {"none"}
    return max(used, key=POLICIES.index) if used else "none"


def expand_recompute(config, policy: str, graph):
    """``config`` recomputing every block with ``policy``, or per layer in the ``every-K`` pattern."""
    k = every_k(policy)
    if k is None:
        return config.but(recompute=policy, recompute_layers=None)
    return config.but(recompute=f"every-{k}", recompute_layers=every_k_layers(graph, k))
