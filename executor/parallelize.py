"""Apply a plan to a module (or one pipeline stage of it): one function per parallelism.

Two kinds of module take a plan, through the same functions, by the module paths plan.json names:
meshplan's own models (executor/models.py: built from plan.json's ``model.spec`` on the meta device,
written for tensor parallelism) and a module the user wrote, which ``auto_parallelize`` traced (a
plan without a spec: the module is already real, and its code after a split linear expects whole
tensors). Where the two differ is a parameter of the function concerned, which ``shard_model`` sets
from the plan: the logits a vocabulary-parallel loss takes split (``apply_tp``), a column-parallel
linear no row-parallel one takes next gathering its output (``apply_tp``), the attention core the
``selective`` policy checkpoints (``apply_ac``), the data-parallel units (``dp_units``) and whether
one data-parallel rank is sharded over at all (``dp_wrapper``).

The dispatcher ``parallelize`` composes them in this order (torchtitan's
``models/llama3/infra/parallelize.py`` order, for the same reasons):

1. ``apply_tp``   tensor and sequence parallelism (DTensor ``parallelize_module``) first,
                  so the data-parallel wrappers see DTensor parameters on the tp mesh;
   ``apply_finetune`` LoRA fine-tuning (executor/lora.py), where asked: adapters on the target
                  linears, laid out as their tensor-parallel base is, every other parameter frozen
                  before the data-parallel wrappers record what is trainable;
   ``apply_cp``   context parallelism (executor/context.py): attention gathers keys and values
                  over the cp ranks; no parameter changes;
   ``apply_ep``   expert parallelism (executor/moe.py): routed experts sharded over the ``ep``
                  ranks, tokens exchanged with all-to-alls;
2. ``apply_ac``   activation checkpointing per layer, inside the data-parallel units,
                  so recomputation runs while the unit's parameters are gathered;
   ``apply_compile`` with ``--compile``, each unit ``torch.compile``d, checkpointing inside it;
3. data parallelism by ZeRO stage (``dp_wrapper``); under expert parallelism first the experts'
                  units over the ``efsdp`` ranks (``apply_expert_dp``), then the rest over ``dp_cp`` (the data-parallel and
                  context-parallel ranks hold the same parameters): ``apply_fsdp`` (ZeRO-3:
                  ``fully_shard`` resharding after forward; ZeRO-2: keeping the gathered parameters
                  until backward; with optimizer offload, FSDP2's ``CPUOffloadPolicy``),
                  ``apply_replicate`` (ZeRO-0 with TP or a pipeline: torch's FSDP2-based
                  replicate, the DDP that composes with DTensor and with every schedule);
4. ``materialize`` meshplan's own model's meta parameters shard by shard (each rank allocates and
                  fills only its own shards, with values that do not depend on the plan);
5. ``apply_ddp``  ZeRO-0 without TP or pipeline: DDP, which needs real parameters (and keeps no
                  second copy of them, unlike replicate). ZeRO-1 takes no wrapper: gradients
                  accumulate locally and the trainer's ``ShardedAdamW`` (executor/zero1.py)
                  reduce-scatters them, updates its rows and all-gathers the parameters.

A user's module is cut into pipeline stages before all this (executor/pipeline.py ``split_pipeline``).
"""
from __future__ import annotations

from typing import Callable, Iterable, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from planner.errors import UserError
from planner.plan import Plan

from .context import apply_cp
from .lora import LoraConfig, apply_lora
from .mesh import ParallelDims
from .models import Attention, LatentAttention, SinkAttention, materialize, sdpa
from .moe import MoE, apply_ep, expert_units, routed_expert_params
from .qlora import quantize_base
from .activations import apply_policy
from .selective import selective_forward
from .zero1 import expert_dim


def tp_style(style: str, sequence_parallel: bool, *, loss_parallel: bool = True, gather_output: bool = False):
    """The DTensor style of one plan.json TP entry (planner/config.py's TP_STYLES documents the styles).
    ``loss_parallel``: a ``colwise_loss`` head keeps its logits split over the vocabulary for a
    vocabulary-parallel loss, else gathers them for a loss that takes whole logits; ``gather_output``: a
    ``colwise`` linear gathers its output (no row-parallel linear takes it split)."""
    seq = Shard(1) if sequence_parallel else Replicate()      # layout of the residual stream (B, S, h)
    if style == "colwise":          # input already made Replicate by the parent's PrepareModuleInput
        return ColwiseParallel(output_layouts=Replicate()) if gather_output else ColwiseParallel()
    if style == "rowwise":          # partial sums reduced (SP: reduce-scattered along the sequence)
        return RowwiseParallel(output_layouts=seq)
    if style == "vocab":            # vocabulary-split embedding; its parent puts the output in `seq` layout
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "colwise_loss":     # logits stay split over the vocabulary for loss_parallel, else gathered
        if loss_parallel:
            return ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
        return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    return SequenceParallel()       # "sequence": norms on the local sequence chunk


def _layer_of(path: str, layers: Iterable[str]) -> str | None:
    """The layer holding module ``path`` (the longest layer path that is it or a prefix of it)."""
    owners = [layer for layer in layers if path == layer or path.startswith(layer + ".")]
    return max(owners, key=len) if owners else None


def _gathers_output(entries: list[tuple[str, str]], i: int, layers: list[str]) -> bool:
    """Whether the ``colwise`` linear ``entries[i]`` gathers its output: the next entry after it (and
    its sibling colwise linears) is not a row-parallel linear of the same layer."""
    path, _ = entries[i]
    after, style = next(((p, s) for p, s in entries[i + 1:] if s != "colwise"), (None, None))
    return not (style == "rowwise" and _layer_of(after, layers) == _layer_of(path, layers))


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: dict[str, str], *, sequence_parallel: bool,
             loss_parallel: bool = True, layers: list[str] | None = None) -> None:
    """Shard the modules plan.json names (Megatron's pattern, Shoeybi et al. 2019, Sec 3; sequence
    parallelism, Korthikanti et al. 2022, Sec 4.2.2). Paths of modules this stage does not hold are
    skipped, and ``sequence`` entries without ``sequence_parallel``. Under SP the parents of column-parallel
    linears gather the sequence once for all of them, and the embedding's parent scatters its output
    along the sequence. ``loss_parallel``: ``tp_style``'s. ``layers`` (a user's module, whose code after
    a linear expects whole tensors): the module's layer paths; a column-parallel linear keeps its output
    split only where a row-parallel linear of its layer consumes it next, any other (a column linear
    alone) gathers it. None (meshplan's own models, written for TP): every colwise output stays split.
    Multi-head latent attention whose ``kv_up`` is column parallel sums the gradient of the RoPE key its heads
    share over the tp ranks (``LatentAttention.shares_rope_key``)."""
    modules = dict(model.named_modules())
    entries = list(tp_plan.items())
    styles = {}
    for i, (path, style) in enumerate(entries):
        if path not in modules or (style == "sequence" and not sequence_parallel):
            continue                # another pipeline stage's module, or a norm without SP
        gather = style == "colwise" and layers is not None and _gathers_output(entries, i, layers)
        styles[path] = tp_style(style, sequence_parallel, loss_parallel=loss_parallel, gather_output=gather)
    if sequence_parallel:
        for path, style in tp_plan.items():
            parent = path.rpartition(".")[0]
            if path not in modules or not parent:
                continue
            if style == "colwise":
                styles[parent] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            elif style == "vocab":
                styles[parent] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    for path, module in modules.items():
        if isinstance(module, Attention) and module.qk_norm is not None:
            _norm_heads(styles, path, tp_plan)
        if isinstance(module, MoE):
            _moe_styles(styles, path, module, tp_plan)
    parallelize_module(model, tp_mesh, styles)
    for path, module in modules.items():
        if isinstance(module, LatentAttention) and tp_plan.get(f"{path}.kv_up") == "colwise":
            module.shares_rope_key(tp_mesh)      # its heads split: the shared RoPE key's gradient summed
        if isinstance(module, SinkAttention) and tp_plan.get(f"{path.rpartition('.')[0]}.q_proj") == "colwise":
            # GPT-OSS's sinks, one per head: each rank holds its own heads' (torchtitan shards them so)
            module.sinks = nn.Parameter(distribute_tensor(module.sinks.data, tp_mesh, [Shard(0)], src_data_rank=None))


def _norm_heads(styles: dict, path: str, tp_plan: dict[str, str]) -> None:
    """The styles of attention ``path``'s per-head q and k norms (Qwen3: ``QKNorm``): where its q or k projection is
    column parallel, each rank norms its own heads with the norm's whole weight, so the norm runs as DTensor's
    SequenceParallel along the heads dimension of (B, S, heads, head_dim), its weight replicated and its gradient,
    partial on each rank, summed over them (torchtitan shards Qwen3's q_norm and k_norm the same way, sequence_dim
    2); elsewhere every rank norms every head and the norm stays a plain module. The plan's entry for the planner's
    one ``qk_norm`` op (their container) is dropped: its two norms are the modules that run."""
    styles.pop(f"{path}.qk_norm", None)
    for norm, proj in (("q", "q_proj"), ("k", "k_proj")):
        if tp_plan.get(f"{path}.{proj}") == "colwise":
            styles[f"{path}.qk_norm.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)


def _moe_styles(styles: dict, path: str, moe: MoE, tp_plan: dict[str, str]) -> None:
    """The styles of MoE block ``path`` under tensor parallelism, as torchtitan runs one (the runtime table makes it
    sequence parallel and its experts split over ep ranks): the block takes and gives back its rank's share of the
    sequence as a plain tensor, which it routes itself; its routed experts are not tensor parallel (expert
    parallelism splits them; the plan's column and row entries for them are dropped); the router and, where the
    plan replicates them, the shared experts run on the rank's tokens with their weights replicated, their
    gradients, partial on each rank, summed over the tp ranks (DTensor's SequenceParallel, as for a norm); shared
    experts the plan splits run as a dense MLP does (their input gathered, their output reduce-scattered), and
    Qwen2-MoE's gate beside them as a row-parallel linear of that gathered input, reduce-scattered the same way."""
    for name in ("gate_proj", "up_proj", "down_proj"):
        styles.pop(f"{path}.{name}", None)
    styles[path] = PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
        output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=True)
    styles[f"{path}.router"] = SequenceParallel(sequence_dim=0, use_local_output=True)    # on (tokens, h)
    if moe.shared is None:
        return
    if tp_plan.get(f"{path}.shared.gate_proj") == "colwise":
        if moe.shared.gate is not None:
            styles[f"{path}.shared.gate"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    else:       # each linear its own (SequenceParallel replicates the parameters of a leaf module)
        for name, _ in moe.shared.named_children():
            styles[f"{path}.shared.{name}"] = SequenceParallel(use_local_output=True)


def shard_embedding_grads(model: nn.Module, tp_plan: dict[str, str]) -> None:
    """DTensor's embedding backward returns the vocabulary-parallel table's gradient replicated
    (V x h on every TP rank); keep only this rank's rows, as the parameter itself is sharded.
    Hooks the materialised parameters (``to_empty`` makes new ones)."""
    modules = dict(model.named_modules())
    for path, style in tp_plan.items():
        if style == "vocab" and path in modules and modules[path].weight.requires_grad:     # not frozen (LoRA)
            param = modules[path].weight
            # clone: the shard of a replicated tensor is a view that would keep all V x h alive
            param.register_hook(lambda grad, p=param: grad.redistribute(placements=p.placements).clone())


def apply_ac(model: nn.Module, recompute_per_layer: dict[str, str], *,
             attention_core: Callable | None = None) -> list[str]:
    """Activation recomputation per layer, each with its plan.json policy (executor/activations.py):
    ``full`` checkpoints the whole layer and keeps only its input (Chen et al. 2016; Korthikanti et al.
    2022, Sec 5); ``selective`` checkpoints only ``attention_core``, the layer's attention kernel call;
    ``op`` checkpoints the layer keeping the outputs of its matmuls (every other mm) and attention
    (torchtitan's SelectiveAC); ``activation-offload`` moves what the layer saves to host memory and back. An every-K
    plan is its per-layer policies. Paths of layers this stage does not hold are skipped.

    Where the attention core is not known (``attention_core`` None: a user's module), ``selective``
    runs torch's selective checkpointing with a policy that finds the core op by op and recomputes the
    layer's pointwise ops too (executor/selective.py); the other policies need no core and run as planned.
    Returns the notes to report: where the run's recompute differs from the plan's."""
    modules = dict(model.named_modules())
    notes = []
    for path, policy in recompute_per_layer.items():
        if policy == "none" or path not in modules or not path:
            continue
        layer = modules[path]
        if attention_core is None and policy == "selective":
            layer.forward = selective_forward(layer, path)
            notes.append(f"{path}: selective recompute also recomputes the layer's pointwise ops (the plan prices "
                         "the attention core alone)")
        else:
            apply_policy(layer, policy, attention_core=attention_core)
    return notes


def apply_compile(units: Iterable[nn.Module]) -> None:
    """Each data-parallel unit (meshplan's blocks; a user's layers) ``torch.compile``d in place
    (``nn.Module.compile``: the module stays, its forward runs compiled), after activation checkpointing
    and before the data-parallel wrappers, as torchtitan compiles each transformer block
    (torchtitan/models/llama3/infra/parallelize.py ``apply_compile``): FSDP2's hooks stay outside the
    graphs, and the graphs are compiled at the first step (inductor; on a CPU too). A unit whose forward
    ``apply_ac`` replaced (``full`` and ``op``: the block's forward under ``torch.utils.checkpoint``, an
    attribute of the instance) has that forward compiled: ``nn.Module.compile`` compiles the module's
    call, which dynamo does not trace through such an attribute (it captured no graph)."""
    for unit in units:
        if "forward" in vars(unit):
            unit.forward = torch.compile(unit.forward)
        else:
            unit.compile()


def apply_expert_dp(model: nn.Module, expert_mesh: DeviceMesh, *, sharded: bool, reshard_after_forward: bool,
                    divide_factor: int, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                    offload_policy: OffloadPolicy = OffloadPolicy()) -> None:
    """Data parallelism of the routed experts under expert parallelism: one unit per MoE block (its
    gate, up and down experts) over the ``efsdp`` ranks holding the same experts, FSDP2 (``sharded``:
    ZeRO-2/3) or replicate (ZeRO-0). Their gradients are divided by ``divide_factor`` (the dp x cp
    ranks), not by efsdp: an expert's gradient on its rank already sums the tokens of the ep ranks,
    so over efsdp it sums all dp x cp ranks' (torchtitan sets FSDP's gradient divide factor for its
    experts the same way). Each expert tensor is sharded along ``expert_dim`` of its local stack: the
    experts where the efsdp ranks divide them, else the output features where they divide those, else the
    experts unevenly (FSDP2 pads dim 0 only)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    efsdp = expert_mesh["efsdp"]
    for _, _, units in expert_units(model):
        if sharded:
            fully_shard(units, mesh=efsdp, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                        offload_policy=offload_policy, shard_placement_fn=_expert_placement(efsdp.size()))
        else:
            replicate(units, mesh=efsdp, mp_policy=mp_policy)
        units[0].set_gradient_divide_factor(float(divide_factor))
        if sharded and efsdp.size() > 1 and dist.get_backend(efsdp.get_group()) == "gloo":
            # gloo has no PREMUL_SUM: sum, then divide. Not over one rank, nor for replicate: FSDP2 divides
            # there as it copies the unreduced gradient (its reduce-scatter is skipped), and would divide
            # again after the sum (torch 2.13 _fsdp_collectives.foreach_reduce)
            units[0].set_force_sum_reduction_for_comms(True)


def _expert_placement(n: int, stacks: frozenset[int] | None = None):
    """FSDP2's ``shard_placement_fn`` for stacks of routed experts over ``n`` ranks: ``expert_dim`` of the local
    tensor (where ``stacks`` is given, for those parameters only; FSDP2's dim 0 for the others)."""
    def placement(p: nn.Parameter) -> Shard | None:
        if stacks is not None and id(p) not in stacks:
            return None
        local = p.to_local() if isinstance(p, DTensor) else p
        return Shard(expert_dim(local.shape, n))
    return placement


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, units: Iterable[nn.Module], reshard_after_forward: bool,
               mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
               offload_policy: OffloadPolicy = OffloadPolicy()) -> None:
    """FSDP2 (ZeRO-2/3): one unit per module of ``units`` (``dp_units``: the blocks), the root unit holds
    the rest (embedding, final norm and head). Routed experts that expert parallelism does not split are
    stacks of all E experts, which dim 0 would shard unevenly over more ranks than E (Mixtral's 8 over 64: each
    rank would hold a padded eighth): they go along ``expert_dim``, as the split experts' do."""
    placement = _expert_placement(dp_mesh.size(), routed_expert_params(model))
    for unit in [*units, model]:
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    offload_policy=offload_policy, shard_placement_fn=placement)


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


def dp_wrapper(plan: Plan, dims: ParallelDims) -> Literal["fsdp", "replicate", "ddp"] | None:
    """The data-parallel wrapper of a plan, by ZeRO stage (Rajbhandari et al. 2020) over the ``dp_cp``
    ranks: FSDP2's ``fully_shard`` for ZeRO-2/3 (on meshplan's own models even over one rank, where it
    still applies the mixed-precision and offload policies; a user's module is not wrapped where there
    is nothing to shard over); for ZeRO-0 with more than one replica, ``replicate`` where DDP cannot go
    (``uses_fsdp``; under expert parallelism too: its experts are units over other ranks), else DDP; none for ZeRO-1 (its optimizer reduces: executor/zero1.py)."""
    c, replicas = plan.config, dims.dp * dims.cp
    if c.zero >= 2 and (replicas > 1 or plan.spec is not None):
        return "fsdp"
    if c.zero == 0 and replicas > 1:
        return "replicate" if dims.tp > 1 or c.pp > 1 or dims.ep > 1 else "ddp"
    return None


def uses_fsdp(plan: Plan, dims: ParallelDims) -> bool:
    """Whether FSDP2 (fully_shard, or replicate for ZeRO-0) manages the parameters, their
    gradients' reduction and their mixed precision. ZeRO-0 takes replicate where DDP cannot go:
    DTensor parameters (TP), and pipelines (torch.distributed.pipelining's DDP support breaks
    DDP's first-step bucket rebuild under GPipe and interleaved 1F1B; replicate is its FSDP path)."""
    return dp_wrapper(plan, dims) in ("fsdp", "replicate")


def dp_units(model: nn.Module, plan: Plan) -> list[str]:
    """The paths of the modules that become FSDP2 / replicate units (the root unit holds the rest):
    meshplan's own model's blocks (its embedding, final norm and head stay in the root); every layer of a
    user's module that ``model`` (a stage of it) holds."""
    if plan.spec is not None:
        return [f"layers.{index}" for index in model.layers]
    modules = dict(model.named_modules())
    return [path for stage in plan.stages for path in stage if path in modules and path]


def autocast_dtype(plan: Plan, dims: ParallelDims, device: torch.device) -> torch.dtype | None:
    """The autocast dtype where mixed precision is not FSDP's (DDP keeps fp32 parameters and
    autocasts, as the cost model's torch layout says); None on CPU or in fp32."""
    return autocast_for(plan.workload.precision, device.type, fsdp_managed=uses_fsdp(plan, dims))


def autocast_for(precision: str, device_type: str, *, fsdp_managed: bool) -> torch.dtype | None:
    """``autocast_dtype`` from its parts: the 16-bit dtype where the device has mixed precision and
    FSDP2 does not manage the parameters (its MixedPrecisionPolicy casts them: ``mixed_precision``)."""
    if device_type == "cpu" or precision == "fp32" or fsdp_managed:
        return None
    return torch.bfloat16 if precision == "bf16" else torch.float16


def fp8_module_filter(recipe: str) -> Callable[[nn.Module, str], bool]:
    """torchao's module filter for ``recipe``: the nn.Linear the planner prices in FP8 (planner/precision.py
    ``converts_linear`` for meshplan's runtime). Routed experts are grouped weights, not nn.Linear: left alone."""
    from planner.precision import converts_linear
    from planner.runtimes import EXECUTOR_RUNTIME

    def keep(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and converts_linear(fqn, module.out_features, module.in_features,
                                                                 recipe, EXECUTOR_RUNTIME)
    return keep


def apply_fp8(model: nn.Module, recipe: str, *, emulate: bool = False) -> list[str]:
    """Convert ``model``'s linears in place to torchao's float8 training linears for ``recipe``
    (torchao.float8 ``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``, as torchtitan's
    float8 converter does), before tensor parallelism, compile and FSDP2 wrap them; the filter is the planner's
    (``fp8_module_filter``). ``emulate``: torchao's emulation of the FP8 GEMMs in higher precision, for a device
    without FP8 (tests on a CPU). Returns the converted modules' paths."""
    from dataclasses import replace

    from planner.precision import RECIPES
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise UserError(f"{recipe} needs torchao's float8 training: pip install 'meshplan[fp8]' (torchao)",
                        field="workload.fp8") from None
    config = Float8LinearConfig.from_recipe_name(RECIPES[recipe].torchao_name)
    if emulate:
        config = replace(config, emulate=True)
    keep = fp8_module_filter(recipe)
    chosen = [fqn for fqn, module in model.named_modules() if keep(module, fqn)]
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return chosen


def apply_finetune(model: nn.Module, plan: Plan, lora: LoraConfig, device_type: str = "cpu") -> list[str]:
    """LoRA adapters on ``lora``'s targets, every other parameter frozen (executor/lora.py), after tensor
    parallelism (the adapters take their base linear's layout) and before the data-parallel wrappers (which
    record what is trainable). Where the plan computes in bf16 or fp16 (on a GPU: ``mixed_precision``'s rule) the
    frozen parameters are stored in that dtype, as PEFT's recipes load the base (``torch_dtype``) and as the
    planner prices them (planner/finetune.py): they need no fp32 master for an update, and autocast has no copy to
    make. FSDP2 asks one dtype of the trainable parameters only (``FSDPParamGroup._init_mp_dtypes``) and gathers a
    unit of mixed dtypes as bytes. Refused where it is not built yet: a user's module, float8 linears."""
    if plan.spec is None:
        raise UserError("LoRA adapters apply to meshplan's own models (plan.json with model.spec), not to a "
                        "traced module", source=plan.source, field="lora")
    if plan.workload.fp8:
        raise UserError(f"LoRA with float8 linears ({plan.workload.fp8}) is not built; plan with --precision "
                        "bf16 or fp32", source=plan.source, field="workload.fp8")
    adapted = apply_lora(model, rank=lora.rank, alpha=lora.alpha, targets=lora.targets)
    dtype = mixed_precision(plan.workload.precision, device_type).param_dtype
    if dtype is not None:       # new parameters (a DTensor's .data cannot change dtype), the tied pair tied again
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if not param.requires_grad and param.dtype != dtype:
                    setattr(module, name, nn.Parameter(param.detach().to(dtype), requires_grad=False))
        model.tie_weights()
    return adapted


def shard_model(model: nn.Module, plan: Plan, dims: ParallelDims, mesh: DeviceMesh, dp_cp_mesh: DeviceMesh,
                device_type: str, expert_mesh: DeviceMesh | None = None, lora: LoraConfig | None = None) -> list[str]:
    """Steps 1-3 on ``model`` in place: what a dry run builds (executor/dryrun.py). ``model``: meshplan's
    own model (or a stage of it) where the plan has a spec, else the user's traced module (or a stage of
    it). ``dp_cp_mesh``: the data-parallel and context-parallel ranks flattened (``ParallelDims.build_mesh``);
    ``expert_mesh``: under expert parallelism, the same ranks as (efsdp, ep) (``build_expert_mesh``);
    ``lora``: LoRA fine-tuning (``apply_finetune``, after step 1), None to train every parameter.
    Returns the notes of where the run differs from the plan (``apply_ac``'s)."""
    c, own = plan.config, plan.spec is not None      # meshplan's own model, else a user's traced module
    if plan.workload.fp8:       # torchao's float8 linears (tp 1: Combinations.fp8_with_tp)
        apply_fp8(model, plan.workload.fp8)
    if dims.tp > 1:
        # meshplan's loss is vocabulary-parallel (executor/train.py), a user's takes whole logits
        apply_tp(model, mesh["tp"], plan.tp_plan, sequence_parallel=c.sequence_parallel, loss_parallel=own,
                 layers=None if own else [path for stage in plan.stages for path in stage])
        if own:
            model.tie_weights()     # TP replaced the shared weight in embed and head by two DTensors: share again
    if lora is not None:
        apply_finetune(model, plan, lora, device_type)
    if dims.cp > 1:
        apply_cp(model, mesh["cp"])
    if expert_mesh is not None:
        apply_ep(model, expert_mesh["ep"])
    notes = apply_ac(model, plan.recompute_per_layer, attention_core=sdpa if own else None)
    modules = dict(model.named_modules())
    units = [modules[path] for path in dp_units(model, plan)]
    if plan.workload.compile:
        apply_compile(units)
    mp_policy = mixed_precision(plan.workload.precision, device_type)
    wrapper = dp_wrapper(plan, dims)
    if expert_mesh is not None and wrapper in ("fsdp", "replicate"):
        apply_expert_dp(model, expert_mesh, sharded=wrapper == "fsdp", reshard_after_forward=c.zero == 3,
                        divide_factor=dims.dp * dims.cp, mp_policy=mp_policy,
                        offload_policy=offload_policy(c.optimizer_offload, device_type))
    if wrapper == "fsdp":
        apply_fsdp(model, dp_cp_mesh, units=units, reshard_after_forward=c.zero == 3, mp_policy=mp_policy,
                   offload_policy=offload_policy(c.optimizer_offload, device_type))
    elif wrapper == "replicate":
        apply_replicate(model, dp_cp_mesh, units=units, mp_policy=mp_policy)
    return notes


def parallelize(model: nn.Module, plan: Plan, dims: ParallelDims, mesh: DeviceMesh, dp_cp_mesh: DeviceMesh,
                device: torch.device, seed: int = 0, expert_mesh: DeviceMesh | None = None,
                lora: LoraConfig | None = None) -> tuple[nn.Module, list[str]]:
    """Apply the plan to ``model`` in place (``shard_model``'s), materialising meshplan's own model (built on
    the meta device; a user's module is real already) from ``seed``; ``lora``: LoRA fine-tuning (adapters,
    the rest frozen), None to train every parameter. Returns the module to train (a DDP wrapper where
    ``apply_ddp`` applies, else ``model`` itself) and the notes of where the run differs from the plan."""
    notes = shard_model(model, plan, dims, mesh, dp_cp_mesh, device.type, expert_mesh, lora)
    if plan.spec is not None:
        materialize(model, seed=seed, device=device)
    if lora is not None and lora.nf4_base:          # QLoRA: from the real, whole base weights (executor/qlora.py)
        quantize_base(model)
    if dims.tp > 1 and not uses_fsdp(plan, dims):       # FSDP reduces (and shards) gradients itself
        shard_embedding_grads(model, plan.tp_plan)
    if dp_wrapper(plan, dims) == "ddp":
        return apply_ddp(model, dp_cp_mesh), notes
    return model, notes
