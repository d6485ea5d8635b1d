"""Pipeline parallelism from plan.json's stage boundaries (``torch.distributed.pipelining``).

plan.json lists the module paths of each virtual stage; virtual stage j runs on
pipeline rank j % pp (Narayanan et al. 2021, Sec 2.2.2: interleaved stages).
Each stage is the reference model with the modules it does not run removed, so
its parameters keep the whole model's paths (torchtitan's
``pipeline_module_split`` does the same with plain lists of names).

Schedules are torch's, the class each record of planner/schedules.py names. They run
with ``scale_grads=False``: the loss function already divides by the tokens of the whole step.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from planner.model import ModelSpec
from planner.schedules import SCHEDULES

from .models import Transformer, build_model
from .support import check_stages, runnable_schedule  # noqa: F401  (re-exported)

def stage_indices(num_stages: int, pp: int, pp_rank: int) -> list[int]:
    """The virtual stages that pipeline rank ``pp_rank`` runs, in order."""
    return [j for j in range(num_stages) if j % pp == pp_rank]


def build_stage_model(spec: ModelSpec, paths: tuple[str, ...]) -> Transformer:
    """The reference model (meta device) keeping only the layers ``paths`` names (``check_stages``
    has checked that they are the model's)."""
    return build_model(spec, keep=tuple(paths))


def build_schedule(stage_models: list[tuple[int, torch.nn.Module]], *, num_stages: int, pp_mesh: DeviceMesh,
                   schedule: str, num_microbatches: int, loss_fn: Callable, device: torch.device):
    """torch's schedule over this rank's stages (one, or vpp of them for a schedule with virtual stages): the
    class the schedule's record names (``PipelineSchedule.torch_name``, torch's ``get_schedule_class``)."""
    group = pp_mesh.get_group()
    stages = [PipelineStage(module, index, num_stages, device, group=group) for index, module in stage_models]
    record = SCHEDULES[runnable_schedule(schedule, num_microbatches, pp_mesh.size())]
    cls = get_schedule_class(record.torch_name)
    return cls(stages if record.virtual_stages else stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn,
               scale_grads=False)


def tied_groups(mesh: DeviceMesh) -> dict[int, dist.ProcessGroup]:
    """For GPT's tied embedding under PP: a group pairing each first-stage rank with the last-stage
    rank of the same (dp, cp, tp) coordinates. Every rank creates every group (c10d requires it);
    returns {rank: its pair's group} for the ranks in a pair."""
    ranks = mesh.mesh                              # (pp, dp_replicate, dp_shard, cp, tp) rank ids
    first, last = ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()
    out = {}
    for a, b in zip(first, last):
        group = dist.new_group([a, b])
        out[a] = out[b] = group
    return out


def sync_tied_grads(stage_models: list[torch.nn.Module], group: dist.ProcessGroup | None) -> None:
    """Sum the gradient of the embedding's two copies (first stage, last stage's head): each holds
    the part of the shared weight's gradient its use produced (Shoeybi et al. 2019, Sec 3)."""
    if group is None:
        return
    for model in stage_models:
        owner = model.embed.tokens if model.embed is not None else model.lm_head if model.lm_head is not None else None
        if owner is None or owner.weight.grad is None:
            continue
        grad = owner.weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=group)
