"""Apply a traced module's plan.json to any ``nn.Module``: one function per parallelism.

The config models (executor/models.py) are built by the executor from their spec;
a module the user wrote is not, so its plan is applied to the module itself,
by the module paths the tracer gave its layers (``planner.trace``), to each pipeline stage
of it (executor/pipeline.py ``split_pipeline``):

1. ``apply_tp``        colwise/rowwise/vocab styles per module path (DTensor ``parallelize_module``);
2. ``apply_ac``        recomputation per layer (``torch.utils.checkpoint`` around the layer; selective:
                       torch's selective checkpointing, executor/selective.py);
3. ``apply_dp``        by ZeRO stage: FSDP2 per layer and at the root (ZeRO-2/3), FSDP2's
                       ``replicate`` (ZeRO-0 with TP or a pipeline), DDP (ZeRO-0 otherwise),
                       nothing for ZeRO-1 (its optimizer reduces: executor/zero1.py); FSDP2's
                       units take the plan's mixed precision, the others autocast
                       (executor/auto.py).

The order is executor/parallelize.py's, for the same reasons.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from .parallelize import apply_ddp, apply_fsdp, apply_replicate, checkpoint_forward
from .selective import selective_forward


def layer_of(path: str, layers: list[str]) -> str | None:
    """The layer holding module ``path`` (the longest layer path that is it or a prefix of it)."""
    owners = [layer for layer in layers if path == layer or path.startswith(layer + ".")]
    return max(owners, key=len) if owners else None


def apply_tp(part: nn.Module, tp_mesh: DeviceMesh, tp_plan: dict[str, str], layers: list[str]) -> None:
    """Megatron's pattern (Shoeybi et al. 2019, Sec 3) on the paths plan.json names. A column-parallel
    linear keeps its output split only where a row-parallel linear of the same layer consumes it next;
    any other (a head, a column linear alone) gathers its output, so the user's code and loss after it
    see whole tensors. ``sequence`` entries are skipped: auto_parallelize plans without sequence
    parallelism (it cannot know which dimension of a user's tensor is the sequence)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    modules = dict(part.named_modules())
    entries = list(tp_plan.items())
    styles = {}
    for i, (path, style) in enumerate(entries):
        if path not in modules:
            continue            # another pipeline stage's module
        if style == "colwise":
            after = next(((p, s) for p, s in entries[i + 1:] if s != "colwise"), (None, None))
            paired = after[1] == "rowwise" and layer_of(after[0], layers) == layer_of(path, layers)
            styles[path] = ColwiseParallel() if paired else ColwiseParallel(output_layouts=Replicate())
        elif style == "rowwise":
            styles[path] = RowwiseParallel()
        elif style == "vocab":
            styles[path] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif style == "colwise_loss":   # the user's loss is not vocabulary-parallel: gather the logits
            styles[path] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(part, tp_mesh, styles)


def apply_ac(part: nn.Module, recompute_per_layer: dict[str, str]) -> list[str]:
    """Recompute the layers the plan says (Chen et al. 2016; Korthikanti et al. 2022, Sec 5): ``full``
    runs the layer's forward under ``checkpoint`` and keeps only its input; ``selective`` runs it under
    torch's selective checkpointing, recomputing the attention core and the layer's pointwise ops and
    keeping the rest (executor/selective.py). Returns the notes to report: where the generic path's
    selective recompute differs from the plan's."""
    modules = dict(part.named_modules())
    notes = []
    for path, policy in recompute_per_layer.items():
        if policy == "none" or path not in modules or not path:
            continue
        layer = modules[path]
        if policy == "selective":
            layer.forward = selective_forward(layer, path)
            notes.append(f"{path}: selective recompute also recomputes the layer's pointwise ops (the plan prices "
                         "the attention core alone)")
        else:
            layer.forward = checkpoint_forward(layer)
    return notes


def apply_dp(part: nn.Module, *, zero: int, units: list[str], mesh: DeviceMesh, dp: int, replicate_ddp: bool,
             mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()) -> tuple[nn.Module, bool]:
    """Data parallelism by ZeRO stage (Rajbhandari et al. 2020). Returns (the module to train, whether
    FSDP2 manages its gradients and, with ``mp_policy``, its mixed precision). ``replicate_ddp``: ZeRO-0/1
    where DDP cannot go (DTensor parameters, pipelines), as executor/parallelize.py's ``uses_fsdp``. The
    layers ``units`` names that this part holds become the FSDP / replicate units, as the blocks do in
    executor/parallelize.py."""
    modules = dict(part.named_modules())
    mine = [modules[u] for u in units if u in modules and u]
    if zero >= 2 and dp > 1:
        apply_fsdp(part, mesh["dp_shard"], units=mine, reshard_after_forward=zero == 3, mp_policy=mp_policy)
        return part, True
    if dp > 1 and replicate_ddp:
        apply_replicate(part, mesh["dp_replicate"], units=mine, mp_policy=mp_policy)
        return part, True
    if dp > 1 and zero == 0:      # ZeRO-1: no wrapper, its optimizer reduces (executor/zero1.py)
        return apply_ddp(part, mesh["dp_replicate"]), False
    return part, False
