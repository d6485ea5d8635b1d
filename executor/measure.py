"""What a rank really holds, by the cost model's categories (planner/cost/memory.py).

Bytes are counted per storage, once, however many tensors view it:

- parameters: the rank's parameter storage (its shards under TP/FSDP), and separately the
  gathered copies FSDP holds from the end of forward to backward (``params_gathered``);
- gradients: the storage of ``.grad`` after backward (DDP: its buckets; FSDP: the shards);
- optimizer: the optimizer's state tensors after a step (AdamW: exp_avg, exp_avg_sq, step);
- activations: the peak of the bytes autograd keeps for backward, counted through
  saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded.
  A checkpointed region's inputs are saved through autograd and counted; the activations
  it rebuilds inside backward live in the checkpoint's own frame and are not seen.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s bytes on this rank (a DTensor's shard, a pending collective's
    result)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def param_bytes(modules: Iterable[nn.Module]) -> int:
    return storage_bytes(p for m in modules for p in m.parameters())


def grad_bytes(modules: Iterable[nn.Module]) -> int:
    return storage_bytes(p.grad for m in modules for p in m.parameters() if p.grad is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """State tensors of the rank's optimizer (ZeroRedundancyOptimizer: its local shard's)."""
    inner = getattr(optimizer, "optim", optimizer)
    return storage_bytes(v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def gathered_param_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of FSDP's gathered (unsharded) parameters alive now, beyond the shards."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    total = 0
    for root in modules:
        for module in root.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                if fsdp_param.sharded_state != ShardedState.UNSHARDED:
                    continue
                gathered = _local(fsdp_param._unsharded_param)
                shard = _local(fsdp_param.sharded_param)
                if gathered.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr():
                    total += gathered.numel() * gathered.element_size()
    return total


class _Held:
    """What a pack hook returns: the saved tensor, and its share of the meter's count until freed."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: "SavedTensorMeter", key: int | None, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self):
        if self.key is not None:
            self.meter._release(self.key)


class SavedTensorMeter:
    """Live and peak bytes of the tensors autograd keeps for backward (parameters excluded)."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}          # storage ptr -> [holders, bytes]

    def _param_storages(self) -> set[int]:
        return {_local(p).untyped_storage().data_ptr() for m in self.modules for p in m.parameters()}

    def _pack(self, tensor: torch.Tensor) -> _Held:
        storage = _local(tensor).untyped_storage()
        key = storage.data_ptr()
        if key in self._param_storages() or storage.nbytes() == 0:
            return _Held(self, None, tensor)
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, storage.nbytes()]
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1
        return _Held(self, key, tensor)

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._refs[key]

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    @contextmanager
    def track(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self
