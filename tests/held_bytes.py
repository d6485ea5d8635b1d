"""What a forward leaves alive for backward, whatever holds it.

Saved-tensor hooks see what autograd saves, but not everything a recompute policy keeps: selective
checkpointing caches op outputs in its own dispatch mode, and a checkpoint holds its inputs in a
closure. So this counts by liveness: ``CreatedStorages`` records (weakly) every storage an op creates
while it is active; after the forward, the storages still alive and not held by the caller are what
the forward left for backward. Each storage counts once, however many tensors view it.
"""
from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from executor.activations import HostStash, apply_policy, offload_forward


class CreatedStorages(TorchDispatchMode):
    """Every storage the ops create while the mode is active: {key: (weak reference, bytes)}."""

    def __init__(self):
        super().__init__()
        self.created: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.created[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        """Bytes of the created storages still alive, but those keyed in ``exclude``."""
        gc.collect()
        return sum(n for key, (ref, n) in self.created.items() if key not in exclude and not ref.expired())


def storage_keys(tensors) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors}


def _apply(block: torch.nn.Module, policy: str, stashes: list[HostStash], attention_core) -> None:
    """``policy`` on ``block``, each offload stash recorded in ``stashes``."""
    if policy == "activation-offload":
        block.forward = offload_forward(block, on_stash=stashes.append)
    else:
        apply_policy(block, policy, attention_core=attention_core)


def _held(mode: CreatedStorages, stashes: list[HostStash], keep: list[torch.Tensor]) -> tuple[int, int]:
    """(device bytes, host bytes) left alive: ``keep`` (the caller's output and parameters) excluded, what
    offload moved counted on the host."""
    host = {key for s in stashes for key in storage_keys(s.host.values())}
    return mode.alive_bytes(storage_keys(keep) | host), sum(s.host_bytes for s in stashes)


def block_held_bytes(block: torch.nn.Module, policy: str, x: torch.Tensor, *, attention_core=None
                     ) -> tuple[int, int]:
    """(device bytes, host bytes) one forward of ``block`` under recompute ``policy`` keeps for its backward,
    for the input ``x``: the storages its forward created that are still alive after it (its parameters and
    its output excluded), its input if the forward holds it, and what the ``offload`` policy moved to host
    memory (counted as host bytes, not device bytes). Runs the backward after, so that the policy is
    exercised whole."""
    stashes: list[HostStash] = []
    _apply(block, policy, stashes, attention_core)
    x = x.detach().requires_grad_() * 1.0           # a non-leaf input: nothing but the forward can hold it
    x_ref, x_bytes = StorageWeakRef(x.untyped_storage()), x.untyped_storage().nbytes()
    mode = CreatedStorages()
    with mode:
        y = block(x)
    del x
    device, host = _held(mode, stashes, [y, *block.parameters()])
    device += 0 if x_ref.expired() else x_bytes
    y.backward(torch.ones_like(y))
    return device, host


def model_held_bytes(model, policies: dict[str, str], ids: torch.Tensor, targets: torch.Tensor, *,
                     attention_core=None) -> tuple[int, int]:
    """(device bytes, host bytes) a whole forward of meshplan's ``model`` (executor/models.py) and its loss
    (the trainer's: mean cross-entropy on fp32 logits) keep for backward, with each block's recompute
    policy from ``policies`` (layer path -> policy). Runs the backward after."""
    stashes: list[HostStash] = []
    for index, block in model.layers.items():
        _apply(block, policies.get(f"layers.{index}", "none"), stashes, attention_core)
    mode = CreatedStorages()
    with mode:
        inputs = ids.clone()                        # (B, S): the embedding may hold them, the caller does not
        logits = model(inputs)                                                    # (B, S, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    del inputs, logits
    held = _held(mode, stashes, [loss, *model.parameters()])
    loss.backward()
    return held
