"""What a rank really holds, by the cost model's categories (planner/cost/memory.py).

Bytes are counted per storage, once, however many tensors view it:

- parameters: the rank's parameter storage (its shards under TP/FSDP), and separately the
  gathered copies FSDP holds from the end of forward to backward (``params_gathered``);
- gradients: the storage of ``.grad`` after backward (DDP: its buckets; FSDP: the shards), or
  where more, the unsharded gradients a pipeline accumulates under FSDP before its one
  reduce-scatter (``unsharded_grad_bytes``, seen at the end of each forward);
- optimizer: the optimizer's state tensors after a step (AdamW: exp_avg, exp_avg_sq, step);
- host: what optimizer offload keeps in host memory instead, left out of the three above:
  FSDP2's CPU-offloaded parameter shards, their gradients and their optimizer states, and
  ZeRO-1's offloaded optimizer states (``ShardedAdamW.offload``). Told apart by what the
  executor asked for (the FSDPParam's ``offload_to_cpu``), not by the tensor's device: on a
  CPU run the device is the host;
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


def _fsdp_params(modules: Iterable[nn.Module]):
    """FSDP2's record (FSDPParam) of every parameter it manages under ``modules``."""
    from torch.distributed.fsdp import FSDPModule
    for root in modules:
        for module in root.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            yield from (group.fsdp_params if group is not None else ())


def offloaded_params(modules: Iterable[nn.Module]) -> set[int]:
    """ids of the parameters FSDP2 keeps in host memory (``CPUOffloadPolicy``)."""
    return {id(fp.sharded_param) for fp in _fsdp_params(modules) if fp.offload_to_cpu}


def padded_shards(modules: Iterable[nn.Module]) -> dict[int, int]:
    """{id of a parameter FSDP2 shards: the elements of its padded shard}: FSDP2 allocates every rank's shard, and the
    reduce-scattered gradient, as large as the first rank's (torch.chunk's piece), padding the last ranks' where the
    sharded dimension does not divide (torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``_init_sharded_param``)."""
    return {id(fp.sharded_param): fp.padded_sharded_param_size.numel() for fp in _fsdp_params(modules)}


def param_bytes(modules: Iterable[nn.Module], host: bool = False) -> int:
    """Bytes of the parameters on the device (``host``: those optimizer offload keeps in host memory), with an NF4
    weight's quantization constants (executor/qlora.py)."""
    modules = list(modules)
    offloaded = offloaded_params(modules)
    return storage_bytes(p for m in modules for p in m.parameters() if (id(p) in offloaded) == host) + (
        0 if host else storage_bytes(t for m in modules for t in quantization_constants(m)))


def quantization_constants(module: nn.Module) -> list[torch.Tensor]:
    """The tensors of the ``quant_state`` of ``module``'s NF4 weights (bitsandbytes' QuantState: the blocks' absmaxes,
    their own absmaxes under double quantization, the two code tables)."""
    out = []
    for m in module.modules():
        state = getattr(m, "quant_state", None)
        while state is not None:
            out += [t for t in (state.absmax, state.code) if isinstance(t, torch.Tensor)]
            state = getattr(state, "state2", None)
    return out


def grad_bytes(modules: Iterable[nn.Module], host: bool = False) -> int:
    """Bytes of the gradients on the device (``host``: those of offloaded parameters)."""
    offloaded = offloaded_params(modules)
    return storage_bytes(p.grad for m in modules for p in m.parameters()
                         if p.grad is not None and (id(p) in offloaded) == host)


def optimizer_bytes(optimizer, modules: Iterable[nn.Module] = (), host: bool = False) -> int:
    """State tensors of the rank's optimizer on the device (``host``: those in host memory: all of an
    offloaded ZeRO-1 optimizer's, and those of ``modules``' offloaded parameters)."""
    inner = getattr(optimizer, "optim", optimizer)
    offloaded = offloaded_params(modules)
    whole = getattr(optimizer, "offload", False)
    return storage_bytes(v for p, state in inner.state.items() for v in state.values()
                         if isinstance(v, torch.Tensor) and (whole or id(p) in offloaded) == host)


def state_bytes(modules: Iterable[nn.Module], optimizers: Iterable) -> int:
    """Bytes of the model states alive now, on the device and in host memory alike (one memory on a
    CPU): parameters, gradients, optimizer states, each storage once."""
    modules = list(modules)
    params = [p for m in modules for p in m.parameters()]
    states = [v for o in optimizers for state in getattr(o, "optim", o).state.values() for v in state.values()
              if isinstance(v, torch.Tensor)]
    return storage_bytes([*params, *(p.grad for p in params), *states])


def _fsdp_params(modules: Iterable[nn.Module]):
    """The FSDPParams of every FSDP module under ``modules``, each once (the modules of one unit share
    its group: a MoE block's experts, executor/parallelize.py ``apply_expert_dp``)."""
    from torch.distributed.fsdp import FSDPModule
    seen = set()
    for root in modules:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None and id(group) not in seen:
                    seen.add(id(group))
                    yield from group.fsdp_params


def unsharded_grad_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of FSDP's unsharded gradients alive now: those a pipeline accumulates over its micro-
    batches when it defers the reduce-scatter to the last backward (torch.distributed.pipelining
    turns FSDP's gradient sync off for every other backward; planner/runtimes.py
    ``pp_defers_sharded_dp_sync``): the fp32 accumulator and the last backward's gradient."""
    total = 0
    for fsdp_param in _fsdp_params(modules):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        for grad in (fsdp_param.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad):
            if grad is not None:
                local = _local(grad)
                total += local.numel() * local.element_size()
    return total


def gathered_param_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of FSDP's gathered (unsharded) parameters alive now, beyond the shards."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    total = 0
    for fsdp_param in _fsdp_params(modules):
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


class AllocationPeak:
    """The most host memory a step had allocated at once, above what was allocated when it began:
    torch's profiler with ``profile_memory`` reports every CPU allocation and free while it runs
    (c10's ProfiledCPUMemoryReporter, behind the default CPU allocator), and the peak is the
    largest running sum of those, in time order. The CPU has no ``max_memory_allocated``; this is
    its stand-in, and unlike the saved-tensor meter it sees everything the step allocates: the
    activations a checkpointed region rebuilds in backward, the loss's backward workspace, the
    gradients, collective buffers, temporaries. Frees of tensors allocated before it started are not
    reported (c10 only reports frees of the allocations it saw), so what the step frees of its
    predecessor's tensors is not subtracted: an upper bound where the step frees old tensors."""

    def __init__(self):
        self.peak_bytes = 0
        self.gemm: dict | None = None

    @contextmanager
    def track(self):
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_flops=True) as prof:
            yield self
        events = prof.profiler.kineto_results.events()
        self.peak_bytes = allocation_peak(events)
        self.gemm = gemm_achieved(events)


def allocation_peak(events) -> int:
    """Largest running sum of the CPU ``[memory]`` events' signed sizes (allocations positive, frees
    negative), taken in time order."""
    running = peak = 0
    memory = sorted((e for e in events if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    for e in memory:
        running += e.nbytes()
        peak = max(peak, running)
    return peak


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def gemm_achieved(events) -> dict | None:
    """The step's matrix products as they ran: their FLOPs (the profiler's count from the input
    shapes, ``with_flops``: 2 m n k per product) over their time, innermost calls only (a DTensor's
    product shows as an outer ``aten::mm`` around the local one that does the work). Beside the
    profile's GEMM rate it tells how much of a step's error is the machine running at another speed
    than when it was profiled, and how much the model; None if the step ran no product."""
    by_thread: dict[int, list] = {}
    for e in events:
        if e.name() in GEMM_OPS and e.device_type() == torch.autograd.DeviceType.CPU:
            by_thread.setdefault(e.start_thread_id(), []).append(e)
    flops = ns = 0
    for calls in by_thread.values():
        calls.sort(key=lambda e: e.start_ns())
        for this, after in zip(calls, calls[1:] + [None]):
            if after is not None and after.start_ns() < this.end_ns():
                continue                # it contains the next product: an outer call
            flops += this.flops()
            ns += this.duration_ns()
    if not ns or not flops:
        return None
    return {"flops": flops, "seconds": ns / 1e9, "tflops": flops / ns / 1e3}
