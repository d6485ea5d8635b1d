"""``auto_parallelize``: one call inside a torchrun job turns a module into data-parallel training.

What it does, in order:
1. reads the live world (process count, device) from the job;
2. describes the module as layers: ``planner.trace.trace`` where the tracer is installed,
   else one layer per top-level child with its parameter count (an honest fallback:
   no FLOPs, no activations);
3. chooses the plan: data parallelism over every rank, with the lowest ZeRO stage whose
   model states fit the device (planner/cost/memory.py's bytes per parameter; without a
   cluster profile, ZeRO-0). Tensor and pipeline parallelism need the planner's search
   over a traced graph, which the executor does not import (plan.json is the contract);
4. applies it: ZeRO-0 as DDP, ZeRO-2/3 as FSDP2 ``fully_shard`` per layer and at the
   root, after broadcasting rank 0's weights so every rank starts from the same model;
5. returns the module, an AdamW optimizer and a step function.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from planner.cluster import load_cluster
from planner.cost.memory import state_bytes_per_param
from planner.errors import UserError


@dataclass(frozen=True, kw_only=True)
class AutoPlan:
    """What auto_parallelize chose, and why."""

    dp: int
    zero: int
    layers: tuple[str, ...]          # module paths that became FSDP units
    params: int
    state_bytes_per_gpu: float       # parameters + gradients + optimizer states on one rank
    capacity_bytes: float | None     # the device's memory less the runtime's reserve (None: no profile)
    source: str                      # "planner.trace" or "top-level children"


class ParallelTraining:
    """The parallel module, its optimizer, and ``step(inputs, targets) -> loss`` on this rank's batch."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, plan: AutoPlan):
        self.module, self.optimizer, self.loss_fn, self.plan = module, optimizer, loss_fn, plan

    def step(self, inputs, targets) -> float:
        """One optimizer step on this rank's share of the global batch; returns the mean loss over
        all ranks (equal shares: the global batch's mean)."""
        loss = self.loss_fn(self.module(inputs), targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.detach().float().reshape(1).clone()
        dist.all_reduce(value)
        return value.item() / dist.get_world_size()


def _layers(module: nn.Module, example_inputs) -> tuple[list[tuple[str, int]], str]:
    """(module path, parameters) per layer, and where the description came from."""
    try:
        from planner.trace import trace
    except ImportError:
        trace = None
    if trace is not None:
        graph = trace(module, example_inputs)
        return [(layer.name, layer.params) for layer in graph.layers], "planner.trace"
    return ([(name, sum(p.numel() for p in child.parameters())) for name, child in module.named_children()],
            "top-level children")


def choose_zero(params: int, *, world: int, cluster: str | None, precision: str = "fp32") -> tuple[int, float, float | None]:
    """(ZeRO stage, model-state bytes per rank, capacity): the lowest stage that fits the profile's
    device memory; ZeRO-1 is skipped (it needs DDP plus ZeroRedundancyOptimizer: ZeRO-2 shards
    more for the same communication)."""
    if cluster is None:
        s = state_bytes_per_param(framework="torch", precision=precision, zero=0, shard=world, offload="none")
        return 0, params * (s.params + s.grads + s.optimizer), None
    device = load_cluster(cluster, world).device
    capacity = device.memory_bytes - device.reserved_bytes
    need = 0.0
    for zero in (0, 2, 3):
        s = state_bytes_per_param(framework="torch", precision=precision, zero=zero, shard=world, offload="none")
        need = params * (s.params + s.grads + s.optimizer)
        if need <= capacity:
            return zero, need, capacity
    raise UserError(f"the model's {params:,} parameters need {need / 2**30:.2f} GiB of model states per rank even "
                    f"with ZeRO-3 over {world} ranks, more than the {capacity / 2**30:.2f} GiB the profile gives; "
                    "use more processes or a profile with more memory", field="cluster")


def _device() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def auto_parallelize(module: nn.Module, example_inputs, *, global_batch: int, cluster: str | None = None,
                     loss_fn: Callable | None = None, lr: float = 1e-3) -> ParallelTraining:
    """Plan ``module`` for the live torchrun world and apply the plan (see the module docstring)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise UserError("auto_parallelize runs inside a torchrun job (no RANK in the environment); "
                            "launch with torchrun --nproc-per-node N your_script.py", field="environment")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    if global_batch % world:
        raise UserError(f"global batch {global_batch} is not a multiple of the {world} processes", field="global_batch")
    device = _device()
    module = module.to(device)
    layers, source = _layers(module, example_inputs)
    params = sum(p.numel() for p in module.parameters())
    zero, need, capacity = choose_zero(params, world=world, cluster=cluster)
    with torch.no_grad():                       # every rank starts from rank 0's weights
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0)
    named = dict(module.named_modules())
    units = tuple(name for name, count in layers if count and name in named and name)
    if zero == 0:
        from torch.nn.parallel import DistributedDataParallel
        module = DistributedDataParallel(module, gradient_as_bucket_view=True)
    else:
        from torch.distributed.fsdp import fully_shard
        for name in units:
            fully_shard(named[name], reshard_after_forward=zero == 3)
        fully_shard(module, reshard_after_forward=zero == 3)
    plan = AutoPlan(dp=world, zero=zero, layers=units, params=params, state_bytes_per_gpu=need,
                    capacity_bytes=capacity, source=source)
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr, foreach=False)
    return ParallelTraining(module, optimizer, loss_fn or nn.functional.mse_loss, plan)
