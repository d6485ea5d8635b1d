"""What a baseline file says, as plain values, and the checks every reader shares.

A reader turns its file into a ``Baseline``: the knobs (degrees, batch, schedule,
recompute, ZeRO, offload) already laid over the model's layer graph, the workload the
file implies, the flags it modelled, the flags it read and does not model (``ignored``,
never dropped silently) and where the mapping is an approximation (``notes``). Errors
name the file, the flag, the value and what is allowed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import schedules
from ..config import ParallelConfig, Workload
from ..placement import balanced_stage_layers, stage_layers_of_blocks
from ..errors import UserError, one_of
from ..layers import LayerGraph
from ..model import ModelSpec
from ..recompute import every_k_layers, summary_policy


@dataclass(frozen=True, kw_only=True)
class Context:
    """What the command line adds to the file."""

    gpus: int                          # --gpus: the world size
    global_batch: int | None = None    # --global-batch
    seq_len: int | None = None         # --seq-len
    tp: int | None = None              # --tp, --pp: a DeepSpeed JSON holds no Megatron-DeepSpeed degrees
    pp: int | None = None
    ep: int | None = None              # --ep: DeepSpeed-MoE's ep_size is an argument of its MoE layers, not a key


@dataclass(frozen=True, kw_only=True)
class FileModel:
    """What a file says about the model, read before the model is loaded."""

    spec: ModelSpec | None = None                 # a whole architecture (Megatron flags, plan.json)
    name: str | None = None                       # a zoo model the file names (torchtitan's [model] flavor)
    name_flag: str = "model"                      # where the file names it
    shape: dict[str, tuple[str, int]] = field(default_factory=dict)   # ModelSpec field -> (flag, value)
    seq_len: tuple[str, int] | None = None        # (flag, value) of the sequence length
    seq_len_default: int | None = None            # the runtime's when the file sets none
    missing: str = ""                             # why no spec, when the file has none
    notes: tuple[str, ...] = ()                   # approximations in reading the model


@dataclass(frozen=True, kw_only=True)
class Baseline:
    """A training job's own configuration in meshplan's terms."""

    source: str                        # the file
    format: str                        # megatron, deepspeed, torchtitan, torchtitan-python or plan.json
    runtime: str                       # whose memory layout models it (Workload.framework)
    config: ParallelConfig
    global_batch: int                  # sequences per optimizer step
    seq_len: int
    precision: str
    attention: str = "flash"
    overlap_grad_reduce: bool = True
    tp_comm_overlap: bool = False
    ep_comm_overlap: bool = False
    expert_dispatcher: str = "alltoall"
    expert_imbalance: float = 1.0
    fp8: str = ""                      # the FP8 recipe of its linears (planner/precision.py), "" for none
    fp8_param_gather: bool = False
    grad_reduce_in_bf16: bool = False
    compile: bool = False
    finetune: str = "full"             # the training mode (planner/finetune.py) and its adapters
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    flags: dict[str, str] = field(default_factory=dict)     # meshplan flag -> the file's flag or key
    ignored: tuple[str, ...] = ()      # flags read and not modelled
    notes: tuple[str, ...] = ()        # where the mapping is an approximation

    def workload(self) -> Workload:
        return Workload(global_batch=self.global_batch, seq_len=self.seq_len, precision=self.precision,
                        framework=self.runtime, attention=self.attention,
                        overlap_grad_reduce=self.overlap_grad_reduce, tp_comm_overlap=self.tp_comm_overlap,
                        ep_comm_overlap=self.ep_comm_overlap, expert_dispatcher=self.expert_dispatcher,
                        expert_imbalance=self.expert_imbalance,
                        fp8=self.fp8, fp8_param_gather=self.fp8_param_gather,
                        grad_reduce_in_bf16=self.grad_reduce_in_bf16, compile=self.compile, finetune=self.finetune,
                        lora_rank=self.lora_rank, lora_targets=self.lora_targets)


def positive_int(source: str, flag: str, value, minimum: int = 1) -> int:
    """``value`` (a number or its text) as an integer >= ``minimum``, else an error naming the flag."""
    if isinstance(value, str) and value.lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise UserError(f"expected {what}, got {value!r}", source=source, field=flag)
    return value


def choice(source: str, flag: str, value, allowed) -> str:
    if value not in allowed:
        raise UserError(f"{value!r} is not allowed; allowed: {one_of(allowed)}", source=source, field=flag)
    return value


def data_parallel(source: str, gpus: int, degrees: dict[str, int]) -> int:
    """The data-parallel degree the GPUs leave: gpus / the product of the other degrees
    (flag -> value), an error naming the flags when it does not divide."""
    product = math.prod(degrees.values())
    if gpus % product:
        used = " x ".join(str(v) for v in degrees.values())
        raise UserError(f"{used} = {product} does not divide the {gpus} GPUs of --gpus; allowed: degrees whose "
                        f"product divides {gpus}", source=source, field=" x ".join(degrees))
    return gpus // product


def global_batch(source: str, flag: str, in_file: int | None, ctx: Context, default: int | None) -> int:
    """The global batch: the file's, else --global-batch, else the runtime's default; an
    error when the file and --global-batch disagree."""
    if in_file is not None and ctx.global_batch is not None and in_file != ctx.global_batch:
        raise UserError(f"{in_file} sequences per step, but --global-batch is {ctx.global_batch}; give one of them "
                        "or the same number", source=source, field=flag)
    value = in_file if in_file is not None else ctx.global_batch if ctx.global_batch is not None else default
    if value is None:
        raise UserError("the file gives no global batch; allowed: set it there or give --global-batch",
                        source=source, field=flag)
    return value


def microbatches(source: str, global_flag: str, micro_flag: str, batch: int, dp: int, micro: int) -> int:
    """Micro-batches per replica per step: batch / (dp x micro-batch), an error when it does not divide."""
    if batch % (dp * micro):
        raise UserError(f"{batch} sequences do not split into {dp} data-parallel replicas x micro-batches of "
                        f"{micro} ({micro_flag}); allowed: a multiple of {dp * micro}", source=source,
                        field=global_flag)
    return batch // (dp * micro)


def schedule_of(pp: int, vpp: int) -> str:
    """The schedule a framework runs for ``vpp`` virtual stages per rank when the file names none."""
    return schedules.default_for(vpp if pp > 1 else 1)


def pipeline_layers(source: str, flag: str, graph: LayerGraph, blocks: list[int] | None) -> tuple[int, ...] | None:
    """Layers per virtual stage of the layer graph from blocks per virtual stage; None when
    there is no pipeline or the split is the balanced one (the config's default)."""
    if blocks is None or len(blocks) == 1:
        return None
    if sum(blocks) != graph.num_blocks or min(blocks) < 0:
        raise UserError(f"blocks per virtual stage {blocks} do not add up to the model's {graph.num_blocks} "
                        "layers", source=source, field=flag)
    layers = stage_layers_of_blocks(graph, blocks)
    if 0 in layers:
        raise UserError(f"blocks per virtual stage {blocks} leave virtual stage {layers.index(0)} without a "
                        "layer; allowed: at least one layer per stage", source=source, field=flag)
    return None if layers == balanced_stage_layers(graph, len(blocks)) else layers


def recompute_of(graph: LayerGraph, per_block: list[str]) -> tuple[str, tuple[str, ...] | None]:
    """(recompute, recompute_layers) of a policy per transformer block: one policy for all
    blocks is uniform; mixed ones go per layer (as the stage ILP writes them)."""
    used = set(per_block)
    if len(used) == 1:
        return used.pop(), None
    policies = iter(per_block)
    layers = tuple(next(policies) if layer.is_block else "none" for layer in graph.layers)
    full = [i + 1 for i, p in enumerate(per_block) if p == "full"]
    if used == {"none", "full"} and layers == every_k_layers(graph, full[0]):
        return f"every-{full[0]}", layers            # full on every K-th block (planner/recompute.py)
    return summary_policy(per_block), layers
