"""What each runtime runs: one table (../shared/DESIGN.md, "Runtimes: one table of what can run").

For every runtime meshplan models (``torch``: meshplan's own executor; ``megatron``;
``deepspeed``): the knob combinations it runs on each kind of device, its memory layout,
which collectives it overlaps and when it reduces gradients across micro-batches. Plain
data, read by the search space (planner/search/space.py builds its candidates from
``Combinations``), by the cost model (``StateLayout`` and ``Timing``) and by the
executor's pre-launch check (executor/support.py refuses exactly what ``refusals`` finds
for runtime ``torch``). A new capability of the executor is added here and nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from .errors import one_of
from .recompute import POLICIES, runs_in
from .schedules import SCHEDULES

DeviceKind = Literal["cuda", "cpu"]
DEVICE_KINDS = ("cuda", "cpu")
# planner/recompute.py; meshplan's executor runs them all (executor/activations.py) but Megatron-Core's
# output-discarding checkpoint ("discard"), which is Megatron-LM's alone
ALL_RECOMPUTES = tuple(p for p in POLICIES if p != "discard")
# Megatron-LM and DeepSpeed run the policies they have a name for (planner/recompute.py): Megatron-LM's
# --recompute-granularity selective|full (no operator-level policy; its activation offload, --cpu-offloading,
# is not modelled); DeepSpeed's checkpointing by layer (and Megatron-DeepSpeed's selective)
NEVER = 4       # a ZeRO stage past the last: "never sharded"


@dataclass(frozen=True, kw_only=True)
class Combinations:
    """The knob values a runtime runs on one kind of device, and which of them go together."""

    zero_stages: tuple[int, ...]            # ZeRO stages (Rajbhandari et al. 2020)
    zero_stages_with_pp: tuple[int, ...]    # of those, the ones that run under pipeline parallelism
    zero_stages_with_tp: tuple[int, ...]    # of those, the ones that run with tensor parallelism
    schedules: tuple[str, ...]              # pipeline schedules (planner/schedules.py)
    recomputes: tuple[str, ...]             # activation recomputation policies
    sequence_parallel: bool                 # Korthikanti et al. 2022, Sec 4.2.2
    context_parallel: bool                  # cp > 1: the sequence split over ranks
    offload_zero_stages: tuple[int, ...]    # ZeRO stages optimizer offload runs with (empty: no offload)
    param_offload_zero_stages: tuple[int, ...] = ()     # ZeRO stages parameter offload (``param_offload``) runs with
    nvme_offload_zero_stages: tuple[int, ...] = ()      # ZeRO stages whose offload can go to NVMe (``nvme_offload``)
    replicates_kv_heads: bool               # tp may exceed the key/value heads (a multiple of them)
    stages_without_blocks: bool             # the embedding alone, or the final norm and head alone, can be a
                                            # (virtual) pipeline stage (Dubey et al. 2024, Llama 3, Sec 3.3.2)
    unequal_stages: bool = True             # (virtual) stages of unequal sizes can be given (else balanced ones)
    recompute_per_layer: bool = True        # a recompute policy per layer can be given (else one policy, or one
                                            # every-K pattern, for every block)
    zero_stages_with_cp: tuple[int, ...] | None = None
    # ^ of the ZeRO stages, the ones that run with context parallelism (None: all of them)
    zero_stages_with_split_backward: tuple[int, ...] | None = None
    sp_with_split_backward: bool = True     # sequence parallelism with a split-backward schedule over pp > 1
    # ^ of the ZeRO stages, the ones that run with a split-backward schedule (planner/schedules.py backward "split")
    #   over pp > 1 (None: all of them)
    expert_parallel: Literal["folded", "data", "none"] = "none"
    # ^ how routed experts split over ranks (ParallelConfig.ep): "folded" over the same ranks as the dense layers'
    #   data x context x tensor parallelism, each expert whole on its rank (Megatron-Core's MoE parallel folding with
    #   --expert-tensor-parallel-size 1, Liu et al. 2025, arXiv:2504.14960, Sec 3; torchtitan's expert parallelism,
    #   which borrows its ranks from dp_shard, cp and tp); "data" over the data-parallel ranks only (DeepSpeed-MoE's
    #   ep_size, which must divide the data-parallel size: deepspeed/utils/groups.py); "none": ep 1 only
    zero_stages_with_ep: tuple[int, ...] | None = None  # the ZeRO stages that run with ep > 1 (None: all of them)
    ep_from_replicas: bool = True           # "folded": ep may take ranks of replicated (ZeRO-0) data parallelism;
                                            # False: it folds onto the sharded ranks only (torchtitan's sparse
                                            # region is dp_shard x cp x tp: parallel_dims.py, ``_validate``)
    expert_dispatchers: tuple[str, ...] = ("alltoall",)     # how tokens reach their experts (Workload.expert_dispatcher)
    experts_with_tp: bool = True            # a mixture of experts runs with tp > 1 (its dense layers tensor parallel)
    experts_split_by_tp: bool = True        # ... and at ep 1 its routed experts split over the tp ranks (expert tensor
                                            # parallelism); False: with tp > 1 the experts go over ep > 1 ranks whole
    sp_with_latent_attention: bool = True   # sequence parallelism runs with multi-head latent attention
    recomputes_with_ep: tuple[str, ...] | None = None   # the recompute policies that run with ep > 1 (None: all)
    grouped_experts: bool = False           # a rank's routed experts run as one grouped GEMM (one launch, their tiles
                                            # in the same waves) rather than one GEMM per expert
    expert_gemm_streams: int = 1            # where not grouped: how many of those per-expert GEMMs (and their FP8
                                            # casts) run at once, each on a stream of its own (1: one after another)
    ep_comm_overlap: bool = False           # expert all-to-alls overlapped with another micro-batch's compute
                                            # (Workload.ep_comm_overlap: Megatron-Core's
                                            # --overlap-moe-expert-parallel-comm)
    compiles_blocks: bool = False           # --compile: each block torch.compile'd (torchtitan's per-block compile,
                                            # torchtitan/models/llama3/infra/parallelize.py apply_compile)
    compile_with_tp_needs_sp: bool = False  # compiled blocks with tp > 1 run only with sequence parallelism
    compile_with_tp_recomputes: tuple[str, ...] | None = None  # ... and only under these recompute policies (None: any)
    fp8_recipes: tuple[str, ...] = ()       # FP8 training recipes it runs (planner/precision.py RECIPES; --precision)
    fp8_with_tp: bool = True                # an FP8 recipe runs with tp > 1
    ep_needs_sp: bool = False               # ep > 1 with tp > 1 needs sequence parallelism (Megatron-LM's
                                            # arguments.py: "When using MoE and tensor parallelism, sequence
                                            # parallelism must be used")
    virtual_stages_min_pp: int = 2          # the least pp a schedule with virtual stages runs at (Megatron-LM
                                            # refused pp 2 from March 2021 to May 2024: ``megatron-2021``)
    finetune_modes: tuple[str, ...] = ("full",)     # training modes it runs (planner/finetune.py; --finetune)
    adapters_with_pp: bool = True           # LoRA/QLoRA under pipeline parallelism (pp > 1)
    adapters_with_fp8: bool = True          # LoRA/QLoRA with an FP8 recipe
    nf4_base_zero_stages: tuple[int, ...] = (0, 1, 2, 3)    # ZeRO stages QLoRA's NF4 base runs with
    nf4_base_zero_stages_with_pp: tuple[int, ...] = (0, 1, 2, 3)    # of those, the ones under pp > 1 with more
                                                                    # than one data-parallel replica
    nf4_base_with_tp: bool = True           # QLoRA's NF4 base with tp > 1
    recomputes_first_blocks: bool = False
    # ^ beside its recompute policies: full recompute on the first N blocks of every (virtual) stage, none on the
    #   others (Megatron-LM's --recompute-granularity full --recompute-method block --recompute-num-layers N:
    #   transformer_block.py _checkpointed_forward checkpoints layers 0 to N - 1 of each model chunk), which a search
    #   without a fixed --recompute tries on balanced stages
    offloads_first_blocks: bool = False
    # ^ beside its recompute policies: activation offload on the first N blocks (N below the model's), none on the
    #   others, with no pipeline (Megatron-Core's --cpu-offloading-num-layers N, on TransformerEngine's cpu_offload:
    #   _MEGATRON_CUDA_RUNS), which a search without a fixed --recompute tries


@dataclass(frozen=True, kw_only=True)
class StateLayout:
    """Bytes per parameter of one rank's model states at one precision, and the ZeRO stage from
    which each category is sharded over the data-parallel group (``NEVER``: not sharded)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    params_sharded_from: int
    grads_sharded_from: int
    optimizer_sharded_from: int
    held_copy_bytes: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    # ^ by ZeRO stage: an unsharded working copy of the parameters held from forward until backward
    replicate_copy_bytes: float = 0.0       # ZeRO-0 with tp or pp > 1: a gathered copy held as a buffer
    grad_reduce_bytes: float = 4.0          # bytes per parameter of the gradient reduction's dtype
    offload_params_grads_from: int = NEVER
    # ^ the ZeRO stage from which optimizer offload also keeps the sharded parameters and gradients in
    #   host memory (the device then holds only the working copy of ``held_copy_bytes``); below it,
    #   and for every stage at NEVER, offload moves the optimizer states alone


@dataclass(frozen=True, kw_only=True)
class PerTensorFetch:
    """ZeRO-3 as DeepSpeed v0.3.13-v0.4.2 runs it with its defaults (planner/cost/fetch.py): each parameter
    tensor gathered on its own into a list of per-rank views, the gradients all-reduced in buckets."""

    gather_loop_s: float          # host time per rank of the group, per gathered tensor: the Python loop of
                                  # ``_allgather_param`` (a narrow view, get_rank(group) and an append per rank)
    reduce_bucket: float          # reduce_bucket_size: gradients are all-reduced in buckets of up to this many
                                  # elements (planner/cost/fetch.py ``gradient_buckets``)
    max_reuse_distance: float     # stage3_max_reuse_distance: parameters used again within this many
                                  # elements stay gathered
    source: str


@dataclass(frozen=True, kw_only=True)
class GradBuckets:
    """How a runtime groups a rank's gradients into collectives (and, where parameters are held whole and its
    optimizer is sharded, the updated parameters it gathers back: the same buckets) at some ZeRO stages: a bucket
    of ``elements`` parameters, at least ``per_dp_rank`` per data-parallel rank, or ``nbytes`` of gradients; with
    ``overlapped_only``, only where the reduction overlaps the backward, else a model chunk's whole gradient buffer
    in one call.
    ``closes``: "reaching" (a parameter joins the bucket, which closes once it holds at least the size:
    Megatron-LM, torch DDP: reducer.cpp ``compute_bucket_assignment_by_size``, which
    ``torch.distributed._compute_bucket_assignment_by_size`` runs) or "before-exceeding" (a parameter that would
    take the bucket past the size closes it first and opens the next: DeepSpeed, meshplan's ZeRO-1). Elsewhere the
    runtime issues a layer's collectives together (an FSDP2 unit, a ZeRO-3 sub-module's gathers)."""

    elements: float = 0.0
    per_dp_rank: float = 0.0
    nbytes: float = 0.0
    closes: Literal["reaching", "before-exceeding"]
    overlapped_only: bool = False   # buckets only where the reduction overlaps backward (else one for all)
    zero_stages: tuple[int, ...]
    source: str

    def size(self, dp: int, grad_bytes: float) -> float:
        """Parameters per bucket on ``dp`` data-parallel ranks, gradients of ``grad_bytes`` each."""
        return self.nbytes / grad_bytes if self.nbytes else max(self.elements, self.per_dp_rank * dp)


@dataclass(frozen=True, kw_only=True)
class Timing:
    """When a runtime runs its collectives, and which it overlaps with compute."""

    params_gathered_every_microbatch: tuple[int, ...]   # ZeRO stages gathering parameters before every
                                                        # micro-batch's forward (else once per step)
    grads_reduced_every_microbatch: tuple[int, ...]     # ZeRO stages reducing after every micro-batch's
                                                        # backward (else once, after the last)
    overlaps_param_gather: bool     # ZeRO-1/2's all-gather after the optimizer runs beside the next forward
    pp_sends_tp_shards: bool        # each TP rank sends 1/tp of a stage boundary even without SP
    sp_keeps_gathered_input: bool   # under SP a column-parallel linear saves its all-gathered input
    fuses_swiglu: bool = False      # SwiGLU runs as one fused kernel that keeps its input alone (``Op.fused_saved``:
                                    # Megatron-Core's bias-SwiGLU fusion, on by default)
    offload_step_copy_bytes: tuple[float, float, float, float] | None = None
    # ^ by ZeRO stage: bytes per offloaded (local) parameter copied between the device and the host once
    #   a step; None: ZeRO-Offload's fp32 gradients down and parameters at the training dtype up (Ren et
    #   al. 2021, Sec 4.1)
    offload_microbatch_copy_bytes: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    # ^ by ZeRO stage: bytes per offloaded parameter copied every micro-batch
    param_offload_microbatch_copy_bytes: float = 0.0
    # ^ with parameter offload (``ParallelConfig.param_offload``): bytes per parameter of the rank's shard copied
    #   from the host to the device every micro-batch, before its gathers
    pp_defers_sharded_dp_sync: bool = False
    # ^ under a pipeline, ZeRO-2/3 gradients accumulate unsharded over the micro-batches and the
    #   parameters stay gathered after each backward; one reduce-scatter runs after the last backward,
    #   not overlapped with it (torch.distributed.pipelining, stage.py: backward_maybe_with_nosync sets
    #   set_requires_gradient_sync(False) and set_reshard_after_backward(False) on FSDP modules for
    #   every backward, perform_reduce_grad runs FSDP's post_backward once the schedule's last backward
    #   is done; torch 2.13)
    grads_reduced_in_optimizer: tuple[int, ...] = ()
    # ^ ZeRO stages whose once-per-step gradient reduction runs inside the optimizer step, after
    #   backward, not beside it (meshplan's ZeRO-1: executor/zero1.py ShardedAdamW.step reduce-scatters,
    #   steps, then all-gathers)
    fsdp_blocks_on_gloo: bool = False
    # ^ FSDP2 issues its all-gathers and reduce-scatters with async_op=False (torch 2.13
    #   FSDP2's _fsdp_collectives.py under torch/distributed/fsdp: reduce_scatter_comm(...) in foreach_reduce, and
    #   FSDPParamGroup.unshard_async_op = False), which on CUDA only enqueues them on FSDP's own
    #   streams but on a gloo process group returns when they are done: on a CPU they block the
    #   training loop between layers (torch.profiler of a ZeRO-2 step on 2 CPU ranks:
    #   FSDP::post_backward_reduce and FSDP::all_gather 0.3-0.8 s of self time in a 3.4 s step)
    cp_exchange: Literal["ring", "all-gather"] = "ring"
    # ^ context parallelism's key/value exchange: a ring of blocks overlapped with attention (Liu et
    #   al. 2023, Ring Attention), or one all-gather before attention and a reduce-scatter of their
    #   gradients after it, with the whole sequence's keys and values kept for backward (Dubey et al.
    #   2024, Llama 3, Sec 3.3.2)
    pp_sends_block: bool = False
    # ^ every stage-boundary exchange is waited on before the next pass, whatever the schedule: no schedule
    #   overlaps its sends (Megatron-LM of 2021, p2p_communication.py ``_communicate``: batch_isend_irecv,
    #   req.wait() on each request, then torch.cuda.synchronize())
    grad_buckets: GradBuckets | None = None
    # ^ the data-parallel collectives in buckets that span layers or split them (planner/cost/step.py
    #   ``in_buckets``); None: one per layer
    zero3_per_tensor: PerTensorFetch | None = None
    # ^ ZeRO-3 gathers and reduces one parameter tensor at a time, serialised with compute
    #   (planner/cost/fetch.py); None: a layer's parameters at once, prefetched beside compute
    checkpoint_early_stop: bool = False
    # ^ full recompute stops once the last tensor backward needs is rebuilt: torch.utils.checkpoint's
    #   non-reentrant checkpoint (early_stop=True by default, torch 2.13 torch/utils/checkpoint.py), which
    #   meshplan's executor (executor/activations.py) and torchtitan wrap blocks in, skips the ops after it (a
    #   block's last linear, whose input its predecessor made, and the residual add); Megatron-LM's and
    #   DeepSpeed's CheckpointFunction re-run the whole forward


@dataclass(frozen=True, kw_only=True)
class Runtime:
    name: str
    description: str
    runs: dict[str, Combinations]           # device kind -> what runs there
    mixed: StateLayout                      # bf16/fp16 with fp32 master weights
    fp32: StateLayout
    timing: Timing
    mixed_fp16: StateLayout | None = None   # fp16 where it differs from bf16's ``mixed``
    loss: Literal["eager", "vocab-parallel"] = "eager"
    # ^ the cross-entropy over the logits (planner/layers.py prices each): torch's eager one on fp32 logits
    #   (log_softmax + nll_loss: torch's F.cross_entropy; meshplan's executor, torchtitan, and the Hugging Face
    #   models DeepSpeed trains, whose ForCausalLMLoss upcasts the logits), or Megatron-LM's fused
    #   vocab-parallel one (megatron/core/tensor_parallel/cross_entropy.py), whose gradient is written in place
    priced_as: str = ""
    # ^ the runtime whose mechanisms (eager kernels, host time, FSDP2's collectives) price this one's steps,
    #   where it runs the same code as another and only expresses less of it; empty: its own
    attention_kernel: Literal["flash", "fused"] = "flash"
    # ^ the kernel ``--attention flash`` runs: a FlashAttention-2-class kernel (the profile's attention_efficiency), or
    #   cuDNN's fused flash kernel where the profile characterises it (planner/cost/compute.py ``fused_attention_s``;
    #   elsewhere attention_efficiency): TransformerEngine's DotProductAttention prefers its FusedAttention (cuDNN) to
    #   FlashAttention on Hopper and later (v1.7 attention.py "Select FusedAttention on sm90"; v2.9
    #   attention/dot_product_attention/utils.py get_attention_backend, "FusedAttention preference on Hopper+"), and
    #   torch's SDPA from 2.11 (TORCH below)

    lora_style: str = "peft"
    # ^ how its LoRA lays adapters over the model and its defaults (planner/finetune.py STYLES): PEFT's, one per
    #   target projection, or Megatron-Bridge's, one per fused module (MEGATRON below)

    def layout(self, precision: str, grads_16bit: bool = False) -> StateLayout:
        """The state layout at ``precision``; ``grads_16bit``: gradients accumulated and reduced in the 16-bit
        dtype (Megatron-LM's --grad-reduce-in-bf16, ``Workload.grad_reduce_in_bf16``), 2 bytes each."""
        out = self.fp32 if precision == "fp32" else self.mixed
        if precision == "fp16" and self.mixed_fp16 is not None:
            out = self.mixed_fp16
        return replace(out, grads_bytes=2.0, grad_reduce_bytes=2.0) if grads_16bit else out

    def on(self, device_kind: str) -> Combinations:
        return self.runs[device_kind]


# meshplan's executor (executor/). What it cannot run yet is left out, so no plan asks for it.
# Optimizer offload: ZeRO-1's sharded AdamW with its states in host memory (executor/zero1.py),
# FSDP2's CPUOffloadPolicy at ZeRO-2/3 (executor/parallelize.py offload_policy)
# Mixtures of experts (executor/moe.py): experts split over ep of the dp x cp x tp ranks (ep divides dp x cp x tp,
# folded as torchtitan folds them), tensor parallelism in a MoE model only with ep > 1 and sequence parallelism
# (executor/moe.py splits no expert over tp ranks); under ep > 1 no operator-level recompute ("op": the experts'
# data-parallel unit inside the checkpointed block runs other hook ops in the recompute, which torch's selective
# checkpointing refuses)
# Training modes (planner/finetune.py). LoRA: PEFT's adapters on a torch model (peft/tuners/lora), which meshplan's
# executor is to apply (the planner prices what PEFT runs: the base frozen, adapters sharded as their linear);
# Hugging Face Trainer + PEFT under DeepSpeed; Megatron-Bridge's PEFT LoRA (megatron/bridge/peft/lora.py) for
# Megatron-Core models. QLoRA: bitsandbytes' 4-bit NormalFloat (NF4, double quantization); PEFT + bitsandbytes
# under DeepSpeed (transformers' BitsAndBytesConfig), on CUDA, where its recipes run; meshplan's executor quantizes
# its base linears with bitsandbytes itself (executor/qlora.py), on CUDA and, since bitsandbytes 0.46's PyTorch
# implementations of its 4-bit ops, on the CPU too. Not Megatron (Megatron-Bridge quantizes no base weights to
# NF4), not torchtitan (no LoRA in torchtitan)
_LORA = ("full", "lora")
_LORA_AND_QLORA = ("full", "lora", "qlora")

_TORCH_RUNS = Combinations(
    finetune_modes=_LORA_AND_QLORA,
    # the NF4 base (executor/qlora.py) is quantized whole tensor by whole tensor once the weights are real, after
    # the sharding wrappers: not under tensor parallelism (each rank would quantize its shard in blocks of its
    # own), nor under FSDP2's ZeRO-2/3 or its replicate (ZeRO-0 with a pipeline over replicas), which hold the
    # weights as DTensors
    nf4_base_zero_stages=(0, 1), nf4_base_zero_stages_with_pp=(1,), nf4_base_with_tp=False,
    # the executor's adapters (executor/parallelize.py apply_finetune) run under every schedule (a stage holding
    # only the frozen embedding: executor/pipeline.py _output_needs_grad; tests/test_executor_lora.py), not on
    # float8 linears
    adapters_with_pp=True, adapters_with_fp8=False,
    compiles_blocks=True,       # executor/parallelize.py apply_compile (torch.compile on the CPU too: inductor)
    # with tensor parallelism only under sequence parallelism and without checkpointing inside the compiled block,
    # as torch 2.13 runs them (the tiny Llama, GPT and Qwen3 of tests/executor_support.py with tp 2 on gloo,
    # 2026-11-28): without SP the blocks' backward fails (the residual stream enters them as the row-parallel
    # all-reduce's AsyncCollectiveTensor, and a DTensor redistribute's backward then receives a plain tensor:
    # AttributeError '_local_tensor'); with SP they train as eager does under ZeRO-1, ZeRO-3, pp 2 and the op
    # policy, while full and selective recompute fail in the compiled forward (AOTAutograd saves a DeviceMesh
    # among the checkpoint's tensors: "expected all tensors_saved_with_vc_check to be Tensors");
    # torchtitan, whose TP plan keeps DTensors between its linears and always shards the sequence, is not limited
    compile_with_tp_needs_sp=True, compile_with_tp_recomputes=("none", "op"),
    zero_stages=(0, 1, 2, 3), zero_stages_with_pp=(0, 1, 2, 3), zero_stages_with_tp=(0, 1, 2, 3),
    # the split-backward schedules (planner/schedules.py backward "split") without ZeRO-3: torch 2.13's input-gradient
    # pass (torch/distributed/pipelining/_backward.py stage_backward_input) collects the stage's parameters when it
    # starts, and FSDP2 resharding after forward has put the sharded ones back by then, so the weight-gradient pass
    # finds none of the graph's and the stage's gradients stay None (seen on the last stage under gloo; measured
    # with tests/test_executor_zb.py's harness)
    schedules=tuple(name for name, s in SCHEDULES.items() if s.torch_name),
    zero_stages_with_split_backward=(0, 1, 2), recomputes=ALL_RECOMPUTES,
    # nor with sequence parallelism: the weight-gradient pass (stage_backward_weight: autograd.grad from the input
    # gradient's intermediates) leaves each TP rank's share of a replicated norm weight's gradient unsummed (seen on
    # gloo, pp 2 x tp 2: every norm weight's gradient off by the other rank's share; without SP they match)
    sp_with_split_backward=False,
    sequence_parallel=True,
    context_parallel=True, offload_zero_stages=(1, 2, 3), replicates_kv_heads=False, stages_without_blocks=True,
    # a mixture of experts with tp > 1 as torchtitan runs it (torchtitan/distributed/parallel_dims.py: the sparse
    # region dp_shard x cp x tp = efsdp x ep): each tp rank routes its own share of the sequence (so sequence
    # parallelism), the experts whole over ep ranks that may include the tp ranks; meshplan's executor does not
    # split an expert over the tp ranks (torchtitan's expert tensor parallelism), so ep > 1 there
    expert_parallel="folded", experts_split_by_tp=False, ep_needs_sp=True,
    recomputes_with_ep=tuple(p for p in ALL_RECOMPUTES if p != "op"),
    # latent attention splits its heads over the tp ranks with its down-projections on the whole sequence
    # (executor/models.py LatentAttention); under SP the plan runs those on sequence shards, which it does not arrange
    sp_with_latent_attention=False)
# the executor's routed experts: torch._grouped_mm on a GPU, a loop over the local experts on a CPU (executor/moe.py)
# FP8: torchao's float8 linears of the tensorwise, rowwise and rowwise_with_gw_hp recipes (executor/parallelize.py
# apply_fp8, torchao.float8.convert_to_float8_training), converted before any other wrapping; not with tensor
# parallelism (torchao's Float8ColwiseParallel / Float8RowwiseParallel styles are not applied), not MXFP8 (torchao's
# MX linears are another API); on GPUs with an FP8 rate, with --compile (planner/api.py check_fp8)
_TORCH_CUDA_RUNS = replace(_TORCH_RUNS, grouped_experts=True,
                           fp8_recipes=("fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp"), fp8_with_tp=False)

TORCH = Runtime(
    name="torch",
    description="meshplan's executor: DDP or FSDP2's replicate for ZeRO-0, a sharded optimizer for ZeRO-1, "
                "FSDP2 for ZeRO-2/3, DTensor TP/SP, torch.distributed.pipelining",
    runs={"cuda": _TORCH_CUDA_RUNS, "cpu": _TORCH_RUNS},
    # fp32 parameters; ZeRO-0/1 autocast keeps bf16 weight copies from forward until backward (+2);
    # FSDP2 with MixedPrecisionPolicy(bf16 params, fp32 reduce) shards the fp32 parameters at
    # ZeRO-2/3, and ZeRO-2 (reshard_after_forward=False) keeps the gathered bf16 ones (+2).
    # Offload: FSDP2's CPUOffloadPolicy "offloads parameters, gradients, and optimizer states to
    # CPU" (torch 2.13, torch.distributed.fsdp.CPUOffloadPolicy: the sharded parameters live in host
    # memory and are copied to the device before each all-gather, the reduced gradient shards are
    # copied back, AdamW steps there); ZeRO-1's sharded AdamW moves its states alone
    mixed=StateLayout(params_bytes=4.0, grads_bytes=4.0, optimizer_bytes=8.0, params_sharded_from=2,
                      grads_sharded_from=2, optimizer_sharded_from=1, held_copy_bytes=(2.0, 2.0, 2.0, 0.0),
                      offload_params_grads_from=2),
    # fp32: ZeRO-2 keeps the gathered fp32 parameters (+4); replicate() (ZeRO-0 under TP or a
    # pipeline) gathers a working copy for forward and keeps it until backward (+4, measured on
    # cpu-gloo, tests/test_executor_plans.py)
    fp32=StateLayout(params_bytes=4.0, grads_bytes=4.0, optimizer_bytes=8.0, params_sharded_from=2,
                     grads_sharded_from=2, optimizer_sharded_from=1, held_copy_bytes=(0.0, 0.0, 4.0, 0.0),
                     replicate_copy_bytes=4.0, offload_params_grads_from=2),
    # FSDP2 gathers every forward at ZeRO-2 too; the ZeRO-1 optimizer's step ends by sending the
    # updated shards to every replica, before the next forward starts (executor/train.py).
    # Offload copies: ZeRO-1's sharded AdamW copies its gradient rows and parameter rows to the host
    # and the parameter rows back, fp32, once a step (4 + 4 + 4, executor/zero1.py); FSDP2's
    # CPUOffloadPolicy copies the fp32 parameter shard to the device before every all-gather (each
    # forward; ZeRO-3 again for backward) and the fp32 reduced gradient shard back every micro-batch
    # (ZeRO-2: 4 + 4, ZeRO-3: 4 + 4 + 4; torch 2.13, torch.distributed.fsdp: FSDPParam.all_gather_inputs
    # and foreach_reduce)
    timing=Timing(params_gathered_every_microbatch=(2, 3), grads_reduced_every_microbatch=(2, 3),
                  overlaps_param_gather=False, pp_sends_tp_shards=False, sp_keeps_gathered_input=True,
                  offload_step_copy_bytes=(0.0, 12.0, 0.0, 0.0), offload_microbatch_copy_bytes=(0.0, 0.0, 8.0, 12.0),
                  pp_defers_sharded_dp_sync=True, grads_reduced_in_optimizer=(1,), fsdp_blocks_on_gloo=True,
                  cp_exchange="all-gather",       # executor/context.py
                  checkpoint_early_stop=True,     # executor/activations.py: checkpoint(use_reentrant=False)
                  grad_buckets=GradBuckets(nbytes=25 * 2**20, closes="before-exceeding", zero_stages=(1,),
                                           source="executor/zero1.py BUCKET_BYTES (torch DDP's bucket_cap_mb=25)")),
    # SDPA on torch 2.13 (constraints.txt) puts cuDNN first on compute capability 9 and 10 with cuDNN 9.15.1 or later
    # (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp check_prefer_cudnn_attention; pytorch#138522): the
    # executor's attention ran cuDNN's sm90 kernels on the H100 and the H200 (benchmarks/results/gpu_runs.json)
    attention_kernel="fused",
)

# ZeRO-2 and -3 are Megatron-FSDP (--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads /
# optim_grads_params; Megatron-LM's arguments.py, megatron/core/distributed/fsdp), which Megatron-Bridge's
# H100 Llama 3 8B run used (its summary's FSDP = 1); with tensor, context and expert parallelism, not
# under a pipeline here (the distributed optimizer, ZeRO-1, is what Megatron-LM's pipelined runs use)
_MEGATRON_RUNS = Combinations(
    zero_stages=(0, 1, 2, 3), zero_stages_with_pp=(0, 1), zero_stages_with_tp=(0, 1, 2, 3),
    schedules=tuple(name for name, s in SCHEDULES.items() if s.megatron),
    recomputes=runs_in("megatron"), sequence_parallel=True, context_parallel=True, offload_zero_stages=(1,),
    # the embedding or the loss may be a pipeline chunk of its own (--pipeline-model-parallel-layout 'E|...|L', which
    # the export writes; Megatron-Bridge's Llama 3.1 405B recipes count both as layers to split 126 blocks into 16 x 8)
    replicates_kv_heads=True, stages_without_blocks=True,
    expert_parallel="folded", ep_needs_sp=True, expert_dispatchers=("alltoall", "allgather"),
    # --moe-grouped-gemm (TransformerEngine's GroupedLinear, Megatron-Core's TEGroupedMLP), which the export sets, is
    # not one grouped kernel: GroupedLinear quantizes (tex.split_quantize: nvte_multi_tensor_quantize) and multiplies
    # (general_grouped_gemm: nvte_multi_tensor_gemm -> multi_stream_cublas_gemm) each expert on its own, one cuBLAS
    # GEMM and one cast kernel per expert, expert i on compute stream i % 4 (TransformerEngine v2.9, October 2025,
    # the 25.11 containers' release: transformer_engine/common/gemm/cublaslt_gemm.cu, common/util/cast.cu,
    # common/util/multi_stream.cpp num_compute_streams = 4); its CUTLASS grouped GEMM runs only on Hopper and only
    # with NVTE_USE_CUTLASS_GROUPED_GEMM=1, off by default
    grouped_experts=False, expert_gemm_streams=4,
    ep_comm_overlap=True,       # --overlap-moe-expert-parallel-comm (Megatron-Core 0.14+, MoE README 'Batch-level
                                # overlapping to hide EP-A2A communication'), with --delay-wgrad-compute
    # any blocks per stage (--pipeline-model-parallel-layout; --decoder-first/last-pipeline-num-layers); one
    # --recompute-granularity for every layer, or full recompute of the first N blocks of every stage
    # (--recompute-method block)
    unequal_stages=True, recompute_per_layer=False, recomputes_first_blocks=True, finetune_modes=_LORA)
# FP8 by TransformerEngine (--fp8-format, --fp8-recipe: Megatron-LM's arguments.py): per-tensor current scaling
# ("tensorwise"), delayed scaling, blockwise (1x128 / 128x128, DeepSeek-V3's) and MXFP8 (Blackwell); on GPUs only
# on CUDA also the flex dispatcher (--moe-token-dispatcher-type flex, --moe-flex-dispatcher-backend deepep:
# megatron/core/transformer/moe/token_dispatcher.py MoEFlexTokenDispatcher over DeepEP's GPU kernels)
# and the activations of the first N layers offloaded to host memory (--cpu-offloading-num-layers N: Megatron-Core's
# model_parallel_config.py cpu_offloading_num_layers, transformer_block.py get_cpu_offload_context, TransformerEngine's
# transformer_engine/pytorch/cpu_offload.py DefaultOffloadSynchronizer: layers 0..N-1 copied out on a stream of their
# own beside the forward and back beside the backward), N below the layers, refused with pipeline parallelism and with
# any recompute (transformer_config.py __post_init__; at Megatron-LM d98e8a64dd): Megatron-Bridge's Llama 3 70B recipes
# on 64 GB200 offload 20 (BF16) or 40 (FP8) of its 80 layers under Megatron-FSDP
_MEGATRON_CUDA_RUNS = replace(_MEGATRON_RUNS, fp8_recipes=("fp8-tensorwise", "fp8-delayed", "fp8-blockwise", "mxfp8"),
                              expert_dispatchers=("alltoall", "allgather", "flex"), offloads_first_blocks=True)

# bf16 parameters 2, fp32 main gradients 4, fp32 master + Adam 12 (18 bytes; Megatron-LM docs, "distributed
# optimizer"), which shards the 12; Megatron-FSDP shards the gradients too at ZeRO-2 (optim_grads) and the parameters
# at ZeRO-3 (optim_grads_params). The gradients are reduced in their buffer's dtype: fp32 under bf16 (arguments.py
# validate_args sets accumulate_allreduce_grads_in_fp32 for bf16 unless --grad-reduce-in-bf16;
# core/distributed/param_and_grad_buffer.py: grad_dtype = torch.float if grad_reduce_in_fp32 else param.dtype), the
# fp16 parameters' dtype under fp16 (the flag's default, False: ``Runtime.mixed_fp16``)
_MEGATRON_MIXED = StateLayout(params_bytes=2.0, grads_bytes=4.0, optimizer_bytes=12.0, params_sharded_from=3,
                              grads_sharded_from=2, optimizer_sharded_from=1, grad_reduce_bytes=4.0)

# The distributed optimizer's buckets (ZeRO-0 and 1: Megatron-FSDP, ZeRO-2/3, shards a module at a time):
# megatron/core/distributed/distributed_data_parallel.py at core_r0.8.0, ``bucket_size = max(40000000, 1000000 *
# data_parallel_world_size)`` (the dense dp, for the experts' buffer too) with --overlap-grad-reduce (without it one
# bucket for each model chunk's buffer: ``overlapped_only``), filled in reverse parameter order
# until a bucket holds at least that many (param_and_grad_buffer.py); the parameters are gathered back in the same
# buckets. Not modelled: that it turns bucketing off on pipeline ranks after the first and on model chunks after
# the first (one bucket per chunk there), and the shared embedding's bucket of its own
MEGATRON_BUCKETS = GradBuckets(
    elements=4e7, per_dp_rank=1e6, closes="reaching", zero_stages=(0, 1), overlapped_only=True,
    source="Megatron-LM core_r0.8.0 distributed_data_parallel.py and param_and_grad_buffer.py")

# Megatron-LM of 2021 had two data-parallel implementations (megatron/arguments.py at 1c3a1e6a09, --DDP-impl):
# ``local``, its default (megatron/model/distributed.py ``allreduce_gradients``, which megatron/training.py calls
# for each model chunk after the last backward: a chunk's gradients, in its contiguous buffer or flattened into
# one, divided and all-reduced in one call), and ``torch`` (training.py wraps each chunk in torch's
# DistributedDataParallel, whose buckets of bucket_cap_mb = 25 MiB, the first 1 MiB, not modelled, all-reduce
# beside the backward; no_sync on all but the last micro-batch). meshplan's overlapped reduction (its default) is
# the torch one there, --no-overlap-grad-reduce the local one (the distributed optimizer came later)
MEGATRON_2021_DDP = GradBuckets(
    nbytes=25 * 2**20, closes="reaching", overlapped_only=True, zero_stages=(0, 1),
    source="Megatron-LM 1c3a1e6a09 megatron/training.py (--DDP-impl torch: torch DDP, bucket_cap_mb 25) and "
           "megatron/model/distributed.py DistributedDataParallel.allreduce_gradients (--DDP-impl local)")

MEGATRON = Runtime(
    name="megatron",
    description="Megatron-LM (Megatron-Core): its distributed optimizer is ZeRO-1",
    loss="vocab-parallel",
    runs={"cuda": _MEGATRON_CUDA_RUNS, "cpu": _MEGATRON_RUNS},
    mixed=_MEGATRON_MIXED,
    mixed_fp16=replace(_MEGATRON_MIXED, grad_reduce_bytes=2.0),
    fp32=StateLayout(params_bytes=4.0, grads_bytes=4.0, optimizer_bytes=8.0, params_sharded_from=3,
                     grads_sharded_from=2, optimizer_sharded_from=1),
    # --overlap-param-gather: the all-gather runs beside the next forward; scatter/gather of
    # the stage boundary over TP (Narayanan et al. 2021, Sec 4.1)
    timing=Timing(params_gathered_every_microbatch=(3,), grads_reduced_every_microbatch=(2, 3),
                  overlaps_param_gather=True, pp_sends_tp_shards=True, sp_keeps_gathered_input=False,
                  fuses_swiglu=True, grad_buckets=MEGATRON_BUCKETS),
    attention_kernel="fused",
    lora_style="megatron-bridge",       # Megatron-Bridge's LoRA on Megatron-Core models (planner/finetune.py)
)

# What a DeepSpeed config and its engine express (deepspeed/runtime/config.py's keys; deepspeed.pipe): ZeRO 0-3
# with optimizer offload; tensor parallelism by AutoTP (``tensor_parallel.autotp_size``); a pipeline by
# PipelineModule with partition_method 'uniform' (or by parameters: no exact unequal split) and its one 1F1B
# schedule; activation checkpointing of whole layers. No key expresses Megatron's sequence parallelism or
# context parallelism (DeepSpeed-Ulysses splits attention heads, a different scheme), nor a recompute policy
# per layer.
_DEEPSPEED_RUNS = Combinations(
    zero_stages=(0, 1, 2, 3), zero_stages_with_pp=(0, 1), zero_stages_with_tp=(0, 1, 2, 3),
    schedules=tuple(name for name, s in SCHEDULES.items() if s.deepspeed), recomputes=runs_in("deepspeed"),
    sequence_parallel=False, context_parallel=False,
    offload_zero_stages=(1, 2, 3), replicates_kv_heads=True, stages_without_blocks=False,
    unequal_stages=False, recompute_per_layer=False, expert_parallel="data",
    # its expert parallelism is deepspeed.moe.layer.MoE(ep_size=...), and the engine refuses any such layer at stage 3
    # (deepspeed/runtime/engine.py at 38327e07f, February 2025: assert not self.has_moe_layers, "MoE not supported
    # with Stage 3")
    zero_stages_with_ep=(0, 1, 2),
    param_offload_zero_stages=(3,),     # zero_optimization.offload_param: stage 3 only (ZeRO-Infinity)
    finetune_modes=_LORA)
# ZeRO-Infinity's NVMe offload (device "nvme" of offload_optimizer and offload_param): stage 3 only (DeepSpeed's
# config docs: "nvme ... only applicable to ZeRO-3"; deepspeed/runtime/zero/stage3.py builds the optimizer and
# parameter swappers, stage_1_and_2.py has none), on GPUs (its async I/O moves pinned host buffers to the device)
_DEEPSPEED_CUDA = replace(_DEEPSPEED_RUNS, finetune_modes=_LORA_AND_QLORA, nvme_offload_zero_stages=(3,))

DEEPSPEED_BUCKETS = GradBuckets(elements=5e8, closes="before-exceeding", zero_stages=(0, 1, 2, 3),
                                source="DeepSpeed config docs: reduce_bucket_size and allgather_bucket_size default 5e8")

DEEPSPEED = Runtime(
    name="deepspeed",
    description="DeepSpeed ZeRO (Rajbhandari et al. 2020) and ZeRO-Offload (Ren et al. 2021)",
    runs={"cuda": _DEEPSPEED_CUDA, "cpu": _DEEPSPEED_RUNS},
    # the ZeRO paper's layout (Sec 5.1, Table 1): fp16 parameters 2, gradients 2, K = 12; stage 1
    # shards the optimizer, 2 also the gradients, 3 also the parameters
    mixed=StateLayout(params_bytes=2.0, grads_bytes=2.0, optimizer_bytes=12.0, params_sharded_from=3,
                      grads_sharded_from=2, optimizer_sharded_from=1, grad_reduce_bytes=2.0),
    fp32=StateLayout(params_bytes=4.0, grads_bytes=4.0, optimizer_bytes=8.0, params_sharded_from=3,
                     grads_sharded_from=2, optimizer_sharded_from=1),
    # overlap_comm overlaps the gradient reduction; the ZeRO-1/2 optimizer's parameter all-gather
    # ends its step (deepspeed/runtime/zero/stage_1_and_2.py, ``step``: all_gather_dp_groups)
    # offload_param: the 16-bit parameter shard lives in host memory and is copied to the device before the
    # forward's all-gather and again before the backward's (ZeRO-Infinity, Rajbhandari et al. 2021, Sec 5.1 and
    # 6.1; deepspeed/runtime/zero/partitioned_param_coordinator.py fetches each sub-module's parameters for
    # forward and backward): 2 + 2 bytes per parameter per micro-batch, counted unhidden as the other offload
    # copies are
    # ZeRO-0 to 3 reduce (and ZeRO-1/2 gather back) in buckets of reduce_bucket_size / allgather_bucket_size,
    # 5e8 elements by default (DeepSpeed's config docs; deepspeed/runtime/zero/stage_1_and_2.py
    # ``reduce_independent_p_g_buckets_and_remove_grads``, the engine's ``allreduce_gradients`` at ZeRO-0; ZeRO-3's
    # stage3.py at 38327e07f, February 2025: the same fill, one reduce_scatter_coalesced a bucket); ZeRO-3 gathers
    # its parameters a module at a time
    timing=Timing(params_gathered_every_microbatch=(3,), grads_reduced_every_microbatch=(2, 3),
                  overlaps_param_gather=False, pp_sends_tp_shards=False, sp_keeps_gathered_input=False,
                  param_offload_microbatch_copy_bytes=4.0,
                  grad_buckets=DEEPSPEED_BUCKETS),
)

# What a torchtitan job config expresses (torchtitan/config/configs.py and torchtitan/distributed/ at commit
# b5bcd76, August 2026; the same keys in v0.2.2's TOML form): FSDP2 over the data-parallel (and context-parallel)
# ranks with fsdp_reshard_after_forward "always" (ZeRO-3) or "never" (ZeRO-2), or replicated (FSDP2 with a shard
# degree of 1 over dp_replicate: ZeRO-0) and no ZeRO-1; under context parallelism FSDP always shards over the
# context-parallel ranks (the dp_shard_cp mesh, torchtitan/distributed/parallel_dims.py), so ZeRO-0 with cp > 1
# is not expressed; enable_cpu_offload is FSDP2's CPUOffloadPolicy (ZeRO-2/3); tensor parallelism with or without
# sequence parallelism (enable_sequence_parallel), tp dividing the key/value heads (models/common/decoder.py
# raises otherwise); every schedule of torch.distributed.pipelining, stages of any modules
# (module_fqns_per_model_part); activation checkpointing none, full, selective per operator or every K-th
# block, one mode for every block. It runs the code meshplan's executor runs (FSDP2, DTensor, pipelining), so its
# steps are priced as meshplan's runtime's.
_TORCHTITAN_RUNS = Combinations(
    zero_stages=(0, 2, 3), zero_stages_with_pp=(0, 2, 3), zero_stages_with_tp=(0, 2, 3), zero_stages_with_cp=(2, 3),
    # torchtitan runs every torch.distributed.pipelining schedule, the split-backward ones (interleaved-zb, zbv,
    # dualpipev) included
    schedules=tuple(name for name, s in SCHEDULES.items() if s.torch_name),
    recomputes=runs_in("torchtitan"),
    sequence_parallel=True, context_parallel=True, offload_zero_stages=(2, 3), replicates_kv_heads=False,
    stages_without_blocks=True, unequal_stages=True, recompute_per_layer=False, expert_parallel="folded",
    # ep divides dp_shard x cp x tp (torchtitan/distributed/parallel_dims.py ``_validate``: its sparse mesh is
    # (pp, dp_replicate, efsdp, ep)), so under ZeRO-0, whose data-parallel ranks are dp_replicate, only cp x tp
    ep_from_replicas=False,
    grouped_experts=True,       # torchtitan's MoE: use_grouped_mm (torch._grouped_mm), its default
    compiles_blocks=True)       # [compile] enable, components = ["model"]: apply_compile per transformer block
# torchao's float8 and MX linears ([quantize.linear.float8] recipe_name, [quantize.linear.mx]; torchtitan/components/
# quantization/float8.py and mx.py), on GPUs with FP8 (SM89+, MI300): rowwise and rowwise_with_gw_hp at b5bcd76;
# tensorwise with FP8 all-gather (enable_fsdp_float8_all_gather) through v0.2.2's TOML keys, which the export
# writes (the Python config of 6348d93, April 2026, dropped it)
_TORCHTITAN_CUDA_RUNS = replace(_TORCHTITAN_RUNS,
                                fp8_recipes=("fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp", "mxfp8"))

TORCHTITAN = replace(
    TORCH, name="torchtitan", priced_as="torch", runs={"cuda": _TORCHTITAN_CUDA_RUNS, "cpu": _TORCHTITAN_RUNS},
    attention_kernel="flash",   # its published runs (2024-2025) ran torch's SDPA before it put cuDNN first (2.11)
    description="torchtitan: FSDP2 (ZeRO-2/3) or replicated data parallelism, DTensor TP/SP, context parallelism, "
                "torch.distributed.pipelining, one activation-checkpointing mode")

# DeepSpeed as it was from v0.3.13 (March 2021, the first with ZeRO-3) to v0.4.2 (June 2021), the versions
# of spring 2021, when Narayanan et al. (SC'21, arXiv April 2021) measured the ZeRO-3 runs of Table 2: the same
# configuration keys and memory layout, but ZeRO-3 fetches one tensor at a time behind torch.cuda.synchronize()
# and gathers it into a list of per-rank views (deepspeed/runtime/zero/partition_parameters.py
# ``_allgather_param``, stage3.py ``fetch_sub_module`` at v0.3.16; v0.5.5 moved the gather to
# ``_all_gather_base``, one flat output), and with ZeRO-3's default contiguous_gradients=false (true from
# v0.4.3) all-reduces the gradients in reduce_bucket_size buckets (stage3.py ``buffered_reduce_fallback``;
# planner/cost/fetch.py). The gather loop's host time per rank: the loop, copied into
# ``python benchmarks/deepspeed_host_loop.py`` and run on CPU tensors with a gloo group, on the development
# machine (2026-11-26): 2.7 us per rank, the median of 7 runs over 1536 ranks (three more runs: 2.72-2.88)
DEEPSPEED_2021 = replace(
    DEEPSPEED, name="deepspeed-2021",
    description="DeepSpeed v0.3.13-v0.4.2 (spring 2021): ZeRO-3 gathers one tensor at a time, each behind a "
                "device-wide synchronize, and all-reduces the gradients in buckets",
    # no LoRA: the versions predate PEFT (2022-) and bitsandbytes' 4-bit (2023)
    # nor NVMe offload: ZeRO-Infinity came with v0.3.15 (April 2021) and the 2021 runs of the public set used none
    runs={kind: replace(can, finetune_modes=("full",), nvme_offload_zero_stages=())
          for kind, can in DEEPSPEED.runs.items()},
    timing=replace(DEEPSPEED.timing, zero3_per_tensor=PerTensorFetch(
        gather_loop_s=2.7e-6, reduce_bucket=DEEPSPEED_BUCKETS.elements, max_reuse_distance=1e9,
        source="DeepSpeed v0.3.16 stage3.py (stage3_max_reuse_distance default 1e9, reduce_bucket_size 5e8) and "
               "partition_parameters.py; loop: python benchmarks/deepspeed_host_loop.py (2026-11-26)")))

# Megatron-LM as it was in 2021 (commit 1c3a1e6a09, August 2021; the runs of Narayanan et al. SC'21): the same
# memory layout and flags, but (1) every stage-boundary exchange blocks: megatron/p2p_communication.py
# ``_communicate`` batches the isend/irecv, waits on each request and then calls torch.cuda.synchronize(), so the
# interleaved schedule overlaps no send with compute (``--overlap-p2p-comm`` came in commit f9283c5a8a, May 2023);
# (2) the interleaved schedule needs pp > 2 (megatron/arguments.py: "pipeline-model-parallel size should be
# greater than 2 with interleaved schedule", from commit 182841f7df, 2021-03-20, until 3ee489d9ea, 2024-05-31)
MEGATRON_2021 = replace(
    MEGATRON, name="megatron-2021", priced_as="megatron",
    description="Megatron-LM of 2021 (Narayanan et al. SC'21): blocking pipeline sends, interleaving at pp > 2 only",
    runs={kind: replace(can, virtual_stages_min_pp=3, fp8_recipes=(), finetune_modes=("full",), zero_stages=(0, 1),
                        zero_stages_with_tp=(0, 1), expert_dispatchers=("alltoall",), stages_without_blocks=False)
          for kind, can in MEGATRON.runs.items()},
    # ^ no FP8 (TransformerEngine came to Megatron-LM in 2022), no LoRA (Megatron-Bridge's PEFT is of 2025), no
    #   Megatron-FSDP (2025), no flex dispatcher (2025), no pipeline layouts (2025): blocks in every stage
    # ^ and its DDP: torch's buckets beside the backward, or its local one call per chunk after it (MEGATRON_2021_DDP)
    timing=replace(MEGATRON.timing, pp_sends_block=True, grad_buckets=MEGATRON_2021_DDP),
    attention_kernel="flash")   # ^ nor TransformerEngine (2022): no fused cuDNN attention

RUNTIMES: dict[str, Runtime] = {r.name: r for r in (TORCH, MEGATRON, DEEPSPEED, TORCHTITAN, DEEPSPEED_2021,
                                                    MEGATRON_2021)}
EXECUTOR_RUNTIME = "torch"      # the runtime `meshplan run` is


def lora_style(framework: str) -> str:
    """The LoRA style (planner/finetune.py STYLES) of ``framework``'s runtime; PEFT's for a name not in the table."""
    return RUNTIMES[framework].lora_style if framework in RUNTIMES else "peft"


def priced_as(framework: str) -> str:
    """The runtime whose mechanisms price ``framework``'s steps (``Runtime.priced_as``), or ``framework``."""
    rt = RUNTIMES.get(framework)
    return (rt.priced_as or rt.name) if rt is not None else framework


# The parts of a model spec meshplan's executor does not build yet (executor/models.py): it refuses plans of such
# models (executor/support.py check_model) and `meshplan plan` says so when it plans one for runtime torch
def unbuilt(spec) -> list[tuple[str, str]]:
    """(ModelSpec field, what it asks for) of each part of ``spec`` the executor does not build yet: experts other
    than SwiGLU (executor/moe.py)."""
    return [("mlp", "GELU experts")] if spec.is_moe and spec.mlp == "gelu" else []


def unfused_core(spec, framework: str) -> bool:
    """Whether ``framework`` runs ``spec``'s attention core with its scores materialised whatever the workload's
    ``attention``: meshplan's executor (the torch runtime) writes out the core of a model with attention sinks or
    a sliding window shorter than the sequence (executor/models.py ``masked_attention``: its scores masked, a sink
    logit per head in the softmax), as transformers' eager attention does; a window no shorter than the sequence
    is full causal attention (a query at position i sees keys i - W + 1 .. i, all of them while i < W:
    transformers' sliding-window mask), which SDPA's kernels run. torchtitan runs such cores as FlexAttention
    (torchtitan/models/gpt_oss/model.py: the sinks applied to its output by the log-sum-exp), a fused kernel."""
    return framework == EXECUTOR_RUNTIME and spec is not None and (
        spec.attention_sinks or 0 < spec.sliding_window < spec.seq_len)


def refusals(runtime: str, device_kind: str, *, zero: int | None = None, tp: int | None = None,
             pp: int | None = None, cp: int | None = None, schedule: str | None = None,
             optimizer_offload: bool | None = None, param_offload: bool | None = None,
             nvme_offload: bool | None = None, sequence_parallel: bool | None = None,
             recompute: str | None = None,
             num_kv_heads: int | None = None, ep: int | None = None, dp: int | None = None,
             num_experts: int | None = None, latent_attention: bool | None = None,
             fp8: str = "", compile: bool = False, finetune: str = "full",
             ep_comm_overlap: bool = False) -> list[tuple[str, str]]:
    """(knob, why) for every knob value, or pair of them, that ``runtime`` does not run on
    ``device_kind``; None means the knob is not known yet (nothing is said about it). ``fp8``: the workload's
    FP8 recipe (planner/precision.py); ``compile``: its blocks torch.compile'd (``Workload.compile``);
    ``ep_comm_overlap``: its expert all-to-alls overlapped (``Workload.ep_comm_overlap``)."""
    rt = RUNTIMES[runtime]
    can = rt.on(device_kind)
    who = f"the {runtime} runtime on {device_kind}"
    out = []
    if zero is not None and zero not in can.zero_stages:
        out.append(("zero", f"ZeRO-{zero} does not run on {who}; allowed: {one_of(can.zero_stages)}"))
    elif zero is not None and pp is not None and pp > 1 and zero not in can.zero_stages_with_pp:
        out.append(("zero", f"ZeRO-{zero} with pipeline parallelism does not run on {who}; allowed with "
                            f"pp > 1: {one_of(can.zero_stages_with_pp)}"))
    elif zero is not None and tp is not None and tp > 1 and zero not in can.zero_stages_with_tp:
        out.append(("zero", f"ZeRO-{zero} with tensor parallelism does not run on {who}; allowed with "
                            f"tp > 1: {one_of(can.zero_stages_with_tp)}"))
    elif (zero is not None and cp is not None and cp > 1 and can.zero_stages_with_cp is not None
          and zero not in can.zero_stages_with_cp):
        out.append(("zero", f"ZeRO-{zero} with context parallelism does not run on {who}; allowed with "
                            f"cp > 1: {one_of(can.zero_stages_with_cp)}"))
    elif (zero is not None and schedule is not None and pp is not None and pp > 1
          and can.zero_stages_with_split_backward is not None and SCHEDULES[schedule].backward == "split"
          and zero not in can.zero_stages_with_split_backward):
        out.append(("zero", f"ZeRO-{zero} with the {schedule} schedule (input and weight gradients as separate "
                            f"passes) does not run on {who}; allowed with it: "
                            f"{one_of(can.zero_stages_with_split_backward)}"))
    if schedule is not None and schedule not in can.schedules:
        out.append(("schedule", f"{schedule!r} does not run on {who}; allowed: {one_of(can.schedules)}"))
    elif (schedule is not None and pp is not None and 1 < pp < can.virtual_stages_min_pp
          and SCHEDULES[schedule].virtual_stages):
        out.append(("schedule", f"{schedule!r} with pp {pp} does not run on {who}; allowed with virtual stages: "
                                f"pp >= {can.virtual_stages_min_pp}"))
    if schedule is not None and (found := SCHEDULES[schedule].compile_refusal(compile)):
        out.append(("schedule", found[1]))
    if compile and tp is not None and tp > 1:
        out += _compile_with_tp_refusals(can, who, tp=tp, sequence_parallel=sequence_parallel, recompute=recompute)
    if finetune != "full" and pp is not None and pp > 1 and not can.adapters_with_pp:
        out.append(("pp", f"--finetune {finetune} with pipeline parallelism (pp {pp}) does not run on {who}; "
                          "allowed with it: pp 1"))
    if finetune == "qlora":
        out += _nf4_base_refusals(can, who, zero=zero, tp=tp, pp=pp, replicas=(dp or 1) * (cp or 1))
    if finetune != "full" and fp8 and not can.adapters_with_fp8:
        out.append(("precision", f"--finetune {finetune} with {fp8} does not run on {who}; allowed with it: bf16, "
                                 "fp16 or fp32"))
    if (sequence_parallel and schedule is not None and pp is not None and pp > 1 and not can.sp_with_split_backward
            and SCHEDULES[schedule].backward == "split"):
        out.append(("sequence_parallel", f"sequence parallelism with the {schedule} schedule (input and weight "
                                         f"gradients as separate passes) does not run on {who}; allowed with it: off"))
    if recompute == "activation-offload" and can.offloads_first_blocks:
        out.append(("recompute", f"{recompute!r} on every block does not run on {who}, which offloads the activations "
                                 "of its first N blocks, N below the model's, with no pipeline and no recompute "
                                 "(--cpu-offloading-num-layers); leave --recompute out and the search tries that; "
                                 f"allowed: {one_of(can.recomputes)}"))
    elif recompute is not None and recompute not in can.recomputes:
        out.append(("recompute", f"{recompute!r} does not run on {who}; allowed: {one_of(can.recomputes)}"))
    elif recompute == "discard" and fp8 == "fp8-delayed":
        # Megatron-Core (transformer_config.py at core_v0.15.0): "Delayed scaling does not support moe_act and
        # layernorm recompute for fp8"
        out.append(("recompute", f"'discard' with fp8-delayed does not run on {who} (Megatron-Core refuses the "
                                 "moe_act and layernorm recompute modules under delayed scaling); allowed with it: "
                                 f"{one_of([r for r in can.recomputes if r != 'discard'])}"))
    if sequence_parallel and not can.sequence_parallel:
        out.append(("sequence_parallel", f"sequence parallelism does not run on {who}; allowed: off"))
    elif sequence_parallel and latent_attention and not can.sp_with_latent_attention:
        out.append(("sequence_parallel", f"sequence parallelism with multi-head latent attention does not run on "
                                         f"{who}; allowed: off"))
    if cp is not None and cp > 1 and not can.context_parallel:
        out.append(("cp", f"context parallelism (cp {cp}) does not run on {who}; allowed: 1"))
    if optimizer_offload:
        out += _offload_refusals("optimizer_offload", "optimizer offload", can.offload_zero_stages, zero, who)
    if param_offload and not can.param_offload_zero_stages:
        with_params = tuple(z for z in can.offload_zero_stages if z >= rt.layout("bf16").offload_params_grads_from)
        why = (f" (its optimizer offload at ZeRO {one_of(with_params)} keeps the parameter shards in host memory)"
               if with_params else "")
        out.append(("param_offload", f"parameter offload is not a knob of its own on {who}; allowed: off{why}"))
    elif param_offload:
        out += _offload_refusals("param_offload", "parameter offload", can.param_offload_zero_stages, zero, who)
    if nvme_offload:
        out += _offload_refusals("nvme_offload", "offload to NVMe", can.nvme_offload_zero_stages, zero, who)
        if optimizer_offload is False and param_offload is False:
            out.append(("nvme_offload", "offload to NVMe moves what optimizer or parameter offload offloads; "
                                        "neither is on"))
    if ep is not None and ep > 1:
        out += _ep_refusals(can, who, ep=ep, dp=dp, tp=tp, cp=cp, sequence_parallel=sequence_parallel,
                            num_experts=num_experts, zero=zero)
        if recompute is not None and can.recomputes_with_ep is not None and recompute not in can.recomputes_with_ep:
            out.append(("recompute", f"{recompute!r} with expert parallelism does not run on {who}; allowed with "
                                     f"ep > 1: {one_of(can.recomputes_with_ep)}"))
    if ep_comm_overlap:
        out += _ep_overlap_refusals(who, ep=ep, pp=pp, schedule=schedule, recompute=recompute)
    if fp8 and tp is not None and tp > 1 and not can.fp8_with_tp:
        out.append(("tp", f"{fp8} with tp {tp} does not run on {who}; allowed: tp 1"))
    if num_experts and tp is not None and tp > 1 and not can.experts_with_tp:
        out.append(("tp", f"a mixture of experts with tp {tp} does not run on {who}; allowed: tp 1"))
    elif (num_experts and tp is not None and tp > 1 and not can.experts_split_by_tp and can.ep_needs_sp
          and latent_attention and not can.sp_with_latent_attention):
        out.append(("tp", f"a mixture of experts with tp {tp} needs ep > 1 on {who}, and with it sequence parallelism, "
                          "which does not run with multi-head latent attention there; allowed: tp 1"))
    elif (num_experts and tp is not None and tp > 1 and not can.experts_split_by_tp and can.ep_needs_sp
          and sequence_parallel is False):
        out.append(("sequence_parallel", f"a mixture of experts with tp {tp} needs ep > 1 on {who}, and with it "
                                         "sequence parallelism; allowed with tp > 1: sequence parallelism on"))
    elif num_experts and tp is not None and tp > 1 and not can.experts_split_by_tp and ep == 1:
        out.append(("ep", f"a mixture of experts with tp {tp} needs ep > 1 on {who}: its routed experts are not split "
                          "over the tensor-parallel ranks but spread whole over ep ranks, which may include them"))
    if tp is not None and num_kv_heads is not None and num_kv_heads % tp and not can.replicates_kv_heads:
        out.append(("tp", f"tp {tp} must divide the {num_kv_heads} key/value heads on {who} (it does not "
                          "replicate key/value heads)"))
    return out


def _ep_overlap_refusals(who: str, *, ep, pp, schedule, recompute) -> list[tuple[str, str]]:
    """What Megatron-Core refuses with --overlap-moe-expert-parallel-comm (megatron/core/transformer/
    transformer_config.py at 92c8482e): no expert parallelism, full recompute, and a pipeline without virtual
    stages."""
    out = []
    if ep is not None and ep == 1:
        out.append(("ep", f"--ep-comm-overlap overlaps expert parallelism's all-to-alls, and ep 1 has none on {who}; "
                          "allowed with it: ep > 1"))
    if recompute is not None and recompute == "full":
        out.append(("recompute", f"'full' with --ep-comm-overlap does not run on {who} (Megatron-Core refuses full "
                                 "recomputation with it); allowed with it: a selective policy or none"))
    if schedule is not None and pp is not None and pp > 1 and not SCHEDULES[schedule].virtual_stages:
        out.append(("schedule", f"{schedule!r} with --ep-comm-overlap and pp {pp} does not run on {who} (Megatron-"
                                "Core needs virtual stages under a pipeline with it); allowed with it: a schedule "
                                "with virtual stages"))
    return out


def _nf4_base_refusals(can: Combinations, who: str, *, zero: int | None, tp: int | None, pp: int | None,
                       replicas: int) -> list[tuple[str, str]]:
    """QLoRA's NF4 base with a ZeRO stage, a pipeline over data-parallel replicas (``replicas``: dp x cp, 1 where
    not known) or tensor parallelism the runtime does not run it with."""
    out = []
    if tp is not None and tp > 1 and not can.nf4_base_with_tp:
        out.append(("tp", f"--finetune qlora with tp {tp} does not run on {who}; allowed with it: tp 1"))
    if zero is not None and zero not in can.nf4_base_zero_stages:
        out.append(("zero", f"--finetune qlora with ZeRO-{zero} does not run on {who}; allowed with it: ZeRO "
                            f"{one_of(can.nf4_base_zero_stages)}"))
    elif (zero is not None and pp is not None and pp > 1 and replicas > 1
          and zero not in can.nf4_base_zero_stages_with_pp):
        out.append(("zero", f"--finetune qlora with ZeRO-{zero} under pipeline parallelism over {replicas} data-"
                            f"parallel replicas does not run on {who}; allowed with them: ZeRO "
                            f"{one_of(can.nf4_base_zero_stages_with_pp)}"))
    return out


def _offload_refusals(knob: str, what: str, stages: tuple[int, ...], zero: int | None,
                      who: str) -> list[tuple[str, str]]:
    """An offload knob the runtime does not run at all, or not at ``zero``."""
    if not stages:
        return [(knob, f"{what} does not run on {who}; allowed: off")]
    if zero is not None and zero not in stages:
        return [(knob, f"{what} with ZeRO-{zero} does not run on {who}; allowed with ZeRO {one_of(stages)}")]
    return []


def expert_ranks(runtime: str, *, dp: int, cp: int, tp: int) -> int:
    """The ranks of one pipeline stage that routed experts are split over and replicated across
    (``Combinations.expert_parallel``): dp x cp x tp folded, dp for DeepSpeed's expert groups. Both are the same on
    every kind of device."""
    how = RUNTIMES[runtime].on("cuda").expert_parallel
    return dp if how == "data" else dp * cp * tp


def expert_data_parallel(runtime: str, *, ep: int, dp: int, cp: int, tp: int) -> int:
    """The expert data-parallel size: the ranks holding the same experts, over which their gradients are reduced
    and, with ZeRO, their states sharded (``expert_ranks`` / ep)."""
    return max(1, expert_ranks(runtime, dp=dp, cp=cp, tp=tp) // max(1, ep))


def _ep_refusals(can: Combinations, who: str, *, ep: int, dp, tp, cp, sequence_parallel, num_experts, zero=None
                 ) -> list[tuple[str, str]]:
    if can.expert_parallel == "none":
        return [("ep", f"expert parallelism (ep {ep}) does not run on {who}; allowed: 1")]
    if num_experts == 0:
        return [("ep", f"ep {ep} splits routed experts, and the model has none; allowed: 1")]
    out = []
    if num_experts is not None and num_experts % ep:
        allowed = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        out.append(("ep", f"ep {ep} does not divide the model's {num_experts} routed experts; allowed: "
                          f"{one_of(allowed)}"))
    if can.expert_parallel == "data":
        if dp is not None and dp % ep:
            out.append(("ep", f"ep {ep} must divide the data-parallel size ({dp}) on {who}"))
        if tp is not None and tp > 1:
            out.append(("ep", f"ep {ep} with tp {tp}: {who} would split each expert's tokens over the tensor-"
                              "parallel ranks, which meshplan does not model; allowed with ep > 1: tp 1"))
    elif None not in (dp, tp, cp) and (dp * cp * tp) % ep:
        out.append(("ep", f"ep {ep} must divide dp x cp x tp = {dp} x {cp} x {tp} = {dp * cp * tp} on {who} (experts "
                          "fold onto the data, context and tensor-parallel ranks)"))
    elif zero == 0 and not can.ep_from_replicas and tp is not None and ((cp or 1) * tp) % ep:
        region = (cp or 1) * tp
        out.append(("zero", f"ep {ep} with ZeRO-0 on {who}: its experts fold onto the sharded data-parallel ranks, "
                            f"the context and the tensor-parallel ones, and ZeRO-0 replicates the data-parallel ranks, "
                            f"leaving cp x tp = {region}; allowed with ep {ep}: a sharded ZeRO stage, or an ep "
                            f"dividing {region}"))
    if can.ep_needs_sp and tp is not None and tp > 1 and sequence_parallel is False:
        out.append(("sequence_parallel", f"ep {ep} with tp {tp} needs sequence parallelism on {who}"))
    if zero is not None and can.zero_stages_with_ep is not None and zero not in can.zero_stages_with_ep:
        out.append(("zero", f"ZeRO-{zero} with expert parallelism (ep {ep}) does not run on {who}; allowed with "
                            f"ep > 1: ZeRO {one_of(can.zero_stages_with_ep)}"))
    return out


def _compile_with_tp_refusals(can, who: str, *, tp: int, sequence_parallel: bool | None,
                              recompute: str | None) -> list[tuple[str, str]]:
    """Compiled blocks (--compile) with tensor parallelism (tp > 1): under which sequence parallelism and recompute
    policy ``can`` runs them (None: not known yet)."""
    out = []
    if sequence_parallel is False and can.compile_with_tp_needs_sp:
        out.append(("sequence_parallel", f"compiled blocks (--compile) with tensor parallelism (tp {tp}) run on {who} "
                                         "only with sequence parallelism; allowed with them: --sequence-parallel on"))
    allowed = can.compile_with_tp_recomputes
    if recompute is not None and allowed is not None and recompute not in allowed:
        out.append(("recompute", f"recompute {recompute} inside compiled blocks (--compile) with tensor parallelism "
                                 f"(tp {tp}) does not run on {who}; allowed with them: {one_of(allowed)}"))
    return out


def config_refusals(config, runtime: str, device_kind: str, num_kv_heads: int | None = None,
                    num_experts: int | None = None, latent_attention: bool | None = None,
                    fp8: str = "", compile: bool = False, finetune: str = "full",
                    ep_comm_overlap: bool = False, num_blocks: int | None = None) -> list[tuple[str, str]]:
    """``refusals`` for every knob of a ParallelConfig (planner/config.py), the recompute policy of each
    layer included (an every-K pattern is its layers' policies; activation offload on some blocks where the
    runtime offloads its first blocks, ``offloads_first_blocks``)."""
    c = config
    layers = c.recompute_layers or (c.recompute,)
    can = RUNTIMES[runtime].on(device_kind) if runtime in RUNTIMES else None
    offloads_some = can is not None and can.offloads_first_blocks and "activation-offload" in layers
    out = refusals(runtime, device_kind, zero=c.zero, tp=c.tp, pp=c.pp, cp=c.cp, schedule=c.schedule,
                   optimizer_offload=c.optimizer_offload, param_offload=c.param_offload,
                   nvme_offload=c.nvme_offload, sequence_parallel=c.sequence_parallel,
                   num_kv_heads=num_kv_heads, ep=c.ep, dp=c.dp, num_experts=num_experts,
                   latent_attention=latent_attention, fp8=fp8, compile=compile, finetune=finetune,
                   ep_comm_overlap=ep_comm_overlap)
    if offloads_some:
        out += _first_blocks_offload_refusals(c, f"the {runtime} runtime on {device_kind}", num_blocks, ep_comm_overlap)
    for policy in dict.fromkeys(p for p in layers if not (offloads_some and p == "activation-offload")):
        out += [(k, why) for k, why in refusals(runtime, device_kind, recompute=policy, ep=c.ep,
                                                ep_comm_overlap=ep_comm_overlap, compile=compile, tp=c.tp, fp8=fp8)
                if k == "recompute" and (k, why) not in out]
    return out


def _first_blocks_offload_refusals(c, who: str, num_blocks: int | None,
                                   ep_comm_overlap: bool = False) -> list[tuple[str, str]]:
    """What Megatron-Core refuses of activation offload on some blocks (``Combinations.offloads_first_blocks``;
    transformer_config.py __post_init__): pipeline parallelism, any recompute beside it, every block offloaded; and
    what meshplan does not plan with it: --ep-comm-overlap, whose schedule (combined_1f1b) runs one micro-batch's
    forward layers between another's backward layers, where TransformerEngine's offload synchronizer
    (cpu_offload.py DefaultOffloadSynchronizer) counts one micro-batch's layers forward, then backward."""
    layers = c.recompute_layers or (c.recompute,)
    offloaded = sum(p == "activation-offload" for p in layers)
    others = sorted(set(layers) - {"none", "activation-offload"})
    out = []
    if c.pp > 1:
        out.append(("pp", f"activation offload (--cpu-offloading-num-layers) with pipeline parallelism (pp {c.pp}) "
                          f"does not run on {who}; allowed with it: pp 1"))
    if others:
        out.append(("recompute", f"activation offload with recompute ({', '.join(others)}) does not run on {who}, "
                                 "which refuses any recompute granularity beside --cpu-offloading-num-layers; "
                                 "allowed with it: none on the other blocks"))
    if ep_comm_overlap:
        out.append(("recompute", f"activation offload (--cpu-offloading-num-layers) with --ep-comm-overlap is not "
                                 f"planned on {who}: its schedule interleaves micro-batches layer by layer, which "
                                 "TransformerEngine's offload synchronizer does not count; allowed with it: the "
                                 "recompute policies"))
    if c.recompute_layers is None or (num_blocks is not None and offloaded >= num_blocks):
        out.append(("recompute", f"activation offload on every block does not run on {who}, which offloads "
                                 "its first N blocks, N below the model's (--cpu-offloading-num-layers); allowed: "
                                 f"at most {num_blocks - 1 if num_blocks else 'all but one'}"))
    return out
