"""Apply a plan to a model (or one pipeline stage of it): one function per parallelism.

The dispatcher ``parallelize`` composes them in this order (torchtitan's
``models/llama3/infra/parallelize.py`` order, for the same reasons):

1. ``apply_tp``   tensor and sequence parallelism (DTensor ``parallelize_module``) first,
                  so the data-parallel wrappers see DTensor parameters on the tp mesh;
   ``apply_cp``   context parallelism (executor/context.py): attention gathers keys and values
                  over the cp ranks; no parameter changes;
2. ``apply_ac``   activation checkpointing per layer, inside the data-parallel units,
                  so recomputation runs while the unit's parameters are gathered;
3. data parallelism by ZeRO stage, over ``dp_cp`` (the data-parallel and context-parallel ranks
                  hold the same parameters): ``apply_fsdp`` (ZeRO-3: ``fully_shard`` resharding
                  after forward; ZeRO-2: keeping the gathered parameters until backward; with
                  optimizer offload, FSDP2's ``CPUOffloadPolicy``),
                  ``apply_replicate`` (ZeRO-0 with TP or a pipeline: torch's FSDP2-based
                  replicate, the DDP that composes with DTensor and with every schedule);
4. ``materialize`` the meta parameters shard by shard (each rank allocates and fills
                  only its own shards, with values that do not depend on the plan);
5. ``apply_ddp``  ZeRO-0 without TP or pipeline: DDP, which needs real parameters (and keeps no
                  second copy of them, unlike replicate). ZeRO-1 takes no wrapper: gradients
                  accumulate locally and the trainer's ``ShardedAdamW`` (executor/zero1.py)
                  reduce-scatters them, updates its rows and all-gathers the parameters.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)


from .context import apply_cp
from .mesh import ParallelDims
from .models import Transformer, materialize, sdpa
from .plan_file import RunPlan
from .recompute import apply_policy, checkpoint_forward  # noqa: F401  (checkpoint_forward re-exported)
from .support import check_supported  # noqa: F401  (re-exported)


def tp_style(style: str, sequence_parallel: bool):
    """The DTensor style of one plan.json TP entry (planner/config.py's TP_STYLES documents the styles)."""
    seq = Shard(1) if sequence_parallel else Replicate()      # layout of the residual stream (B, S, h)
    if style == "colwise":          # input already made Replicate by the parent's PrepareModuleInput
        return ColwiseParallel()
    if style == "rowwise":          # partial sums reduced (SP: reduce-scattered along the sequence)
        return RowwiseParallel(output_layouts=seq)
    if style == "vocab":            # vocabulary-split embedding; its parent puts the output in `seq` layout
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "colwise_loss":     # logits stay split over the vocabulary for loss_parallel
        return ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    return SequenceParallel()       # "sequence": norms on the local sequence chunk


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, tp_plan: dict[str, str], *, sequence_parallel: bool) -> None:
    """Shard the modules plan.json names (Megatron's pattern, Shoeybi et al. 2019, Sec 3; sequence
    parallelism, Korthikanti et al. 2022, Sec 4.2.2). Paths of modules this stage does not hold are
    skipped. Under SP the parents of column-parallel linears gather the sequence once for all of
    them, and the embedding's parent scatters its output along the sequence."""
    modules = dict(model.named_modules())
    styles = {path: tp_style(style, sequence_parallel) for path, style in tp_plan.items() if path in modules}
    if sequence_parallel:
        for path, style in tp_plan.items():
            parent = path.rpartition(".")[0]
            if path not in modules or not parent:
                continue
            if style == "colwise":
                styles[parent] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            elif style == "vocab":
                styles[parent] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    parallelize_module(model, tp_mesh, styles)
    model.tie_weights()     # TP replaced the shared weight in embed and head by two DTensors: share again


def shard_embedding_grads(model: Transformer, tp_plan: dict[str, str]) -> None:
    """DTensor's embedding backward returns the vocabulary-parallel table's gradient replicated
    (V x h on every TP rank); keep only this rank's rows, as the parameter itself is sharded.
    Hooks the materialised parameters (``to_empty`` makes new ones)."""
    modules = dict(model.named_modules())
    for path, style in tp_plan.items():
        if style == "vocab" and path in modules:
            param = modules[path].weight
            # clone: the shard of a replicated tensor is a view that would keep all V x h alive
            param.register_hook(lambda grad, p=param: grad.redistribute(placements=p.placements).clone())


def apply_ac(model: Transformer, recompute_per_layer: dict[str, str]) -> None:
    """Activation recomputation per layer, each block with its plan.json policy (executor/recompute.py):
    ``full`` checkpoints the whole block and keeps only its input (Korthikanti et al. 2022, Sec 5);
    ``selective`` checkpoints only the attention core; ``op`` checkpoints the block keeping the outputs of
    its matmuls (every other mm) and attention (torchtitan's SelectiveAC); ``activation-offload`` moves what the block
    saves to host memory and back. An every-K plan is its per-layer policies."""
    for index, block in model.layers.items():
        apply_policy(block, recompute_per_layer.get(f"layers.{index}", "none"), attention_core=sdpa)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, units: Iterable[nn.Module], reshard_after_forward: bool,
               mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
               offload_policy: OffloadPolicy = OffloadPolicy()) -> None:
    """FSDP2 (ZeRO-2/3): one unit per module of ``units`` (the blocks), the root unit holds the rest
    (embedding, final norm and head)."""
    for unit in [*units, model]:
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=offload_policy)


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh, *, units: Iterable[nn.Module],
                    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()) -> None:
    """ZeRO-0: every replica keeps everything and all-reduces gradients (torch's FSDP2-based
    ``replicate``, the DDP that composes with DTensor TP), bucketed one unit (block) at a time."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    for unit in units:
        replicate(unit, mesh=dp_mesh, mp_policy=mp_policy)
    replicate(model, mesh=dp_mesh, mp_policy=mp_policy)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """DDP with gradients as views of its buckets (4 bytes per parameter, no other copy)."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), gradient_as_bucket_view=True)


def grads_are_bucket_views(model: nn.Module) -> bool:
    """Whether ``model``'s gradients live in DDP's communication buckets (``apply_ddp``)."""
    from torch.nn.parallel import DistributedDataParallel
    return isinstance(model, DistributedDataParallel) and model.gradient_as_bucket_view


def mixed_precision(precision: str, device_type: str) -> MixedPrecisionPolicy:
    """bf16/fp16 compute with fp32 gradient reduction where the device has it; fp32 on CPU."""
    if device_type == "cpu" or precision == "fp32":
        return MixedPrecisionPolicy()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def offload_policy(optimizer_offload: bool, device_type: str) -> OffloadPolicy:
    """FSDP2's offload policy for plan.json's ``optimizer_offload``. ``CPUOffloadPolicy`` (ZeRO-Offload, Ren et al.
    2021) keeps each rank's sharded parameters, their gradients and so the optimizer step and its states
    in host memory, copying the shards to the device before each all-gather and the reduced gradients
    back (torch/distributed/fsdp/_fully_shard/_fsdp_api.py); planner/runtimes.py's torch layout says so.
    Pinned host memory where there is a GPU to copy to: pinning needs an accelerator."""
    if not optimizer_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def uses_fsdp(plan: RunPlan, dims: ParallelDims) -> bool:
    """Whether FSDP2 (fully_shard, or replicate for ZeRO-0) manages the parameters, their
    gradients' reduction and their mixed precision. ZeRO-0 takes replicate where DDP cannot go:
    DTensor parameters (TP), and pipelines (torch.distributed.pipelining's DDP support breaks
    DDP's first-step bucket rebuild under GPipe and interleaved 1F1B; replicate is its FSDP path)."""
    c = plan.config
    ddp_cannot = dims.tp > 1 or c.pp > 1
    return c.zero >= 2 or (c.zero == 0 and dims.dp * dims.cp > 1 and ddp_cannot)


def autocast_dtype(plan: RunPlan, dims: ParallelDims, device: torch.device) -> torch.dtype | None:
    """The autocast dtype where mixed precision is not FSDP's (DDP keeps fp32 parameters and
    autocasts, as the cost model's torch layout says); None on CPU or in fp32."""
    return autocast_for(plan.workload.precision, device.type, fsdp_managed=uses_fsdp(plan, dims))


def autocast_for(precision: str, device_type: str, *, fsdp_managed: bool) -> torch.dtype | None:
    """``autocast_dtype`` from its parts: the 16-bit dtype where the device has mixed precision and
    FSDP2 does not manage the parameters (its MixedPrecisionPolicy casts them: ``mixed_precision``)."""
    if device_type == "cpu" or precision == "fp32" or fsdp_managed:
        return None
    return torch.bfloat16 if precision == "bf16" else torch.float16


def shard_model(model: Transformer, plan: RunPlan, dims: ParallelDims, mesh: DeviceMesh, dp_cp_mesh: DeviceMesh,
                device_type: str) -> bool:
    """Steps 1-3 on a meta-device ``model``, in place: what a dry run builds (executor/dryrun.py).
    Returns whether FSDP2 manages the parameters (``uses_fsdp``). ``dp_cp_mesh``: the data-parallel
    and context-parallel ranks flattened (``ParallelDims.build_mesh``)."""
    c = plan.config
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], plan.tp_plan, sequence_parallel=c.sequence_parallel)
    if dims.cp > 1:
        apply_cp(model, mesh["cp"])
    apply_ac(model, plan.recompute_per_layer)
    mp_policy = mixed_precision(plan.workload.precision, device_type)
    fsdp_managed = uses_fsdp(plan, dims)
    if c.zero >= 2:
        apply_fsdp(model, dp_cp_mesh, units=model.layers.values(), reshard_after_forward=c.zero == 3,
                   mp_policy=mp_policy, offload_policy=offload_policy(c.optimizer_offload, device_type))
    elif fsdp_managed:
        apply_replicate(model, dp_cp_mesh, units=model.layers.values(), mp_policy=mp_policy)
    return fsdp_managed


def parallelize(model: Transformer, plan: RunPlan, dims: ParallelDims, mesh: DeviceMesh, dp_cp_mesh: DeviceMesh,
                device: torch.device, seed: int) -> nn.Module:
    """Apply the plan to a meta-device ``model`` in place and materialise it; returns the module
    to train (a DDP wrapper where ``apply_ddp`` applies, else ``model`` itself)."""
    fsdp_managed = shard_model(model, plan, dims, mesh, dp_cp_mesh, device.type)
    materialize(model, seed=seed, device=device)
    if dims.tp > 1 and not fsdp_managed:        # FSDP reduces (and shards) gradients itself
        shard_embedding_grads(model, plan.tp_plan)
    if plan.config.zero == 0 and dims.dp * dims.cp > 1 and not fsdp_managed:
        return apply_ddp(model, dp_cp_mesh)
    return model
