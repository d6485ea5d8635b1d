"""Train a plan on seeded synthetic data, measure it, write measured.json.

Run under torchrun (``meshplan run`` launches it): ``python -m executor.train
--plan plan.json --steps N``. The loss is the mean cross-entropy over every token
of the global batch: each micro-batch's loss is its summed cross-entropy divided
by the tokens one data-parallel replica sees in a step, micro-batches and
pipeline chunks add up (schedules run with ``scale_grads=False``), and data-
parallel gradient averaging over equal replicas turns the replica means into
the global mean.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from planner.errors import UserError
from planner.plan import Plan

from . import checkpoint as ckpt
from . import elastic, faults
from .checkpoint_dir import PLAN, check_resumable
from .data import local_batch
from .integrity import check_model, check_world_size
from .lora import LoraConfig, finetune_of
from .measure import (AllocationPeak, SavedTensorMeter, gathered_param_bytes, grad_bytes, optimizer_bytes, param_bytes,
                      state_bytes, unsharded_grad_bytes)
from .mesh import ParallelDims, init_process_group, local_device
from .context import shard_sequence
from .models import SequenceLayout, build_model, canonical_name
from .moe import expert_parallel_params, routed_expert_params, update_expert_bias
from .parallelize import autocast_dtype, grads_are_bucket_views, parallelize
from .pipeline import build_schedule, build_stage_model, stage_indices, sync_tied_grads, tied_pairs
from .plan_file import load_plan
from .support import DEFAULT_CHECKPOINT_EVERY, DEFAULT_TIMEOUT_S, check_stages, check_supported
from .zero1 import ShardedAdamW

LEARNING_RATE = 1e-3


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    steps: int                          # optimizer steps to run (after the resumed ones)
    seed: int = 0                       # data and initialisation
    lr: float = LEARNING_RATE           # AdamW, constant
    load_dir: str | None = None         # resume from this DCP checkpoint (any plan's)
    save_dir: str | None = None         # save a DCP checkpoint after the last step
    grads_path: str | None = None       # write the first step's full gradients, one file per rank (tests)
    checkpoint_dir: str | None = None   # restartable run: resume from, and checkpoint atomically into, this
                                        # folder; ``steps`` is then the run's total, resumed steps included
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY   # steps between checkpoints (and one after the last step)
    lora: LoraConfig | None = None      # LoRA fine-tuning (executor/lora.py): adapters trained, the rest frozen;
                                        # None: plan.json's (``finetune_of``), today a full training
    elastic: bool = False               # an elastic run (executor/elastic.py): each step's progress kept in
                                        # checkpoint_dir, for the time a change of world loses


class Job:
    """One rank's runtime objects for a plan."""

    def __init__(self, plan: Plan, options: RunOptions, device: torch.device):
        spec, c = plan.spec, plan.config
        check_supported(plan.config, plan.spec, device.type, plan.source, plan.workload.fp8, plan.workload.compile,
                    finetune=plan.workload.finetune)
        check_stages(plan.stages, spec, plan.source)
        self.plan, self.options, self.device = plan, options, device
        self.dims = ParallelDims.from_config(c, dist.get_world_size())
        self.mesh, self.dp_mesh, self.grad_mesh = self.dims.build_mesh(device.type)   # grad: dp x cp
        self.expert_mesh = self.dims.build_expert_mesh(self.mesh)                # (efsdp, ep) or None
        # the groups whose ranks together hold every token of a stage's layers: dp x cp, and tp too where the MoE
        # blocks route the tp ranks' shares of the sequence (the expert region's two dimensions)
        regions = ([self.expert_mesh["efsdp"], self.expert_mesh["ep"]] if self.expert_mesh is not None
                   else [self.grad_mesh])
        self.token_groups = [m.get_group() for m in regions if m.size() > 1]
        self.pp_rank = self.mesh["pp"].get_local_rank()
        self.dp_rank = self.dp_mesh.get_local_rank()
        mine = stage_indices(len(plan.stages), c.pp, self.pp_rank, c.schedule)
        self.tied_pair = (tied_pairs(self.mesh, len(plan.stages), c.schedule).get(dist.get_rank())
                          if c.pp > 1 and spec.tied_embeddings else None)
        self.loss_parallel = plan.tp_plan.get("lm_head") == "colwise_loss" and c.tp > 1
        self.autocast = autocast_dtype(plan, self.dims, device)
        self.sequence = SequenceLayout(cp=c.cp, rank=self.mesh["cp"].get_local_rank())
        # the tokens this rank sees per step: its replica's, of which its cp share
        self.tokens_per_rank = plan.workload.global_batch // c.dp * plan.workload.seq_len // c.cp
        self.lora = options.lora or finetune_of(plan)      # None: every parameter trained
        self.parts: list[nn.Module] = []
        trained = []
        for j in mine:
            part = build_stage_model(spec, plan.stages[j]) if c.pp > 1 else build_model(spec)
            model, _ = parallelize(part, plan, self.dims, self.mesh, self.grad_mesh, device, options.seed,
                                   expert_mesh=self.expert_mesh, lora=self.lora)
            trained.append(model)
            self.parts.append(part)
        self.trained = trained
        self.optimizers = [make_optimizer(m, lr=options.lr, zero=c.zero, dp_mesh=self.grad_mesh,
                                          optimizer_offload=c.optimizer_offload, expert_mesh=self.expert_mesh)
                           for m in trained]      # one per part (DCP)
        self.schedule = None
        if c.pp > 1:
            self.schedule = build_schedule(list(zip(mine, trained)), num_stages=len(plan.stages),
                                           pp_mesh=self.mesh["pp"], schedule=c.schedule,
                                           num_microbatches=c.num_microbatches, loss_fn=self.loss_fn, device=device)
        self.first_stage = 0 in mine
        self.last_stage = len(plan.stages) - 1 in mine

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of a micro-batch over the tokens this rank sees per step (its
        replica's, its cp share of them): averaging gradients over the ``dp_cp`` ranks then gives
        the gradient of the global batch's mean. logits: (b, S, V), vocabulary-sharded DTensor
        under loss parallelism; targets: (b, S); S is this rank's share under cp."""
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum")
        loss = loss / self.tokens_per_rank
        # a scalar of its own: DTensor's to_local is a view, and torch's split-backward input pass detaches each
        # stage output in place, which a view refuses (torch/distributed/pipelining/_backward.py)
        return loss.to_local().clone() if isinstance(loss, DTensor) else loss

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        w, spec = self.plan.workload, self.plan.spec
        inputs, targets = local_batch(step, seed=self.options.seed, batch=w.global_batch, seq_len=w.seq_len,
                                      vocab_size=spec.vocab_size, dp=self.dims.dp, dp_rank=self.dp_rank)
        if self.sequence.cp > 1:                        # this rank's two chunks of every sequence
            inputs, targets = shard_sequence(inputs, self.sequence), shard_sequence(targets, self.sequence)
        return inputs.to(self.device), targets.to(self.device)


# One training step, in pieces shared with auto_parallelize's ParallelTraining (executor/auto.py).

def make_optimizer(model: nn.Module, *, lr: float, zero: int, dp_mesh, optimizer_offload: bool = False,
                   expert_mesh=None):
    """AdamW with a constant ``lr`` over ``model``'s parameters; under ZeRO-1 with more than one
    replica (``dp_mesh``), or with optimizer offload, its states sharded over them (executor/zero1.py,
    which keeps them in host memory with ``optimizer_offload``), those of the experts that expert parallelism
    splits over ``expert_mesh``'s efsdp ranks. Under ZeRO-2/3 with offload FSDP2 holds the
    parameters in host memory, so this AdamW and its states are there too (executor/parallelize.py).
    Only the trainable parameters get states (all but a LoRA run's frozen ones: executor/lora.py)."""
    if zero == 1 and (dp_mesh.size() > 1 or optimizer_offload):
        experts = expert_parallel_params(model)
        named = [(canonical_name(name), p) for name, p in model.named_parameters() if p.requires_grad]
        return ShardedAdamW([(n, p) for n, p in named if id(p) not in experts], lr=lr, dp_mesh=dp_mesh,
                            offload=optimizer_offload, expert_params=[(n, p) for n, p in named if id(p) in experts],
                            expert_mesh=expert_mesh["efsdp"] if experts else None,
                            stacks=routed_expert_params(model) - experts)
    params = [p for p in model.parameters() if p.requires_grad]
    # on CUDA one fused kernel per step (torchtitan's default implementation): it streams 28 bytes per
    # parameter where the multi-tensor (foreach) path runs eight passes and keeps a temporary copy of
    # the second moments (measured on H100: benchmarks/results/gpu_runs_foreach_adam.json against gpu_runs.json); the CPU runs the loop
    # but for offloaded states (FSDP2's CPUOffloadPolicy): torch's fused CPU kernel, one pass as the cost
    # model's host step assumes (2.1 ns against 21 ns per parameter for the loop, 4M parameters, this
    # machine: ADAM_CPU_NOTE in executor/zero1.py)
    fused = bool(params) and (params[0].device.type == "cuda" or optimizer_offload)
    # a part with nothing to train (a LoRA run's pipeline stage holding only the frozen embedding) keeps an
    # optimizer of one empty group, so that every part has one (the checkpoint saves them part by part)
    return torch.optim.AdamW(params or [{"params": []}], lr=lr, fused=fused or None,
                             foreach=False if not fused else None)


def accumulate(model: nn.Module, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, *, num_microbatches: int,
               zero: int, loss_fn: Callable, device: torch.device) -> torch.Tensor:
    """Without a pipeline: gradient accumulation over ``num_microbatches`` micro-batches (``inputs``,
    the model's positional arguments, and ``targets`` cut along their first dimension), the gradients
    reduced once, in the last micro-batch's backward. Returns the sum of the micro-batch losses."""
    m = num_microbatches
    total = torch.zeros((), device=device)
    chunks = list(zip(*(x.chunk(m) for x in inputs), targets.chunk(m)))
    for i, (*xs, y) in enumerate(chunks):
        last = i == len(chunks) - 1
        sync = model.no_sync() if hasattr(model, "no_sync") and not last else nullcontext()
        if zero == 0 and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(last)       # replicate: one all-reduce per step
        with sync:
            loss = loss_fn(model(*xs), y)
            loss.backward()
        total += loss.detach()
    return total


def schedule_step(schedule, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, *, first_stage: bool,
                  last_stage: bool, device: torch.device) -> torch.Tensor:
    """With a pipeline: the schedule over the step's micro-batches (the first stage is fed ``inputs``,
    the last computes the losses against ``targets``). Returns this rank's sum of the micro-batch
    losses (zero but on the last stage)."""
    losses: list[torch.Tensor] = []
    kwargs = {"target": targets, "losses": losses} if last_stage else {}
    # return_outputs=False: the last stage would otherwise keep every micro-batch's output (the logits)
    # until the step ends, to merge them into step()'s return value, which the loss makes unneeded
    # (torch/distributed/pipelining/stage.py ``output_chunks``, kept when ``save_forward_output``)
    schedule.step(*(inputs if first_stage else ()), return_outputs=False, **kwargs)
    return torch.stack(losses).sum() if losses else torch.zeros((), device=device)


def optimizer_step(optimizers: list[torch.optim.Optimizer], models: list[nn.Module]) -> None:
    """Step, then drop the gradients; but where they are views of DDP's buckets (``apply_ddp``), zero
    them in place: dropped, the next backward would allocate a second copy of them beside the buckets
    (DDP only copies gradients back into the buckets at the step's one synchronisation, so under
    gradient accumulation both live), where the cost model counts one (4 bytes per parameter)."""
    keep = any(grads_are_bucket_views(m) for m in models)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=not keep)


def global_loss(local: torch.Tensor, *, mesh, dp_mesh, dp: int) -> float:
    """The step's loss on every rank: summed over pipeline ranks (only the last holds it), averaged
    over the ``dp`` ranks of ``dp_mesh`` (replicas, or replicas x cp ranks, each with its share)."""
    value = local.detach().float().reshape(1).clone()
    dist.all_reduce(value, group=mesh["pp"].get_group())
    dist.all_reduce(value, group=dp_mesh.get_group())
    return value.item() / dp


def train_step(job: Job, step: int, meter: SavedTensorMeter | None = None, dump_grads: str | None = None) -> float:
    inputs, targets = job.batch(step)
    c = job.plan.config
    with ExitStack() as stack:
        if job.loss_parallel:
            stack.enter_context(loss_parallel())
        if job.autocast is not None:
            stack.enter_context(torch.autocast(job.device.type, dtype=job.autocast))
        if meter is not None:
            stack.enter_context(meter.track())
        if job.schedule is not None:
            local = schedule_step(job.schedule, (inputs,), targets, first_stage=job.first_stage,
                                  last_stage=job.last_stage, device=job.device)
            sync_tied_grads(job.parts, job.tied_pair)
        else:
            local = accumulate(job.trained[0], (inputs,), targets, num_microbatches=c.num_microbatches, zero=c.zero,
                               loss_fn=job.loss_fn, device=job.device)
    if dump_grads:
        write_grads(job, dump_grads)
    optimizer_step(job.optimizers, job.trained)
    update_expert_bias(job.trained, job.token_groups)
    return global_loss(local, mesh=job.mesh, dp_mesh=job.grad_mesh, dp=job.grad_mesh.size())


def write_grads(job: Job, path: str) -> None:
    """{parameter path: full gradient} of this rank's trainable parameters (collective over TP/FSDP meshes).
    ZeRO-1 reduces the gradients inside its optimizer step: its replicas' are averaged here."""
    grads = {}
    for model, optimizer in zip(job.trained, job.optimizers):
        for name, p in model.named_parameters():
            if not p.requires_grad:         # frozen (LoRA): no gradient
                continue
            g = p.grad
            g = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
            if isinstance(optimizer, ShardedAdamW):
                replicas = optimizer.replicas_of(p)
                dist.all_reduce(g, group=replicas.group)
                g /= replicas.divide
            grads[canonical_name(name)] = g.cpu()
    torch.save(grads, f"{path}.rank{dist.get_rank()}.pt")


def _memory(job: Job, meter: SavedTensorMeter, gathered_bytes: int, grads_bytes: tuple[int, int],
            host_peak: int | None) -> dict:
    """This rank's bytes by category (see executor/measure.py for how each is counted); ``host``:
    what optimizer offload keeps in host memory (parameters, gradients, optimizer states)."""
    host = {"params": param_bytes(job.trained, host=True), "grads": grads_bytes[1],
            "optimizer": sum(optimizer_bytes(o, job.trained, host=True) for o in job.optimizers)}
    return {"rank": dist.get_rank(), "pp_rank": job.pp_rank, "params": param_bytes(job.trained),
            "params_gathered": gathered_bytes, "grads": grads_bytes[0],
            "optimizer": sum(optimizer_bytes(o, job.trained) for o in job.optimizers), "activations": meter.peak_bytes,
            "host": host,
            "peak_allocated": torch.cuda.max_memory_allocated(job.device) if job.device.type == "cuda" else host_peak}


def measured_step(job: Job, step: int, dump_grads: str | None) -> tuple[float, dict, dict | None]:
    """One step, instrumented: saved tensors through hooks, FSDP's gathered parameters at the end of
    each forward, gradients before the optimizer step. (loss, memory by category, on the CPU the
    step's matrix products as they ran: executor/measure.py gemm_achieved)."""
    meter = SavedTensorMeter(job.trained)
    gathered, unsharded = [0], [0]

    def after_forward(module, args, output):
        gathered[0] = max(gathered[0], gathered_param_bytes(job.trained))
        if job.schedule is not None:    # a pipeline's deferred FSDP gradients, from the backwards before
            unsharded[0] = max(unsharded[0], unsharded_grad_bytes(job.trained))

    hooks = [m.register_forward_hook(after_forward) for m in job.trained]
    grads = [(0, 0)]      # (on the device, in host memory)
    original_step = [o.step for o in job.optimizers]

    def count_grads_then(step_fn):
        def run(*args, **kwargs):
            now = (grad_bytes(job.trained), grad_bytes(job.trained, host=True))
            grads[0] = (max(grads[0][0], now[0]), max(grads[0][1], now[1]))
            return step_fn(*args, **kwargs)
        return run

    for o, fn in zip(job.optimizers, original_step):
        o.step = count_grads_then(fn)
    # on the CPU: what the step allocates at its peak (executor/measure.py AllocationPeak), on top of the
    # model states alive when it begins (the previous step set the gradients to None)
    peak = AllocationPeak() if job.device.type == "cpu" else None
    start = state_bytes(job.trained, job.optimizers) if peak is not None else 0
    try:
        with peak.track() if peak is not None else nullcontext():
            loss = train_step(job, step, meter, dump_grads)
    finally:
        for h in hooks:
            h.remove()
        for o, fn in zip(job.optimizers, original_step):
            o.step = fn
    return loss, _memory(job, meter, gathered[0], (max(grads[0][0], unsharded[0]), grads[0][1]),
                         None if peak is None else start + peak.peak_bytes), None if peak is None else peak.gemm


def _resume(job: Job, options: RunOptions) -> tuple[int, list[float], list[int]]:
    """(first step to run, losses of the steps before it, the world size each of them ran in) from --load or
    --checkpoint-dir."""
    tied = job.plan.spec.tied_embeddings
    if options.checkpoint_dir:
        start, meta = ckpt.resume(options.checkpoint_dir, job.trained, job.optimizers, tied=tied)
        if meta is None:
            return 0, [], []
        check_resumable(options.checkpoint_dir, meta, steps=options.steps, seed=options.seed)
        if dist.get_rank() == 0:
            sys.stderr.write(f"meshplan run: resuming from {ckpt.step_dir(options.checkpoint_dir, start)} "
                             f"(step {start} of {options.steps})\n")
        worlds = meta.get("world_sizes") or [meta.get("world_size")] * start     # older markers: one world
        return start, [float(x) for x in meta["losses"]], worlds
    if options.load_dir:
        return ckpt.load(options.load_dir, job.trained, job.optimizers, tied=tied), [], []
    return 0, [], []


def _checkpoint(job: Job, options: RunOptions, step: int, losses: list[float], worlds: list[int]) -> None:
    """The atomic checkpoint after ``step`` steps, with the losses of all of them, the world size each ran in,
    when it was written and the plan it was written under (an elastic run continues it: executor/elastic.py)."""
    rank = dist.get_rank()
    ckpt.save_atomic(options.checkpoint_dir, step, job.trained, job.optimizers,
                     tied=job.plan.spec.tied_embeddings,
                     meta={"seed": options.seed, "losses": losses, "world_sizes": worlds, "plan": job.plan.source,
                           "time": time.time()},
                     files={PLAN: job.plan.to_json()},
                     before_marker=lambda: faults.inject("kill-in-checkpoint", rank=rank, step=step,
                                                         world=dist.get_world_size()))


def run(plan: Plan, options: RunOptions, change: elastic.Change | None = None) -> dict:
    """Train ``plan`` in the current process group; returns measured.json's content (on every rank).
    With ``checkpoint_dir`` the run is restartable: it resumes from the folder's latest complete
    checkpoint, trains up to ``steps`` in all and checkpoints every ``checkpoint_every`` steps and
    after the last; ``losses`` then holds every step's, whichever attempt computed them, and
    ``world_sizes`` the world each ran in. ``change``: the change of plan an elastic run made to get here
    (recorded once the checkpoint is loaded: executor/elastic.py)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    job = Job(plan, options, device)
    start, done_losses, done_worlds = _resume(job, options)
    world, rank = dist.get_world_size(), dist.get_rank()
    if change is not None and rank == 0:
        elastic.record(change, options.checkpoint_dir, start)
    end = options.steps if options.checkpoint_dir else start + options.steps
    measure_at = start + instrumented_step(end - start)
    losses, times, memory, gemm = [], [], None, None
    for step in range(start, end):
        faults.inject("kill", rank=rank, step=step, world=world)
        faults.inject("hang", rank=rank, step=step, world=world)
        dist.barrier()
        t0 = time.perf_counter()
        dump = options.grads_path if step == start else None
        if step == measure_at:
            loss, memory, gemm = measured_step(job, step, dump)
        else:
            loss = train_step(job, step, dump_grads=dump)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        worlds = done_worlds + [world] * len(losses)
        if options.checkpoint_dir and ((step + 1) % options.checkpoint_every == 0 or step + 1 == end):
            _checkpoint(job, options, step + 1, done_losses + losses, worlds)
        if options.elastic and rank == 0:
            elastic.write_progress(options.checkpoint_dir, step + 1, world)
    if options.save_dir:
        ckpt.save(options.save_dir, end, job.trained, job.optimizers, tied=plan.spec.tied_embeddings)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (memory, gemm))
    measured = measured_json(plan, options, device, start, losses, times, [m for m, _ in per_rank],
                             [g for _, g in per_rank], measure_at - start)
    if options.checkpoint_dir:      # the whole run, whichever attempt (and world) computed each step
        measured.update(first_step=0, steps=len(done_losses) + len(losses), losses=done_losses + losses,
                        world_sizes=done_worlds + [world] * len(losses))
    return measured


def instrumented_step(steps: int) -> int:
    """Which of a run's ``steps`` has its memory measured (0-based): the third where there are four or
    more, else the second, else the first. Not the first: it also runs the pipeline schedule's
    one-time shape inference, whose tensors outlive it. Not the second where it can be avoided: DDP
    rebuilds its gradient buckets in the order the first backward produced the gradients, at the
    start of the second forward (torch/nn/parallel/distributed.py ``_pre_forward``,
    ``reducer._rebuild_buckets``), allocating a second set of buckets while the first are freed,
    which a step's allocation peak would count twice (executor/measure.py AllocationPeak)."""
    return 2 if steps >= 4 else min(1, steps - 1)


def steady_times(times: list[float], instrumented: int) -> list[float]:
    """The step times that say how fast the plan trains: after the first two (the first initialises
    the pipeline and caches, the second rebuilds DDP's buckets), without the instrumented step (its
    hooks and profiler slow it); where that leaves none, what there is."""
    steady = [t for i, t in enumerate(times) if i >= 2 and i != instrumented]
    return steady or [t for i, t in enumerate(times) if i != instrumented] or times


def measured_json(plan: Plan, options: RunOptions, device: torch.device, start: int, losses: list[float],
                  times: list[float], per_rank: list[dict], gemm: list[dict | None], instrumented: int) -> dict:
    """measured.json: what happened, next to what the plan predicted. ``instrumented``: which of
    ``times`` ran with the memory counters (``instrumented_step``); ``gemm``: each rank's matrix
    products in it (None off the CPU)."""
    steady = steady_times(times, instrumented)
    return {
        "plan": plan.source, "world_size": dist.get_world_size(), "device": device.type,
        "backend": dist.get_backend(), "seed": options.seed, "first_step": start, "steps": len(losses),
        "losses": losses, "step_times_s": times, "step_time_s": sum(steady) / len(steady) if steady else None,
        "instrumented_step": instrumented,
        "resumed_from": start, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "memory_per_rank_bytes": per_rank,
        # the instrumented step's matrix products per rank on the CPU (executor/measure.py gemm_achieved)
        "gemm_per_rank": gemm if any(g is not None for g in gemm) else None,
        "predicted": {"step_time_s": plan.estimate.step_time_s,
                      "memory_per_gpu_bytes": plan.estimate.memory.to_json(),
                      "memory_per_stage_bytes": [m.to_json() for m in plan.estimate.memory_per_stage]},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m executor.train", description="one rank of `meshplan run`")
    p.add_argument("--plan", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=LEARNING_RATE)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=RunOptions.checkpoint_every)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a collective may wait")
    p.add_argument("--out", help="measured.json (written by rank 0)")
    p.add_argument("--model", help="the model plan.json describes (checked against its spec and fingerprint)")
    p.add_argument("--elastic", action="store_true",
                   help="a world other than the plan's re-plans for it (executor/elastic.py; needs --checkpoint-dir)")
    return p.parse_args(argv)


def _lost_peer(e: RuntimeError, timeout_s: float) -> str | None:
    """The one-line explanation of a collective that failed because a peer died or stopped
    answering (gloo/NCCL transport errors); None for any other error."""
    text = str(e)
    lines = text.strip().splitlines() or [type(e).__name__]
    # gloo: "[.../tcp/pair.cc:534] Read error [127.0.0.1]:20610: Connection reset by peer. This is typically..."
    reason = re.sub(r"^\[[^\]]*\]\s*", "", lines[-1]).split(". ")[0][:200]
    if re.search(r"timed out|timeout", text, re.IGNORECASE):
        return (f"rank {dist.get_rank()}: a collective got no answer within --timeout {timeout_s:g} s: a peer "
                f"process stopped answering (lost, hung or killed) ({reason})")
    if re.search(r"connection (closed|reset)|broken pipe|by peer|NCCL", text, re.IGNORECASE):
        return f"rank {dist.get_rank()}: a collective failed because a peer process went away ({reason})"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = load_plan(args.plan)
    if args.model:
        plan = check_model(plan, args.model)
    local_device()          # this rank's GPU made current before NCCL starts
    init_process_group(args.timeout)
    try:
        change = None
        if args.elastic:
            plan, change = elastic.plan_for_world(plan, model=args.model, checkpoint_dir=args.checkpoint_dir,
                                                  world=dist.get_world_size())
        else:
            check_world_size(plan, dist.get_world_size(), "this job")
        options = RunOptions(steps=args.steps, seed=args.seed, lr=args.lr, load_dir=args.load, save_dir=args.save,
                             checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                             elastic=args.elastic)
        measured = run(plan, options, change)
        if dist.get_rank() == 0 and args.out:
            Path(args.out).write_text(json.dumps(measured, indent=2) + "\n")
        dist.barrier()      # no rank tears its connections down while another still uses them
    except elastic.Stopped:
        return 0            # no plan fits: a clean stop, not a failure to restart (stopped.json says why)
    except UserError as e:
        sys.stderr.write(f"meshplan run: error: {e}\n")
        return e.exit_code
    except RuntimeError as e:
        message = _lost_peer(e, args.timeout)
        if message is None:
            raise
        sys.stderr.write(f"meshplan run: error: {message}\n")
        return 1
    finally:
        dist.destroy_process_group()
    return 0


def exit_now(code: int) -> None:
    """End the rank without the interpreter's finalization, once its work is done and written: gloo's
    worker threads can still hold tensors after destroy_process_group, and releasing them while the
    interpreter is torn down aborts the process ("terminate called without an active exception",
    SIGABRT; pytorch/pytorch#179291 describes the race). It struck about one ZeRO-1 run in ten on the
    2-core VM, after the last step, so torchrun reported a finished job as failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
