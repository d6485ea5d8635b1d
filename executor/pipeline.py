"""Pipeline parallelism from plan.json's stage boundaries (``torch.distributed.pipelining``).

plan.json lists the module paths of each virtual stage, in model order; which pipeline rank runs
virtual stage j is the schedule's placement (``PipelineSchedule.placement``, ``planner.schedules.rank_chunk``):
rank j % pp in a loop (Narayanan et al. 2021, Sec 2.2.2: interleaved stages), or in a V (ZB-V, DualPipeV:
rank r holds stages r and 2 pp - 1 - r, so the first and the last stage share rank 0).
Each stage is the reference model with the modules it does not run removed, so
its parameters keep the whole model's paths (torchtitan's
``pipeline_module_split`` does the same with plain lists of names). A module the
user wrote (``auto_parallelize``) is cut instead (``split_pipeline``): by torch.fx
with its layers kept as leaves where fx follows its forward, else by a
``transformers`` decoder's module paths (planner/trace/cut.py, which the trace
also uses to say whether the search may offer a pipeline).

Schedules are torch's, the class each record of planner/schedules.py names. They run
with ``scale_grads=False``: the loss function already divides by the tokens of the whole step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from planner.model import ModelSpec
from planner.schedules import SCHEDULES, rank_chunk, stage_of
from planner.trace.cut import fx_cut, how_to_cut

from .hf_stages import decoder_stages
from .models import Transformer, build_model
from .moe import kept_counts
from .support import runnable_schedule


def placement(schedule: str, pp: int) -> str:
    """Where ``schedule`` puts its virtual stages (``PipelineSchedule.placement``); a loop without a pipeline,
    as the planner places them (planner/placement.py)."""
    return SCHEDULES[schedule].placement if pp > 1 else "loop"


def stage_indices(num_stages: int, pp: int, pp_rank: int, schedule: str) -> list[int]:
    """The virtual stages that pipeline rank ``pp_rank`` runs under ``schedule``'s placement, by chunk
    (``planner.schedules.stage_of``), which is ascending stage order in a loop and in a V alike."""
    if num_stages % pp:
        raise ValueError(f"{num_stages} virtual stages do not divide over {pp} pipeline ranks")
    where = placement(schedule, pp)
    return [stage_of(where, pp_rank, chunk, pp) for chunk in range(num_stages // pp)]


def build_stage_model(spec: ModelSpec, paths: tuple[str, ...]) -> Transformer:
    """The reference model (meta device) keeping only the layers ``paths`` names (``check_stages``
    has checked that they are the model's)."""
    return build_model(spec, keep=tuple(paths))


def split_pipeline(module: nn.Module, stages: tuple[tuple[str, ...], ...], indices: list[int],
                   source: str = "plan") -> tuple[list[nn.Module], str]:
    """The virtual stages ``indices`` of a user's ``module`` and how they were cut (planner/trace/cut.py:
    torch.fx where it follows the forward, else a ``transformers`` decoder's module paths), their
    parameters the module's own objects under the plan's paths (so TP styles and FSDP units apply by path)."""
    how, layout = how_to_cut(module, stages, source)
    if how == "fx":
        return fx_cut(module, stages, indices, source), how
    return decoder_stages(module, layout, indices), how


def tied_across_stages(module: nn.Module, stages: tuple[tuple[str, ...], ...]) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Parameters of a user's module that two stages share (a tied embedding and head): {its names:
    the stages holding it}."""
    stage_of = {path: j for j, stage in enumerate(stages) for path in stage}

    def stage_of_name(name: str) -> int | None:
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:k]) in stage_of:
                return stage_of[".".join(parts[:k])]
        return None

    holders: dict[int, tuple[list[str], set[int]]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        j = stage_of_name(name)
        if j is not None:
            names, held = holders.setdefault(id(param), ([], set()))
            names.append(name)
            held.add(j)
    return {tuple(names): tuple(sorted(held)) for names, held in holders.values() if len(held) > 1}


def build_schedule(stage_models: list[tuple[int, torch.nn.Module]], *, num_stages: int, pp_mesh: DeviceMesh,
                   schedule: str, num_microbatches: int, loss_fn: Callable, device: torch.device):
    """torch's schedule over this rank's stages (one, or vpp of them for a schedule with virtual stages): the
    class the schedule's record names (``PipelineSchedule.torch_name``, torch's ``get_schedule_class``).

    Every multi-stage class takes the same arguments; the V classes (ZBVZeroBubble, DualPipeV) map stages to
    ranks in a V themselves (``generate_stage_to_rank_mapping(style="v")``), the placement ``stage_indices``
    chose. torch infers the stages' shapes by running the rank's stages in the order of the list, each
    waiting for its predecessor's (torch/distributed/pipelining/schedules.py ``_initialize_pp_stages``), so the
    list is in ascending stage order: in a V, rank 0's last stage after its first, or both ranks wait."""
    group = pp_mesh.get_group()
    stage_models = sorted(stage_models, key=lambda indexed: indexed[0])
    for index, module in stage_models:
        if index < num_stages - 1 and not any(p.requires_grad for p in module.parameters()):
            module.register_forward_hook(_output_needs_grad)
    stages = [_Stage(module, index, num_stages, device, group=group) for index, module in stage_models]
    record = SCHEDULES[runnable_schedule(schedule, num_microbatches, pp_mesh.size())]
    cls = get_schedule_class(record.torch_name)
    return cls(stages if record.virtual_stages else stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn,
               scale_grads=False)


class _Stage(PipelineStage):
    """torch's stage, but its shape inference leaves no count behind: torch 2.13 infers a stage's shapes by running
    its forward once on the first step's inputs (the first stage) or on empty tensors of the received shapes (the
    others: torch/distributed/pipelining/stage.py ``_forward_metadata_inference``), and that run's routing would add
    to the tokens each expert got this step, which the balancing bias follows (executor/moe.py
    ``update_expert_bias``): the counts are put back as they were."""

    def _forward_metadata_inference(self, *args, **kwargs):
        with kept_counts(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)


def _output_needs_grad(module: nn.Module, args, output):
    """Forward hook of a stage with nothing to train (a LoRA run's stage holding only the frozen embedding): its
    output made a leaf that needs a gradient. torch infers the next stage's input from it, and a next stage whose
    input needs no gradient gets none of its own parameters' gradients under the split-backward schedules (ZB-V,
    DualPipeV: torch/distributed/pipelining/_backward.py stage_backward_input finds the weights through the graph
    from the stage's inputs; seen on gloo, the adapters of the blocks after an embedding-only stage kept None)."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_()
    return output


@dataclass(frozen=True)
class TiedPair:
    """How a rank holding a copy of a tied embedding (the first stage's embedding, the last stage's head) sums
    the two copies' gradients: over ``group``, the first-stage rank and the last-stage rank of the same (dp, cp,
    tp) coordinates; or, where ``group`` is None, here: the rank holds both stages (a V placement)."""

    group: dist.ProcessGroup | None


def tied_pairs(mesh: DeviceMesh, num_stages: int, schedule: str) -> dict[int, TiedPair]:
    """For GPT's tied embedding under PP: {rank: its TiedPair} for the ranks holding the first or the last
    stage under ``schedule``'s placement (``planner.schedules.rank_chunk``). Every rank creates every group
    (c10d requires it); where one pipeline rank holds both stages no group is made."""
    pp = mesh["pp"].size()
    where = placement(schedule, pp)
    first_pp, last_pp = rank_chunk(where, 0, pp)[0], rank_chunk(where, num_stages - 1, pp)[0]
    ranks = mesh.mesh                              # (pp, dp_replicate, dp_shard, cp, tp) rank ids
    first, last = ranks[first_pp].flatten().tolist(), ranks[last_pp].flatten().tolist()
    if first_pp == last_pp:
        return {a: TiedPair(None) for a in first}
    out = {}
    for a, b in zip(first, last):
        out[a] = out[b] = TiedPair(dist.new_group([a, b]))
    return out


def sync_tied_grads(stage_models: list[torch.nn.Module], pair: TiedPair | None) -> None:
    """Sum the gradient of the embedding's two copies (first stage, last stage's head): each holds
    the part of the shared weight's gradient its use produced (Shoeybi et al. 2019, Sec 3). Over the
    pair's group, or, where this rank holds both copies, here, into both (so they stay equal)."""
    if pair is None:
        return
    grads = []
    for model in stage_models:
        owner = model.embed.tokens if model.embed is not None else model.lm_head if model.lm_head is not None else None
        if owner is None or owner.weight.grad is None:
            continue
        grad = owner.weight.grad
        grads.append(grad.to_local() if hasattr(grad, "to_local") else grad)
    if pair.group is not None:
        for local in grads:
            dist.all_reduce(local, group=pair.group)
        return
    if len(grads) != 2:
        raise RuntimeError(f"this rank holds both copies of the tied embedding but {len(grads)} gradient(s) of them")
    grads[0].add_(grads[1])
    grads[1].copy_(grads[0])


def sync_shared_grads(parts: list[torch.nn.Module], shared: list[tuple[str, ...]],
                      group: dist.ProcessGroup | None) -> None:
    """``sync_tied_grads`` for a user's module: sum the gradient of each parameter two stages share
    (``shared``: each one's names, as ``tied_across_stages`` found them), in the order of ``shared`` on
    every rank of the group (each holds it under one of its names)."""
    if group is None:
        return
    for names in shared:
        param = None
        for part in parts:
            for name in names:
                try:
                    param = part.get_parameter(name)
                    break
                except AttributeError:
                    continue
            if param is not None:
                break
        if param is None or param.grad is None:
            raise RuntimeError(f"no stage of this rank holds a gradient for {names[0]!r}, which its pair sums")
        grad = param.grad
        dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)

