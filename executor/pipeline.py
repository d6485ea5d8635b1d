"""Pipeline parallelism from plan.json's stage boundaries (``torch.distributed.pipelining``).

plan.json lists the module paths of each virtual stage; virtual stage j runs on
pipeline rank j % pp (Narayanan et al. 2021, Sec 2.2.2: interleaved stages).
Each stage is the reference model with the modules it does not run removed, so
its parameters keep the whole model's paths (torchtitan's
``pipeline_module_split`` does the same with plain lists of names). A module the
user wrote (``auto_parallelize``) is cut instead (``split_pipeline``): its forward
traced with torch.fx, its layers kept as leaves (the original module objects,
under their original paths), the graph cut before each stage's first layer
(``torch.fx.passes.split_module``).

Schedules are torch's, the class each record of planner/schedules.py names. They run
with ``scale_grads=False``: the loss function already divides by the tokens of the whole step.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from planner.errors import UserError
from planner.model import ModelSpec
from planner.schedules import SCHEDULES

from .models import Transformer, build_model
from .support import runnable_schedule


def stage_indices(num_stages: int, pp: int, pp_rank: int) -> list[int]:
    """The virtual stages that pipeline rank ``pp_rank`` runs, in order."""
    return [j for j in range(num_stages) if j % pp == pp_rank]


def build_stage_model(spec: ModelSpec, paths: tuple[str, ...]) -> Transformer:
    """The reference model (meta device) keeping only the layers ``paths`` names (``check_stages``
    has checked that they are the model's)."""
    return build_model(spec, keep=tuple(paths))


def split_pipeline(module: nn.Module, stages: tuple[tuple[str, ...], ...], indices: list[int],
                   source: str = "plan") -> list[nn.Module]:
    """The virtual stages ``indices`` of ``module`` as GraphModules holding the original layer modules
    under their original paths (so TP styles and FSDP units apply by the plan's paths)."""
    import torch.fx as fx
    from torch.fx.passes.split_module import split_module

    layers = [path for stage in stages for path in stage]
    named = dict(module.named_modules())
    missing = [path for path in layers if path not in named or not path]
    if missing:
        raise UserError(f"layer(s) {', '.join(map(repr, missing))} are not submodules of the module; a pipeline "
                        "cuts the module between submodules", source=source, field="stages")

    class LayerTracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return qualname in named and qualname in layers or super().is_leaf_module(m, qualname)

    try:
        graph = LayerTracer().trace(module)
    except Exception as e:          # torch.fx cannot follow data-dependent Python control flow
        raise UserError(f"a pipeline needs the module's forward (outside its layers) to be traceable by "
                        f"torch.fx: {type(e).__name__}: {e}; plan with knobs pp=1", source=source,
                        field="stages") from None
    traced = fx.GraphModule(module, graph)
    stage_of = {path: j for j, stage in enumerate(stages) for path in stage}
    current = [0]

    def which_stage(node) -> int:
        if node.op == "call_module" and node.target in stage_of:
            current[0] = stage_of[node.target]
        return current[0]       # code between layers runs with the layer before it

    pieces = dict(split_module(traced, module, which_stage, keep_original_order=True).named_children())
    if sorted(pieces) != [f"submod_{j}" for j in range(len(stages))]:
        raise UserError(f"the module's forward does not run the stages' layers in the plan's order "
                        f"({len(pieces)} pieces for {len(stages)} stages)", source=source, field="stages")
    targets = [n.target for n in traced.graph.nodes if n.op in ("call_module", "get_attr")]
    original = {t.replace(".", "_"): t for t in targets}   # split_module flattens dotted paths
    if len(original) != len(set(targets)):
        raise UserError("two submodule paths differ only in '.' against '_'; rename one to pipeline the module",
                        source=source, field="stages")
    parts = []
    for j in indices:
        piece_graph = pieces[f"submod_{j}"].graph
        for node in piece_graph.nodes:
            if node.op in ("call_module", "get_attr"):
                node.target = original[node.target]
        parts.append(fx.GraphModule(module, piece_graph))     # references module's own submodules
    return parts


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
