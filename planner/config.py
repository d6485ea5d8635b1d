"""The knobs: what a training job runs (Workload) and how it is split (ParallelConfig)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal

from . import schedules
from .errors import UserError, one_of
from .recompute import POLICIES, canonical, every_k
from .runtimes import RUNTIMES, config_refusals

Precision = Literal["bf16", "fp16", "fp32"]
Framework = Literal["torch", "megatron", "deepspeed", "torchtitan", "deepspeed-2021", "megatron-2021"]
Schedule = str      # a name of planner/schedules.py's records
Recompute = str     # one of RECOMPUTES, or "every-K" (planner/recompute.py says what each is)

PRECISIONS = ("bf16", "fp16", "fp32")
FRAMEWORKS = tuple(RUNTIMES)       # planner/runtimes.py
SCHEDULES = schedules.NAMES
RECOMPUTES = POLICIES
ZERO_STAGES = (0, 1, 2, 3)

# How the executor shards a module under tensor parallelism (torch.distributed.tensor.parallel):
#   colwise  ColwiseParallel (output features split)      rowwise   RowwiseParallel (input features split)
#   vocab    RowwiseParallel on an embedding (vocabulary split)
#   colwise_loss  ColwiseParallel keeping the logits sharded for a vocab-parallel loss
#   sequence SequenceParallel (norms, with sequence parallelism on)
TP_STYLES = ("colwise", "rowwise", "vocab", "colwise_loss", "sequence")

# The memory a plan must leave free, as a fraction of its predicted peak of tensor memory (the device
# profile's runtime reserve aside): a plan fits when reserve + (peak - reserve) x (1 + headroom) is at
# most the device's memory. 0.18 is the largest gap between the predicted peak and the peak torch's
# caching allocator reserved (torch.cuda.max_memory_reserved: what runs out) on the 18 H100 runs of
# benchmarks/results/gpu_validate.json and gpu_holdout_validate.json (llama-1b, micro-batch 4, 2k tokens,
# FSDP: +17.8%; allocated peaks were up to 6.6% above the prediction, the allocator's reserve up to 17%
# above those). It was 0.21 until 2026-11-29, when autocast's fp32 residual stream entered the activations
# (planner/cost/layer.py RESIDUAL_AUTOCAST_BYTES; allocated peaks had been up to 11.8% above the prediction).
# tests/test_headroom.py recomputes it from those files.
DEFAULT_MEMORY_HEADROOM = 0.18


# what the estimate of a plan with compiled blocks (Workload.compile) says of them, wherever it says it
COMPILE_PRICED_AS = ("compiled blocks: their pointwise ops fused (priced at their bytes) and recomputed in "
                     "backward rather than saved")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one optimizer step processes and with which runtime."""

    global_batch: int                      # sequences per optimizer step
    seq_len: int                           # tokens per sequence
    precision: Precision = "bf16"          # compute dtype; bf16/fp16 are mixed precision with fp32 master weights
    framework: Framework = "torch"         # whose memory layout and overlap behaviour is modelled
    attention: Literal["flash", "unfused"] = "flash"   # fused attention kernels (Dao et al. 2022) or
                                           # materialised scores (Megatron-LM before 2022)
    overlap_grad_reduce: bool = True       # data-parallel gradient reduction overlaps backward (DDP buckets,
                                           # FSDP, Megatron-Core --overlap-grad-reduce)
    tp_comm_overlap: bool = False          # TP collectives overlap the GEMMs (TransformerEngine userbuffers,
                                           # Megatron-Core --tp-comm-overlap)
    ep_comm_overlap: bool = False          # expert parallelism's all-to-alls run beside another micro-batch's compute
                                           # (Megatron-Core --overlap-moe-expert-parallel-comm with
                                           # --delay-wgrad-compute: planner/cost/layer.py ``_overlapped_exchange_s``)
    optimizer: Literal["adamw"] = "adamw"  # Adam(W): two fp32 moments per parameter (Loshchilov & Hutter 2019)
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM   # memory a plan leaves free (DEFAULT_MEMORY_HEADROOM)
    expert_dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"   # how tokens reach their experts
                                           # under expert parallelism (planner/cost/layer.py _expert_exchange_s):
                                           # all-to-alls, Megatron-LM's all-gather and reduce-scatter, or its flex
                                           # dispatcher (DeepEP: once per node and GPU, not per expert)
                                           # (--moe-token-dispatcher-type; Combinations.expert_dispatchers)
    compile: bool = False                  # torch: each transformer block torch.compile'd (torchtitan's per-block
                                           # compile; --compile): COMPILE_PRICED_AS, planner/cost/layer.py
    fp8: str = ""                          # an FP8 training recipe for the linears on top of bf16 (planner/
                                           # precision.py RECIPES; --precision fp8-...), "" for none
    fp8_param_gather: bool = False         # Megatron-LM's --fp8-param-gather: the converted linears' parameters
                                           # kept and all-gathered in FP8 (the distributed optimizer's gather)
    grad_reduce_in_bf16: bool = False      # Megatron-LM's --grad-reduce-in-bf16: gradients accumulated and
                                           # reduced in bf16 (2 bytes) instead of its fp32 main gradients
    expert_imbalance: float = 1.0          # under expert parallelism, the tokens the busiest rank's experts receive
                                           # over the balanced share (>= 1): its expert GEMMs, activations and all-to-
                                           # all traffic grow by it and the step waits for it. 1: balanced, as the
                                           # published MoE benchmarks force it (Megatron-Bridge's performance summary)
    finetune: str = "full"                 # training mode (planner/finetune.py MODES; --finetune): "full", "lora"
                                           # (base frozen, low-rank adapters train) or "qlora" (LoRA over NF4 base
                                           # linears)
    lora_rank: int = 0                     # the adapters' rank r under lora/qlora (0 under full; --lora-rank)
    lora_targets: tuple[str, ...] = ()     # the projections with adapters (planner/finetune.py TARGETS; --lora-targets)

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def precision_name(self) -> str:
        """The --precision value: the compute dtype, or the FP8 recipe of the linears on top of bf16."""
        return self.fp8 or self.precision


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """One candidate: the degrees and per-job choices of a hybrid-parallel plan."""

    dp: int                                # data-parallel replicas
    tp: int                                # tensor parallel (Shoeybi et al. 2019)
    pp: int                                # pipeline stages (Narayanan et al. 2021)
    cp: int = 1                            # context parallel: the sequence split across ranks (ring attention)
    ep: int = 1                            # expert parallel: each MoE layer's routed experts split over ep ranks,
                                           # folded onto the data x context x tensor-parallel ranks (or the data-
                                           # parallel ones: the runtime's Combinations.expert_parallel); with ep > 1
                                           # an expert is whole on its rank (expert tensor parallel 1), with ep 1
                                           # it is split over the tp ranks as the dense MLP is
    zero: int = 0                          # ZeRO stage (Rajbhandari et al. 2020): 1 optimizer, 2 + grads, 3 + params
    micro_batch: int = 1                   # sequences per micro-batch per replica
    num_microbatches: int = 1              # micro-batches per step per replica (gradient accumulation)
    vpp: int = 1                           # virtual stages per pipeline rank (a schedule with virtual stages)
    schedule: Schedule = schedules.DEFAULT  # pipeline schedule (planner/schedules.py)
    recompute: Recompute = "none"          # activation recompute policy (planner/recompute.py): with
                                           # recompute_layers, "every-K" where they are that pattern, else the
                                           # policy that names their mix (summary_policy)
    sequence_parallel: bool = False        # shard norms/dropout along the sequence inside the TP group
    optimizer_offload: bool = False        # optimizer states (and fp32 master weights) in host memory
                                           # (ZeRO-Offload, Ren et al. 2021); activation offload is a
                                           # recompute policy ("activation-offload")
    param_offload: bool = False            # ZeRO-3's parameter shards in host memory, copied to the device for
                                           # each gather (DeepSpeed's zero_optimization.offload_param: ZeRO-Infinity,
                                           # Rajbhandari et al. 2021); where the runtime's optimizer offload keeps
                                           # them there already (FSDP2's CPUOffloadPolicy) it is not a knob of its own
    nvme_offload: bool = False             # what optimizer and parameter offload move off the GPU kept on the node's
                                           # NVMe rather than in host memory (ZeRO-Infinity, Rajbhandari et al. 2021;
                                           # DeepSpeed's offload_optimizer/offload_param device "nvme"), read and
                                           # written through host buffers
    # Per-layer choices made by the ILP planner; None means uniform.
    recompute_layers: tuple[str, ...] | None = None    # one Recompute per layer of the layer graph
    stage_layers: tuple[int, ...] | None = None        # layers per (virtual) stage, in order

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def but(self, **changes) -> "ParallelConfig":
        """``dataclasses.replace(self, **changes)`` at a fraction of its cost (the search derives tens of
        thousands of configs; ``replace`` runs the generated ``__init__`` with its keyword handling each
        time). The fields are copied as they are: nothing here is derived or validated on init."""
        unknown = changes.keys() - _CONFIG_FIELDS
        if unknown:
            raise TypeError(f"ParallelConfig has no field(s) {', '.join(sorted(unknown))}")
        out = object.__new__(ParallelConfig)
        out.__dict__.update(self.__dict__)
        out.__dict__.update(changes)
        return out

    def to_json(self) -> dict:
        out = asdict(self)
        for key in ("recompute_layers", "stage_layers"):
            if out[key] is None:
                del out[key]
            else:
                out[key] = list(out[key])
        for key in ("param_offload", "nvme_offload"):   # said only where on: earlier plan.json files read the same
            if not out[key]:
                del out[key]
        if out["ep"] == 1:                  # likewise: said only where experts are split
            del out["ep"]
        return out

    @classmethod
    def from_json(cls, data: dict, source: str = "plan.json") -> "ParallelConfig":
        """Read a config written by ``to_json``; every field checked, errors name it."""
        if not isinstance(data, dict):
            raise UserError(f"must be an object, got {type(data).__name__}", source=source, field="config")
        data = _renamed(data, source)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names, key=str)
        if unknown:
            raise UserError(f"unknown field(s) {', '.join(map(str, unknown))}; allowed: {one_of(sorted(names))}",
                            source=source, field="config")
        kwargs = {}
        for name, value in data.items():
            where = f"config.{name}"
            if name == "recompute":             # a policy's earlier name (planner/recompute.py aliases)
                value = canonical(value)
            elif name == "recompute_layers" and isinstance(value, list):
                value = [canonical(v) for v in value]
            if name in ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "num_microbatches", "vpp"):
                if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "zero" else 1):
                    raise UserError(f"must be a {'non-negative' if name == 'zero' else 'positive'} integer, "
                                    f"got {value!r}", source=source, field=where)
            elif name == "recompute" and isinstance(value, str) and (every_k(value) or 0) >= 1:
                if not isinstance(data.get("recompute_layers"), list):
                    raise UserError(f"{value!r} needs the per-layer policies (recompute_layers) it expands into",
                                    source=source, field=where)
            elif name in ("schedule", "recompute"):
                allowed = {"schedule": SCHEDULES, "recompute": RECOMPUTES + ("every-K",)}[name]
                if value not in allowed:
                    raise UserError(f"{value!r} is not allowed; allowed: {one_of(allowed)}", source=source,
                                    field=where)
            elif name in ("sequence_parallel", "optimizer_offload", "param_offload", "nvme_offload"):
                if not isinstance(value, bool):
                    raise UserError(f"must be true or false, got {value!r}", source=source, field=where)
            elif name == "stage_layers" and value is not None:
                if not isinstance(value, list) or not value or not all(
                        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
                    raise UserError(f"must be a list of positive integers, got {value!r}", source=source, field=where)
                value = tuple(value)
            elif name == "recompute_layers" and value is not None:
                if not isinstance(value, list) or not all(v in RECOMPUTES for v in value):
                    raise UserError(f"must be a list of {one_of(RECOMPUTES)}, got {value!r}", source=source,
                                    field=where)
                value = tuple(value)
            kwargs[name] = value
        missing = sorted({"dp", "tp", "pp"} - set(kwargs))
        if missing:
            raise UserError(f"missing {', '.join(missing)}", source=source, field="config")
        return cls(**kwargs)


_CONFIG_FIELDS = frozenset(f.name for f in fields(ParallelConfig))


def _renamed(data: dict, source: str) -> dict:
    """A config as plan.json files written before the rename hold it: ``"offload": "none" | "optimizer"``
    is ``"optimizer_offload": false | true`` now (one meaning per name: activation offload is a recompute
    policy)."""
    if "offload" not in data:
        return data
    out = dict(data)
    value = out.pop("offload")
    if value not in ("none", "optimizer"):
        raise UserError(f"{value!r} is not allowed; allowed: 'none' or 'optimizer' (the earlier name of "
                        "optimizer_offload: false or true)", source=source, field="config.offload")
    if "optimizer_offload" in out and out["optimizer_offload"] != (value == "optimizer"):
        raise UserError(f"says {value!r} and optimizer_offload says {out['optimizer_offload']!r}; allowed: one of "
                        "them", source=source, field="config.offload")
    out["optimizer_offload"] = value == "optimizer"
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_config(config: ParallelConfig, *, num_gpus: int, global_batch: int, seq_len: int, num_heads: int,
                 num_kv_heads: int, num_blocks: int, framework: str, dtypes: tuple[str, ...] = (),
                 precision: str = "bf16", device_kind: str = "cuda", max_stages: int | None = None,
                 num_experts: int = 0, latent_attention: bool = False, fp8: str = "", compile: bool = False,
                 finetune: str = "full", ep_comm_overlap: bool = False) -> None:
    """Raise UserError (naming the flag) when the knobs cannot work together, or when the
    runtime ``framework`` does not run them on ``device_kind`` (planner/runtimes.py). ``max_stages``:
    the most (virtual) pipeline stages the model splits into (default one block each)."""
    c = config
    for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "num_microbatches", "vpp"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"must be a positive integer, got {value!r}", field=f"--{name.replace('_', '-')}")
    if c.world_size != num_gpus:
        raise UserError(f"dp x tp x pp x cp = {c.dp} x {c.tp} x {c.pp} x {c.cp} = {c.world_size} "
                        f"but the cluster has {num_gpus} GPUs", field="--dp/--tp/--pp/--cp")
    if num_heads % c.tp:
        raise UserError(f"tp {c.tp} does not divide the {num_heads} attention heads; "
                        f"allowed: {one_of([d for d in _divisors(num_heads) if num_gpus % d == 0])}", field="--tp")
    if num_kv_heads % c.tp and c.tp % num_kv_heads:
        raise UserError(f"tp {c.tp} neither divides nor is a multiple of the {num_kv_heads} key/value heads",
                        field="--tp")
    max_stages = max_stages or num_blocks
    if c.pp > max_stages:
        raise UserError(f"pp {c.pp} is more stages than the model's {num_blocks} layers can make "
                        f"(at most {max_stages})", field="--pp")
    if c.cp > 1 and seq_len % (2 * c.cp):
        raise UserError(f"cp {c.cp} needs the sequence length ({seq_len}) to be a multiple of 2 x cp "
                        "(load-balanced causal chunks)", field="--cp")
    if global_batch % (c.dp * c.micro_batch):
        raise UserError(f"global batch {global_batch} is not a multiple of dp x micro-batch = "
                        f"{c.dp} x {c.micro_batch}", field="--micro-batch")
    if c.num_microbatches * c.micro_batch * c.dp != global_batch:
        raise UserError(f"num_microbatches {c.num_microbatches} x micro-batch {c.micro_batch} x dp {c.dp} "
                        f"!= global batch {global_batch}", field="num_microbatches")
    if c.zero not in ZERO_STAGES:
        raise UserError(f"{c.zero!r} is not a ZeRO stage; allowed: {one_of(ZERO_STAGES)}", field="--zero")
    record = schedules.schedule(c.schedule)
    refused = record.refusal(pp=c.pp, vpp=c.vpp, m=c.num_microbatches)
    if refused:
        raise UserError(refused[1], field=refused[0])
    if c.pp * c.vpp > max_stages:
        raise UserError(f"pp x vpp = {c.pp * c.vpp} virtual stages exceed the {max_stages} the model's "
                        f"{num_blocks} layers can make", field="--vpp")
    if c.recompute not in RECOMPUTES and not (every_k(c.recompute) and c.recompute_layers):
        raise UserError(f"{c.recompute!r} is not allowed; allowed: {one_of(RECOMPUTES + ('every-K',))}",
                        field="--recompute")
    if c.sequence_parallel and c.tp == 1:
        raise UserError("sequence parallelism shards along the TP group: it needs tp >= 2",
                        field="--sequence-parallel")
    if not isinstance(c.optimizer_offload, bool):
        raise UserError(f"must be on or off, got {c.optimizer_offload!r}", field="--optimizer-offload")
    if c.optimizer_offload and c.zero == 0:
        raise UserError("optimizer offload (ZeRO-Offload) needs ZeRO stage 1, 2 or 3", field="--optimizer-offload")
    if dtypes and precision not in dtypes:
        raise UserError(f"the cluster's devices have no {precision} peak; allowed: {one_of(dtypes)}",
                        field="--precision")
    for knob, why in config_refusals(c, framework, device_kind, num_kv_heads, num_experts, latent_attention, fp8,
                                     compile, finetune, ep_comm_overlap, num_blocks):
        raise UserError(why, field=knob_flag(knob))


def knob_flag(knob: str) -> str:
    """The `meshplan plan` flag of a ParallelConfig field."""
    return "--" + knob.replace("_", "-")
