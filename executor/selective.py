"""Selective recompute of any layer: torch's selective activation checkpointing (SAC) with a policy
that recomputes the attention core.

"Selective" is Korthikanti et al. 2022, Sec 5: the attention core (QK^T, softmax, its dropout and
the attention over V) is recomputed in backward. In meshplan's own Transformer the core is one
call, which executor/parallelize.py checkpoints alone; in a module someone else wrote it is found
op by op, as the tracer finds it (planner/trace/classify.py):

- an SDPA kernel (``planner.trace.flops.SDPA_FORWARD``) is a whole core;
- a product of two tensors neither of which is a parameter (a linear multiplies by a weight; in a
  transformer layer the only activation-by-activation products are QK^T and the scores by V)
  starts the core when no input comes from the core (QK^T) and ends it when one does (by V);
- a softmax starts or continues the core, and so does every op that reads a tensor of the core
  (scaling, masks, dropout, views of the scores).

SAC checkpoints the whole layer and replays it in backward, each op either served from the cache
the forward filled or run again, so every op's output is either kept or recomputed: there is no
"kept only if autograd needs it". Keeping all that is not the core keeps more than no recompute
at all (the output projection before the residual add, each step of a rotary embedding): on the
block of tests/test_selective_recompute.py (batch 2, sequence 16, hidden 64, 4 heads) such a policy
held 213,764 bytes for backward against 180,740 without recompute (storages alive after forward,
torch 2.13 CPU). So the policy keeps what is costly to recompute and recomputes the cheap:

- MUST_RECOMPUTE: the attention core; pointwise ops (``torch.Tag.pointwise``: activations,
  residual adds, the scaling inside norms and rotary embeddings; memory-bound, no FLOPs to
  speak of), as torch's SAC examples and torchtitan's selective policy do;
- MUST_SAVE: everything else (linears and other products with a parameter, reductions, norm
  kernels, copies), and the views of kept tensors.

Three rules keep the replay exact:

- random ops (``torch.Tag.nondeterministic_seeded``: dropout's ``bernoulli_``) are recomputed,
  all of them, so the replay draws the same numbers in the same order (checkpoint restores the
  RNG state; an op served from the cache draws nothing);
- tensor factories (``empty_like``, ``zeros``...) are recomputed: they are filled in place next
  (CPU dropout is ``empty_like`` -> ``bernoulli_`` -> ``div_``), and a kept tensor mutated after
  it was cached is a stale cache entry;
- an in-place op follows its target: recomputed with a recomputed tensor, kept with a kept one.
  Kept, the cache holds the mutated tensor itself, so the replay does not apply the op twice;
  torch's check against mutated cache entries is switched off for that. nn.RMSNorm on CPU adds
  its epsilon in place to the mean it just computed (``pow`` -> ``mean`` -> ``add_`` ->
  ``rsqrt``): the kept mean *is* the mean plus epsilon, which is what the replay reads next. It
  would be wrong where a recomputed op read the tensor before the mutation, or where the target
  is one of the layer's inputs (the replay starts from them): the policy raises then, naming the
  op.

Views and in-place results share their input's storage, so the fate of each tensor is tracked by
storage: a view of a recomputed tensor is recomputed with it (keeping it would keep the storage,
the attention scores with it).
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from planner.errors import UserError
from planner.trace.flops import MATMULS, SDPA_FORWARD

SOFTMAXES = {"_softmax", "softmax", "_safe_softmax", "_masked_softmax"}
FACTORIES = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like",
             "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "scalar_tensor"}

SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE
KEPT, RECOMPUTED, CORE, STATE, INPUT = "kept", "recomputed", "core", "state", "input"   # the fates of storages


def _key(t: torch.Tensor) -> int:
    """The tensor's storage, by address (a wrapper's, such as a DTensor or a pending collective's
    result: the storage of the tensor it wraps). An address freed and handed out again is a new
    storage (``AttentionCorePolicy`` forgets what it knew of it). 0: no bytes."""
    while is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        t = getattr(t, attrs[0])
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else 0


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class AttentionCorePolicy:
    """The SAC policy of one forward of one layer (see the module docstring). ``params``: the storages
    of the layer's parameters (the operands that make a product a linear); ``state``: those and its
    buffers'. Any other storage the layer did not make is one of its inputs."""

    def __init__(self, params: set[int], state: set[int], layer: str):
        self.params, self.state, self.layer = params, state, layer
        self.made: dict[int, str] = {}            # storage made in this forward -> KEPT | RECOMPUTED | CORE
        self.read_by_recompute: set[int] = set()   # storages a recomputed op has read

    def fate(self, key: int) -> str:
        return self.made.get(key) or (STATE if key in self.state else INPUT)

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        inputs = _tensors((args, kwargs))
        keys = [_key(t) for t in inputs]
        fates = {self.fate(k) for k in keys}
        name = op.overloadpacket.__name__
        new = [k for k in (_key(t) for t in _tensors(ctx.op_output)) if k and k not in keys]
        self.read_by_recompute.difference_update(new)      # addresses of freed storages, handed out again
        mutated = {k for k, writes in zip(keys, _writes(op, args, kwargs)) if writes and k}
        if name in SDPA_FORWARD:
            return self._recompute(keys, new, RECOMPUTED)
        if name in MATMULS and not any(k in self.params for k in keys):
            return self._recompute(keys, new, RECOMPUTED if CORE in fates else CORE)   # by V ends it; QK^T starts it
        if name in SOFTMAXES or CORE in fates:
            return self._recompute(keys, new, CORE)
        targets = {self.fate(k) for k in mutated}
        if targets & {RECOMPUTED, CORE}:
            return self._recompute(keys, new, RECOMPUTED)
        if mutated and (INPUT in targets or mutated & self.read_by_recompute
                        or torch.Tag.nondeterministic_seeded in op.tags):
            raise UserError(f"{self.layer}: {op} changes in place a tensor that selective recompute cannot replay "
                            "(one of the layer's inputs, one a recomputed op read before, or a kept one it would "
                            "draw random numbers into); plan this layer with recompute none or full",
                            field="recompute")
        if mutated:
            return SAVE
        if torch.Tag.nondeterministic_seeded in op.tags or name in FACTORIES or (new and torch.Tag.pointwise in op.tags):
            return self._recompute(keys, new, RECOMPUTED)
        if not new and RECOMPUTED in fates:        # a view of a recomputed tensor
            return self._recompute(keys, new, RECOMPUTED)
        self.made.update((k, KEPT) for k in new)
        return SAVE

    def _recompute(self, keys: list[int], new: list[int], fate: str) -> CheckpointPolicy:
        self.read_by_recompute.update(k for k in keys if k)
        self.made.update((k, fate) for k in new)
        return RECOMPUTE


def _writes(op, args, kwargs) -> list[bool]:
    """For each tensor argument in order, whether the op writes to it (its schema's ``Tensor(a!)``)."""
    out = []
    for i, arg in enumerate(op._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        writes = bool(arg.alias_info and arg.alias_info.is_write)
        out += [writes] * len(_tensors(value))
    return out


def selective_forward(module: nn.Module, layer: str) -> Callable:
    """``module``'s own forward under SAC with ``AttentionCorePolicy``, to assign to ``module.forward``.
    The policy is made anew for each forward, with the parameters the module holds then (FSDP2
    gathers them before the forward)."""
    forward = type(module).forward.__get__(module)

    def context_fn():
        params = {_key(p) for p in module.parameters()}
        state = params | {_key(b) for b in module.buffers()}
        return create_selective_checkpoint_contexts(AttentionCorePolicy(params, state, layer),
                                                    allow_cache_entry_mutation=True)

    return partial(checkpoint, forward, use_reentrant=False, context_fn=context_fn)
