"""``auto_parallelize``: one call inside a torchrun job plans a module for the live world and applies it.

What it does, in order:
1. reads the live world (process count, device) from the job, and makes every rank start
   from rank 0's weights;
2. on rank 0 only: traces the module as it will run (``planner.trace.trace(..., runnable=True)``: its
   layers, FLOPs, activations, which ``nn.Linear`` modules tensor parallelism can split, and whether the
   module can be cut into pipeline stages, by torch.fx or by a ``transformers`` decoder's module paths:
   planner/trace/cut.py; where it cannot, the search keeps pp at 1) and plans it with the planner as a library call
   (``planner.api.plan_graph``: the same search as ``meshplan plan``, over dp, tp, pp, ZeRO,
   micro-batch, schedule and recompute, and ep for a transformers mixture of experts: planner/trace/experts.py),
   for ``cluster`` (a profile name or TOML; default cpu-gloo) with as many GPUs as the job has processes. The
   plan.json document is broadcast, so every rank applies the same plan (or raises the same error);
3. applies it with the functions that apply meshplan's own models' plans (executor/parallelize.py,
   in its order): the pipeline stages of this rank (executor/pipeline.py ``split_pipeline``; a parameter
   the first and last stage share, as a tied embedding and head, has its gradient summed by the pair), TP
   styles, expert parallelism (executor/moe.py ``apply_ep``), recompute, then FSDP2 / replicate / DDP by ZeRO stage
   (the experts' over their expert-data-parallel ranks), and the pipeline schedule; mixed
   precision as meshplan's own models take it: where the device has it, FSDP2's
   MixedPrecisionPolicy (16-bit compute, fp32 gradient reduction) where FSDP2 manages the
   parameters, autocast otherwise; fp32 on a CPU;
4. returns a ``ParallelTraining``: the parallel module(s), their optimizers, ``step`` and the plan.

The knobs the executor cannot run on an arbitrary module are fixed before the search: no
context parallelism, no sequence parallelism (which dimension of a user's tensor is the sequence
is not known), no optimizer offload.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from planner.config import PRECISIONS
from planner.errors import UserError, one_of
from planner.plan import Plan
from planner.schedules import SCHEDULES, rank_chunk

from .integrity import check_world_size
from .mesh import ParallelDims, from_rank0, init_process_group, local_device
from .parallelize import autocast_dtype, dp_units, parallelize
from .pipeline import (build_schedule, placement, split_pipeline, stage_indices, sync_shared_grads,
                       tied_across_stages, tied_pairs)
from .support import DEFAULT_TIMEOUT_S, runnable_schedule
from .train import accumulate, global_loss, make_optimizer, optimizer_step, schedule_step

DEFAULT_CLUSTER = "cpu-gloo"
SOURCE = "auto_parallelize plan"        # how errors name the plan document


@dataclass(frozen=True, kw_only=True)
class AutoPlan:
    """What auto_parallelize runs: the planner's plan for this module and world, as applied."""

    doc: dict                              # the plan.json document (json.dump it to keep it)
    dp: int
    tp: int
    pp: int
    zero: int                              # the ZeRO stage
    ep: int = 1                            # expert parallelism: routed experts split over ep of the dp ranks
    precision: str                         # the plan's: fp32, bf16 or fp16
    autocast: str | None                   # the dtype the forward autocasts to (None: FSDP2's policy, or fp32)
    schedule: str | None                   # the pipeline schedule (None without a pipeline)
    num_microbatches: int
    stages: tuple[tuple[str, ...], ...]    # layer paths per virtual stage
    tp_plan: dict[str, str]                # module path -> TP style
    layers: tuple[str, ...]                # module paths that became FSDP / replicate units on this rank
    notes: tuple[str, ...] = ()            # where the run differs from the plan, and why
    source: str = "planner.trace"          # how the module was described to the planner


def plan_module(module: nn.Module, example_inputs, *, global_batch: int, world: int, cluster: str | None = None,
                knobs=None, precision: str = "fp32") -> dict:
    """The plan.json document for ``module`` on ``world`` processes (no torch.distributed needed)."""
    from planner.api import plan_graph
    from planner.config import Workload
    from planner.trace import trace
    graph = trace(module, example_inputs, runnable=True)
    workload = Workload(global_batch=global_batch, seq_len=graph.seq_len, precision=precision)
    return plan_graph(graph, cluster or DEFAULT_CLUSTER, workload, gpus=world, knobs=executable_knobs(knobs)).to_json()


def executable_knobs(knobs=None):
    """The user's knobs with what the executor cannot run on an arbitrary module fixed off."""
    from planner.api import Knobs
    knobs = knobs or Knobs()
    for name, off in (("cp", 1), ("sequence_parallel", False), ("optimizer_offload", False)):
        value = getattr(knobs, name)
        if value is not None and value != off:
            raise UserError(f"{value!r}: auto_parallelize runs {name} {off!r} only (context parallelism, "
                            "sequence parallelism and optimizer offload need a model the executor builds); allowed: "
                            f"{off!r} or None", field=f"knobs.{name}")
    return replace(knobs, cp=1, sequence_parallel=False, optimizer_offload=False)


class ParallelTraining:
    """This rank's share of the training: ``step(inputs, targets) -> loss`` on this data-parallel
    replica's share of the global batch (``shard`` cuts it from the global batch)."""

    def __init__(self, *, plan: AutoPlan, parts: list[nn.Module], indices: list[int],
                 optimizers: list[torch.optim.Optimizer], loss_fn: Callable, mesh, dp_mesh, device, schedule,
                 autocast: torch.dtype | None = None, shared: tuple[list, object] = ([], None)):
        self.plan, self.parts, self.optimizers, self.autocast = plan, parts, optimizers, autocast
        self.shared = shared        # (names of each parameter two stages hold, the group summing their gradients)
        self.loss_fn, self.mesh, self.dp_mesh, self.device, self.schedule = loss_fn, mesh, dp_mesh, device, schedule
        self.dp, self.dp_rank = plan.dp, dp_mesh.get_local_rank()
        self.first_stage = 0 in indices
        self.last_stage = len(plan.stages) - 1 in indices

    @property
    def module(self) -> nn.Module:
        """The parallel module (without a pipeline), or this rank's first stage."""
        return self.parts[0]

    def shard(self, batch):
        """This replica's rows of a global batch (a tensor, or a tuple of them)."""
        if isinstance(batch, (tuple, list)):
            return type(batch)(self.shard(b) for b in batch)
        per = batch.shape[0] // self.dp
        return batch[self.dp_rank * per:(self.dp_rank + 1) * per]

    def microbatch_loss(self, output, targets) -> torch.Tensor:
        """The user's mean loss of one micro-batch over the number of micro-batches: the micro-batches
        of a step add up to the replica's mean (schedules run with ``scale_grads=False``)."""
        return self.loss_fn(output, targets) / self.plan.num_microbatches

    def step(self, inputs, targets) -> float:
        """One optimizer step; returns the loss over the whole global batch (every rank the same)."""
        inputs = tuple(x.to(self.device) for x in (inputs if isinstance(inputs, (tuple, list)) else (inputs,)))
        targets = targets.to(self.device)
        autocast = (torch.autocast(self.device.type, dtype=self.autocast) if self.autocast is not None
                    else nullcontext())
        with autocast:
            if self.schedule is not None:
                local = schedule_step(self.schedule, inputs, targets, first_stage=self.first_stage,
                                      last_stage=self.last_stage, device=self.device)
            else:
                local = accumulate(self.parts[0], inputs, targets, num_microbatches=self.plan.num_microbatches,
                                   zero=self.plan.zero, loss_fn=self.microbatch_loss, device=self.device)
        sync_shared_grads(self.parts, *self.shared)
        optimizer_step(self.optimizers, self.parts)
        return global_loss(local, mesh=self.mesh, dp_mesh=self.dp_mesh, dp=self.dp)


def apply_plan(module: nn.Module, plan: Plan, doc: dict, *, device: torch.device, loss_fn: Callable,
               lr: float) -> ParallelTraining:
    """Apply a traced module's plan to ``module`` on this rank (executor/parallelize.py, in its order)."""
    c, world, precision = plan.config, dist.get_world_size(), plan.workload.precision
    schedule = runnable_schedule(c.schedule, c.num_microbatches, c.pp) if c.pp > 1 else None
    zero, notes = c.zero, ()
    dims = ParallelDims.from_config(c, world)
    mesh, dp_mesh, dp_cp_mesh = dims.build_mesh(device.type)     # no context parallelism here: dp x cp is dp
    expert_mesh = dims.build_expert_mesh(mesh)               # (efsdp, ep) under expert parallelism, or None
    tied, tied_group = {}, None
    if c.pp > 1:
        indices = stage_indices(len(plan.stages), c.pp, mesh["pp"].get_local_rank(), c.schedule)
        parts, how = split_pipeline(module, plan.stages, indices, plan.source)
        if how == "paths":
            notes += ("the module's forward is cut into stages by the transformers model's module paths (torch.fx "
                      "cannot follow it): each stage rebuilds the positions and causal masks",)
        tied = tied_across_stages(module, plan.stages)
        tied_group = _tied_group(tied, mesh, len(plan.stages), c.schedule, plan.source)
    else:
        indices, parts = [0], [module]
    trained, optimizers, units = [], [], []
    for part in parts:
        units += dp_units(part, plan)
        model, part_notes = parallelize(part, plan, dims, mesh, dp_cp_mesh, device, expert_mesh=expert_mesh)
        notes += tuple(part_notes)
        trained.append(model)
        optimizers.append(make_optimizer(model, lr=lr, zero=zero, dp_mesh=dp_mesh, expert_mesh=expert_mesh))
    autocast = autocast_dtype(plan, dims, device)
    if precision != "fp32" and device.type == "cpu":
        notes += (f"precision {precision} runs in fp32 on the CPU (mixed precision where the device has it, as "
                  "meshplan's own models)",)
    if schedule is not None and schedule != c.schedule:
        notes += (f"the {c.schedule} schedule with {c.num_microbatches} micro-batch(es) for {c.pp} stages runs "
                  f"as {schedule} (the same order)",)
    auto = AutoPlan(doc=doc, dp=c.dp, tp=c.tp, pp=c.pp, zero=zero, ep=c.ep, precision=precision,
                    autocast=str(autocast).removeprefix("torch.") if autocast is not None else None, schedule=schedule,
                    num_microbatches=c.num_microbatches, stages=plan.stages, tp_plan=dict(plan.tp_plan),
                    layers=tuple(units), notes=notes)
    training = ParallelTraining(plan=auto, parts=trained, indices=indices, optimizers=optimizers,
                                loss_fn=loss_fn, mesh=mesh, dp_mesh=dp_mesh, device=device, schedule=None,
                                autocast=autocast, shared=(list(tied), tied_group))
    if schedule is not None:
        training.schedule = build_schedule(list(zip(indices, trained)), num_stages=len(plan.stages),
                                           pp_mesh=mesh["pp"], schedule=schedule,
                                           num_microbatches=c.num_microbatches, loss_fn=training.microbatch_loss,
                                           device=device)
    return training


def _tied_group(tied: dict[tuple[str, ...], tuple[int, ...]], mesh, num_stages: int, schedule: str, source: str):
    """The group summing the gradients of parameters two stages share: the first and last pipeline
    ranks (``tied_pairs``); a share between other stages is refused, and so is one where a V placement puts
    the first and the last stage on one rank (its two stages would hold one parameter object, which FSDP2 and
    DDP cannot each wrap)."""
    if not tied:
        return None
    pp = mesh["pp"].size()
    where = placement(schedule, pp)
    ends = {rank_chunk(where, 0, pp)[0], rank_chunk(where, num_stages - 1, pp)[0]}
    for names, held in tied.items():
        if {rank_chunk(where, j, pp)[0] for j in held} != ends or len(held) != 2:
            raise UserError(f"parameter {names[0]!r} is shared by stages {', '.join(map(str, held))} of {num_stages}; a "
                            "pipeline shares parameters between its first and last stage only (a tied embedding and "
                            "head)", source=source, field="stages")
    if len(ends) == 1:
        raise UserError(f"the {schedule} schedule runs the first and the last stage on one rank, which share "
                        f"{next(iter(tied))[0]!r}; auto_parallelize pipelines a module with parameters shared by "
                        "those stages under a schedule that places them on two ranks (knobs schedule "
                        f"{one_of([s.name for s in SCHEDULES.values() if s.placement == 'loop'])})", source=source,
                        field="config.schedule")
    pair = tied_pairs(mesh, num_stages, schedule).get(dist.get_rank())
    return pair.group if pair is not None else None


def auto_parallelize(module: nn.Module, example_inputs, *, global_batch: int, cluster: str | None = None,
                     knobs=None, loss_fn: Callable | None = None, lr: float = 1e-3, precision: str = "fp32",
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelTraining:
    """Plan ``module`` for the live torchrun world and apply the plan (see the module docstring).

    ``example_inputs``: one micro-batch of inputs (a tensor or a tuple), for the tracer.
    ``global_batch``: rows per optimizer step over all replicas. ``knobs``: a ``planner.api.Knobs``
    fixing some of the search's choices (e.g. ``Knobs(tp=2)``). ``loss_fn(output, targets)``: a
    mean over the rows (default mean squared error). ``precision``: fp32, or bf16 / fp16 mixed
    precision (fp32 parameters, gradients and optimizer; 16-bit compute): the planner plans for it and
    the executor applies it (module docstring). ``timeout_s``: how long a collective waits for a
    peer before it raises, where this call starts the process group."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise UserError(f"must be a positive integer, got {global_batch!r}", field="global_batch")
    if precision not in PRECISIONS:
        raise UserError(f"{precision!r} is not allowed; allowed: {one_of(PRECISIONS)}", field="precision")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise UserError("auto_parallelize runs inside a torchrun job (no RANK in the environment); "
                            "launch with torchrun --nproc-per-node N your_script.py", field="environment")
        init_process_group(timeout_s)
    world = dist.get_world_size()
    device = local_device()
    module = module.to(device)
    with torch.no_grad():                       # every rank starts from rank 0's weights
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0)
    doc = from_rank0(lambda: plan_module(module, example_inputs, global_batch=global_batch, world=world,
                                         cluster=cluster, knobs=knobs, precision=precision), what="plan the module")
    plan = Plan.from_json(doc, SOURCE)
    check_world_size(plan, world, "this torchrun job")
    return apply_plan(module, plan, doc, device=device, loss_fn=loss_fn or nn.functional.mse_loss, lr=lr)
