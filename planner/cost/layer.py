"""One layer under one parallel context: time per micro-batch and saved activations.

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019, Sec 3): column-
parallel linears split their output features, row-parallel ones their input
features, attention splits heads; each block all-reduces twice in forward and
twice in backward. Sequence parallelism (Korthikanti et al. 2022, Sec 4.2.2)
turns each all-reduce into a reduce-scatter plus an all-gather of the same
volume and shards the norms, dropout and residuals along the sequence.
Context parallelism splits the sequence across ``cp`` ranks; attention passes
key/value blocks around a ring (Liu et al. 2023, Ring Attention), overlapped with
the attention kernel of the block at hand, or all-gathers them before attention
(Dubey et al. 2024, Llama 3, Sec 3.3.2), as the runtime's ``cp_exchange`` says.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ..cluster import DTYPE_BYTES, Cluster
from ..layers import Layer, Op, Saved, op_replicated_params
from .. import network
from .. import finetune as modes
from .. import precision as fp8_recipes
from ..recompute import POLICY_RECORDS, BlockFacts, PolicyCost, discarded_ops
from ..runtimes import RUNTIMES, lora_style, priced_as
from .compute import device_memo, flash_attention_s, gemm_s, memory_bound_s, unfused_attention_s
from .eager import CAST_UP_BYTES, eager_s

# Under torch's autocast (meshplan's executor with DDP or no wrapper: planner/cost/eager.py) the parameters and the
# embedding's output are fp32 and each block adds its bf16 outputs into that stream, so the residual stream stays fp32
# (torch.amp: ops outside its lists run in their inputs' widest dtype): the norms save their fp32 input for backward,
# and a checkpoint of a whole block keeps its fp32 input. Under FSDP2's MixedPrecisionPolicy everything is bf16.
RESIDUAL_AUTOCAST_BYTES = 4


def residual_bytes(eager_regime: str, precision: str) -> int:
    """Bytes per element of the residual stream: a norm's saved input, a block's checkpointed input, what a pipeline
    stage sends (``RESIDUAL_AUTOCAST_BYTES`` under torch's autocast, else the compute dtype's)."""
    return RESIDUAL_AUTOCAST_BYTES if eager_regime == "autocast" else DTYPE_BYTES[precision]


class Context(NamedTuple):
    """The parallel context a layer runs in (everything its per-micro-batch cost depends on)."""

    micro_batch: int
    seq_len: int
    tp: int
    cp: int
    sequence_parallel: bool
    precision: str
    attention: str              # "flash" | "unfused"
    framework: str
    tp_comm_overlap: bool
    ep_comm_overlap: bool = False   # expert all-to-alls beside another micro-batch's compute (Workload.ep_comm_overlap)
    eager_regime: str = ""      # torch eager mixed precision ("autocast" / "bf16"; planner.cost.eager)
    ep: int = 1                 # expert parallelism: routed experts split over ep ranks, each whole on its rank
    expert_imbalance: float = 1.0   # under ep > 1, the busiest rank's routed tokens over the balanced share
    expert_dispatcher: str = "alltoall"     # how tokens reach their experts under ep > 1 (``_expert_exchange_s``)
    fp8: str = ""               # the FP8 recipe of the linears (planner/precision.py), "" for none
    finetune: str = "full"      # the training mode (planner/finetune.py): which parameters train
    lora_rank: int = 0          # its adapters' rank and targets (0, (): the mode's defaults)
    lora_targets: tuple[str, ...] = ()
    compiled: bool = False      # torch runtimes: each block torch.compile'd (Workload.compile): its pointwise ops
                                # fused (priced at their bytes, not as eager kernels) and recomputed in backward
                                # rather than saved (``Op.compiled_saved``)

    @property
    def tokens(self) -> float:
        """Tokens one rank processes per micro-batch."""
        return self.micro_batch * self.seq_len / self.cp


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    fwd_s: float                          # forward, exposed TP/CP communication included
    bwd_s: float                          # backward, exposed communication included
    by_policy: dict[str, PolicyCost]      # what each recompute policy costs (planner/recompute.py)
    tp_comm_s: float                      # exposed TP collective time, forward + backward
    cp_comm_s: float                      # exposed context-parallel exchange, forward + backward
    params: float                         # parameters held by one rank (TP shards; E / ep experts)
    matmul_flops_fwd: float               # matmul FLOPs of one forward on one rank (hardware FLOPs)
    expert_params: float = 0.0            # of ``params``, the routed experts' where ep > 1: reduced and sharded
                                          # over the expert data-parallel ranks, not the dense ones
    routed_params: float = 0.0            # of ``params``, the trained routed experts' at any ep (``expert_params``
                                          # where ep > 1): stacks whose states ZeRO shards along their own
                                          # dimension (planner/cost/step.py ``routed_state_shard``)
    ep_comm_s: float = 0.0                # the all-to-alls of expert parallelism, forward + backward (exposed)
    work_floor_s: float = 0.0             # a lower bound on fwd_s + bwd_s that is linear in the tokens
                                          # (GEMMs at their ideal rate, no quantization, no communication):
                                          # k times it at micro-batch 1 bounds the time at micro-batch k
    wgrad_s: float = 0.0                  # of ``bwd_s``, the weight-gradient (W) GEMMs of its linears
                                          # (``linear_wgrad_s``); the rest is the input gradient (I), which
                                          # split-backward schedules run apart (Qi et al., ICLR 2024, Sec 2.1)
    frozen_bytes: float = 0.0             # bytes of the frozen parameters one rank stores (TP shards; planner/
                                          # finetune.py): no gradient, no optimizer state; ``params`` are the
                                          # trainable ones (under full training all but a traced module's frozen ones)
    frozen_params: float = 0.0            # how many parameters those bytes hold
    matmul_flops_bwd: float | None = None  # matmul FLOPs of one backward on one rank (None: twice the forward's;
                                          # a frozen linear runs its input gradient only)

    def policy(self, name: str) -> PolicyCost:
        return self.by_policy[name]


def _split(split: str, ctx: Context) -> int:
    if split == "tp" or (split == "sp" and ctx.sequence_parallel):
        return ctx.tp
    return 1


def _op_divisor(op: Op, ctx: Context) -> int:
    """How many ranks share one operator's work under TP/SP."""
    if op.kind == "attention" or (op.kind == "linear" and op.tp != "replicate"):
        return ctx.tp
    return _split(op.split, ctx)


def _routed_share(op: Op, ctx: Context) -> float:
    """How much more of an expert op's tokens the busiest rank holds than the balanced share (Workload.expert_imbalance)
    under expert parallelism; 1 for every other op, and without expert parallelism (each rank runs every expert on
    all its tokens: the imbalance moves work between its GEMMs, not between ranks)."""
    return ctx.expert_imbalance if op.expert and ctx.ep > 1 else 1.0


def _fp8_saved_share(op: Op, ctx: Context) -> float:
    """What a linear keeps of its input for the weight gradient, over the compute dtype's bytes: TransformerEngine's
    FP8 linears keep the FP8 (column-wise) copy their cast made, one byte per element and its scales (MXFP8 an e8m0
    per 32, blockwise an fp32 per 128: ``Recipe.scale_bytes``; TE's Linear and GroupedLinear save their quantized
    input under fp8_autocast), where torchao keeps the bf16 input and casts it again (its rowwise and MX casts of the
    input in backward); 1 elsewhere."""
    return _fp8_input_share(op, ctx) if op.saved else 1.0


def _fp8_input_share(op: Op, ctx: Context) -> float:
    """``_fp8_saved_share`` of linear ``op``'s input, whoever keeps it (the linear, or the op before it:
    ``Op.saves_linear_input``)."""
    if not ctx.fp8 or op.kind != "linear" or fp8_recipes.library(ctx.framework) != "te" \
            or not fp8_converts(op, ctx.fp8, ctx.framework):
        return 1.0
    fp8 = 1.0 + fp8_recipes.RECIPES[ctx.fp8].scale_bytes
    return fp8 / DTYPE_BYTES[ctx.precision]


def _saved_bytes(saved: Saved, ctx: Context) -> float:
    divide = _split(saved.split, ctx)
    if saved.gathered_input and ctx.sequence_parallel and RUNTIMES[ctx.framework].timing.sp_keeps_gathered_input:
        divide = 1      # DTensor's ColwiseParallel keeps the all-gathered input for the weight gradient
    dtype = saved.dtype_bytes or (residual_bytes(ctx.eager_regime, ctx.precision) if saved.residual
                                  else DTYPE_BYTES[ctx.precision])
    return saved.elems * ctx.tokens * dtype / divide


def linear_s(op: Op, split: str, tp: int, tokens: float, cluster: Cluster, precision: str, *,
             at_once: int = 1, fp8: str = "", framework: str = "") -> tuple[float, float, float]:
    """(fwd_s, bwd_s, fwd matmul FLOPs) of a linear split ``split`` ("column", "row" or
    "replicate") over ``tp`` ranks, for ``tokens`` tokens; backward is dgrad + wgrad. Routed experts
    (``num_gemms`` of them) are ``grouped_gemms_s``, ``at_once`` of them at a time (``expert_gemms_at_once``).
    ``fp8``: the workload's FP8 recipe, which converts the linear where ``fp8_converts`` says so (``fp8_linear_s``)."""
    n = op.out_features / (tp if split == "column" else 1)
    k = op.in_features / (tp if split == "row" else 1)
    m = tokens * op.tokens_factor / op.num_gemms
    if fp8 and fp8_converts(op, fp8, framework):
        fwd, bwd = fp8_linear_s(op, op.num_gemms, m, n, k, cluster, fp8, framework, at_once)
    else:
        fwd, bwd = grouped_gemms_s(op.num_gemms, m, n, k, cluster, precision, at_once)
    return fwd, bwd, 2.0 * m * n * k * op.num_gemms


def grouped_gemms_s(count: float, m: float, n: float, k: float, cluster: Cluster, precision: str,
                    at_once: int, dtypes: tuple[str, str, str] | None = None) -> tuple[float, float]:
    """(forward, backward: dgrad + wgrad) of ``count`` equal products (m x k) @ (k x n): routed experts at balanced
    routing, ``at_once`` of them at a time (``expert_gemms_at_once``) whose tiles fill the same waves (``gemm_s``
    with a batch): ``count`` or more, one grouped GEMM (CUTLASS's grouped GEMM and torch._grouped_mm schedule every
    problem's tiles over the SMs together, NVIDIA CUTLASS docs 'Grouped GEMM'); s > 1, one GEMM per expert on s
    streams, whose kernels share the SMs s at a time (TransformerEngine's GroupedLinear); 1, one GEMM after another,
    each quantized on its own. ``dtypes``: the operands of the forward, dgrad and wgrad GEMMs where they differ
    from ``precision`` (an FP8 recipe's)."""
    memo, key = device_memo(cluster.device, "grouped_gemms_s"), (count, m, n, k, precision, at_once, dtypes)
    out = memo.get(key)
    if out is None:
        out = memo[key] = _grouped_gemms_s(count, m, n, k, cluster, precision, at_once, dtypes)
    return out


def _grouped_gemms_s(count: float, m: float, n: float, k: float, cluster: Cluster, precision: str,
                     at_once: int, dtypes: tuple[str, str, str] | None) -> tuple[float, float]:
    dev = cluster.device
    f, d, w = dtypes or (precision, precision, precision)

    def rounds(mm, nn, kk, dtype):
        whole = int(round(count))
        if whole <= 1 or at_once <= 1 or whole != count:
            return count * gemm_s(mm, nn, kk, dev, dtype)
        full, rest = divmod(whole, min(at_once, whole))
        return full * gemm_s(mm, nn, kk, dev, dtype, min(at_once, whole)) + (
            gemm_s(mm, nn, kk, dev, dtype, rest) if rest else 0.0)
    return rounds(m, n, k, f), rounds(m, k, n, d) + rounds(k, n, m, w)


def fp8_converts(op: Op, fp8: str, framework: str) -> bool:
    """Whether the runtime runs this linear under the FP8 recipe (``precision.converts_linear``)."""
    return op.kind == "linear" and fp8_recipes.converts_linear(op.name, op.out_features, op.in_features, fp8,
                                                               framework, routed=op.routed)


def fp8_linear_s(op: Op, count: float, m: float, n: float, k: float, cluster: Cluster, fp8: str, framework: str,
                 at_once: int) -> tuple[float, float]:
    """(forward, backward) of ``count`` products (m x k) @ (k x n) under an FP8 recipe (planner/precision.py): the
    GEMMs the recipe runs in FP8 at the device's FP8 (or MXFP8) rate with 1-byte operands (``gemm_s``), the others
    in bf16, plus the recipe's cast kernels at HBM speed (``memory_bound_s``), per operand: the input (m x k; cast
    once for linears that read the previous linear's input: ``Op.reads_previous_input``), the output gradient
    (m x n), and the weight (k x n) where the runtime casts it every micro-batch (torchao; TransformerEngine casts
    it once per step, not priced here), each operand's casts at least ``CAST_KERNEL_MIN_S`` per kernel, and where
    each expert is cast on its own (``at_once`` below ``count``), per expert, ``at_once`` kernels at a time; under
    TransformerEngine also the kernels it runs on each GEMM operand before the GEMM (``Recipe.te_operand_kernels``:
    MXFP8's scale swizzles)."""
    memo, key = device_memo(cluster.device, "fp8_linear_s"), (count, m, n, k, fp8, framework, at_once,
                                                                 op.reads_previous_input)
    out = memo.get(key)
    if out is None:
        out = memo[key] = _fp8_linear_s(op, count, m, n, k, cluster, fp8, framework, at_once)
    return out


def _fp8_linear_s(op: Op, count: float, m: float, n: float, k: float, cluster: Cluster, fp8: str, framework: str,
                  at_once: int) -> tuple[float, float]:
    recipe = fp8_recipes.RECIPES[fp8]
    dtypes = tuple(recipe.gemm_dtype if g in recipe.fp8_gemms else "bf16" for g in ("fwd", "dgrad", "wgrad"))
    fwd, bwd = grouped_gemms_s(count, m, n, k, cluster, "bf16", at_once, dtypes)
    # the cast kernels' floor: one launch per expert, at_once of them at a time (one for a grouped GEMM's inputs)
    serial = 1.0 if at_once >= count else math.ceil(count / max(1, at_once))
    roles, kernels = fp8_recipes.cast_roles(recipe, framework)
    sizes = {"input": 0.0 if op.reads_previous_input else m * k, "grad_output": m * n,
             "weight": 0.0 if fp8_recipes.weight_cast_per_step(framework) else k * n}
    dev = cluster.device
    out = []
    for i, gemms in enumerate((fwd, bwd)):
        casts = 0.0
        for role, elems in sizes.items():
            if not elems or not kernels[role][i]:
                continue
            total = roles[role][i] * elems * count
            if fp8_recipes.library(framework) == "te":      # TransformerEngine's fused CUDA kernels: HBM speed
                t = memory_bound_s(total, dev)
            else:                                           # inductor's kernels: by class
                amax = recipe.amax[role][i] * elems * count
                strided = recipe.amax_strided[role][i] * elems * count if recipe.amax_strided else 0.0
                t = (strided / dev.strided_reduce_bandwidth() + (amax - strided) / dev.eager_bandwidth("reduce")
                     + (total - amax) / dev.eager_bandwidth("cast_down"))
            launches = kernels[role][i] * serial
            casts += max(t, launches * fp8_recipes.CAST_KERNEL_MIN_S)
        if recipe.te_operand_kernels and fp8_recipes.library(framework) == "te":
            # the kernels TE runs on each operand of an FP8 GEMM before it (MXFP8's scale swizzles): forward
            # input x weight; backward output gradient x weight (dgrad) and input x output gradient (wgrad)
            pairs = [(m * k, k * n)] if i == 0 else [(m * n, k * n), (m * k, m * n)]
            for gemm, operands in zip(("fwd",) if i == 0 else ("dgrad", "wgrad"), pairs):
                if gemm in recipe.fp8_gemms:
                    for elems in operands:
                        casts += max(memory_bound_s(recipe.te_operand_bytes * elems * count, dev),
                                     recipe.te_operand_kernels * serial * fp8_recipes.CAST_KERNEL_MIN_S)
        out.append(gemms + casts)
    return out[0], out[1]


def expert_gemms_at_once(op: Op, ctx: Context, cluster: Cluster) -> int:
    """How many of ``op``'s GEMMs share the SMs' waves at a time: all of a rank's routed experts where the runtime
    runs them as one grouped GEMM (``Combinations.grouped_experts``), its ``expert_gemm_streams`` where it runs one
    GEMM per expert on that many streams, else 1."""
    if not op.routed:
        return 1
    rt = RUNTIMES.get(ctx.framework)
    if rt is None:
        return 1
    can = rt.on(cluster.device_kind)
    return max(1, int(op.num_gemms)) if can.grouped_experts else max(1, can.expert_gemm_streams)


def _linear(op: Op, ctx: Context, cluster: Cluster) -> tuple[float, float, float]:
    if op.routed and ctx.ep > 1:
        return expert_linear_s(op, ctx, cluster)
    return linear_s(op, op.tp, ctx.tp, ctx.tokens, cluster, ctx.precision,
                    at_once=expert_gemms_at_once(op, ctx, cluster), fp8=ctx.fp8, framework=ctx.framework)


def expert_linear_s(op: Op, ctx: Context, cluster: Cluster) -> tuple[float, float, float]:
    """(fwd_s, bwd_s, fwd matmul FLOPs) of a routed-expert linear under expert parallelism: the rank holds
    E / ep whole experts and receives, routing balanced (as the published MoE benchmarks force it), the
    top-k copies of its ep group's tokens that go to them: the tokens of the rank split along the sequence
    (T / tp: sequence parallelism, or no TP), times k, times ep / E per expert. Each expert is its own GEMM of
    that many rows, run as one grouped GEMM where the runtime groups them, else a few at a time (``grouped_gemms_s``,
    ``expert_gemms_at_once``): small experts are far from peak, which ``gemm_s``'s shape model prices."""
    local = op.num_gemms / ctx.ep
    m = ctx.tokens / ctx.tp * op.tokens_factor * ctx.ep / op.num_gemms * ctx.expert_imbalance
    n, k = op.out_features, op.in_features
    at_once = expert_gemms_at_once(op, ctx, cluster)
    if ctx.fp8 and fp8_converts(op, ctx.fp8, ctx.framework):
        fwd, bwd = fp8_linear_s(op, local, m, n, k, cluster, ctx.fp8, ctx.framework, at_once)
    else:
        fwd, bwd = grouped_gemms_s(local, m, n, k, cluster, ctx.precision, at_once)
    return fwd, bwd, 2.0 * m * n * k * local


def _expert_exchange_s(layer: Layer, ctx: Context, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of expert parallelism's token exchange in a MoE layer (backward moves the same
    volumes the other way), none of it overlapped (Megatron-Core's token dispatchers, megatron/core/transformer/moe/
    token_dispatcher.py, without --overlap-moe-expert-parallel-comm or --moe-shared-expert-overlap; torchtitan's
    expert_parallel.py). The ep ranks are adjacent in rank order (expert tensor parallelism 1: Megatron's expert
    rank order tp-ep-dp-pp). A rank holds T / tp of the tokens (sequence parallelism, or no TP).

    ``alltoall``: dispatch and combine, each rank sending the top-k copies of its tokens at hidden width, (ep - 1) / ep
    of them to other ranks (balanced routing; the busiest rank's share times Workload.expert_imbalance). Before them,
    in forward only, the ranks exchange how many tokens each sends to each expert (E int64 counts), which the
    uneven exchange needs (Megatron-Core's MoEAlltoAllTokenDispatcher.preprocess, torchtitan's and the executor's
    all_to_all_single of the counts): one more all-to-all, latency-bound.
    ``allgather`` (Megatron's MoEAllGatherTokenDispatcher): every rank all-gathers the ep group's tokens (once each,
    not k times) with their routing probabilities (fp32) and map (a byte) over the E experts, keeps those routed to its
    experts, and reduce-scatters the combined output back; in backward the mirror (a reduce-scatter of the tokens'
    and probabilities' gradients, an all-gather of the output's).
    ``flex`` (Megatron's MoEFlexTokenDispatcher on DeepEP's normal kernels): a token goes once to each GPU, and over
    the network once to each node, that holds any of its experts, not once per expert (``network.forwarded_exchange_s``),
    after the same exchange of counts."""
    first = next(op for op in layer.ops if op.routed)
    dt, h, k = DTYPE_BYTES[ctx.precision], first.in_features, first.tokens_factor
    tokens = ctx.tokens / ctx.tp
    grp = network.group(cluster, ctx.ep, 1)
    if ctx.expert_dispatcher == "allgather":
        gathered = ctx.ep * tokens * (h * dt + first.num_gemms * 5)       # tokens, fp32 probabilities, byte map
        combined = ctx.ep * tokens * h * dt
        one = network.all_gather_s(cluster, gathered, grp) + network.reduce_scatter_s(cluster, combined, grp)
        return one, one
    # the busiest rank receives (and, combining, sends back) its share times the imbalance: the all-to-all waits for it
    if ctx.expert_dispatcher == "flex":
        both = 2 * network.forwarded_exchange_s(cluster, h * dt * ctx.expert_imbalance, tokens, first.num_gemms,
                                                round(k), grp, first.route_groups)
    else:
        both = 2 * network.all_to_all_s(cluster, tokens * k * h * dt * ctx.expert_imbalance, grp)
    return both + network.all_to_all_s(cluster, first.num_gemms * 8, grp), both


def _attention(op: Op, ctx: Context, cluster: Cluster) -> tuple[float, float, float, float, float]:
    """(fwd_s, bwd_s, exposed cp comm fwd, bwd, score bytes kept by an unfused kernel)."""
    dev, prec, dt = cluster.device, ctx.precision, DTYPE_BYTES[ctx.precision]
    heads = op.heads / ctx.tp
    kv_heads = max(1.0, op.kv_heads / ctx.tp)
    q_len, kv_len, b = ctx.seq_len / ctx.cp, ctx.seq_len, ctx.micro_batch
    if ctx.attention == "flash":
        fwd, bwd = flash_attention_s(b, heads, q_len, kv_len, op.head_dim, dev, prec, causal=op.causal,
                                     window=op.window, fused=RUNTIMES[ctx.framework].attention_kernel == "fused",
                                     dropout=op.attn_dropout)
        kept = 4.0 * heads * ctx.tokens                       # fp32 log-sum-exp per head and query
    else:
        fwd, bwd = unfused_attention_s(b, heads, q_len, kv_len, op.head_dim, dev, prec, dropout=op.attn_dropout)
        # softmax output (2 bytes) and, with dropout, its mask (1) and output (2): Korthikanti's 5 a s^2 b
        kept = b * heads * q_len * kv_len * ((2 * dt + 1) if op.attn_dropout else dt)
    cp_fwd = cp_bwd = 0.0
    if ctx.cp > 1:
        block = b * q_len * 2 * kv_heads * op.head_dim * dt           # one rank's K and V
        if RUNTIMES[ctx.framework].timing.cp_exchange == "all-gather":
            cp_fwd, cp_bwd = _cp_all_gather(ctx, cluster, block)
            kept += block * (ctx.cp - 1)                              # the others' K and V, kept for backward
            return fwd, bwd, cp_fwd, cp_bwd, kept
        same_node = ctx.tp * ctx.cp <= cluster.gpus_per_node
        comm_fwd = (ctx.cp - 1) * network.p2p_s(cluster, block, same_node=same_node)
        comm_bwd = 2 * comm_fwd                                       # K, V again plus dK, dV
        cp_fwd = max(0.0, comm_fwd - fwd * (ctx.cp - 1) / ctx.cp)     # each step hides behind one block
        cp_bwd = max(0.0, comm_bwd - bwd * (ctx.cp - 1) / ctx.cp)
    return fwd, bwd, cp_fwd, cp_bwd, kept


def _cp_exposed_floor(op: Op, ctx: Context, cluster: Cluster) -> float:
    """A lower bound, linear in the tokens, on the exposed context-parallel exchange: the
    bandwidth terms of the all-gather exchange (it overlaps nothing); 0 for the ring."""
    if ctx.cp == 1 or RUNTIMES[ctx.framework].timing.cp_exchange != "all-gather":
        return 0.0
    kv_heads = max(1.0, op.kv_heads / ctx.tp)
    whole = ctx.micro_batch * ctx.seq_len * 2 * kv_heads * op.head_dim * DTYPE_BYTES[ctx.precision]
    return 2 * network.all_gather_bandwidth_s(cluster, whole, network.group(cluster, ctx.cp, ctx.tp))


def _cp_all_gather(ctx: Context, cluster: Cluster, block_bytes: float) -> tuple[float, float]:
    """(forward, backward) seconds of the all-gather exchange, none of it overlapped: K and V
    all-gathered over the cp ranks (spaced tp apart in the mesh), their gradients reduce-scattered."""
    grp = network.group(cluster, ctx.cp, ctx.tp)
    whole = block_bytes * ctx.cp                                      # every rank's K and V
    return network.all_gather_s(cluster, whole, grp), network.reduce_scatter_s(cluster, whole, grp)


def _tp_comm(layer: Layer, ctx: Context, cluster: Cluster, elems: float) -> tuple[float, float]:
    """One direction's TP collectives: all-reduces, or reduce-scatter + all-gather with SP; (all of
    them, the reduce-scatters' part) in seconds."""
    if ctx.tp == 1 or elems <= 0:
        return 0.0, 0.0
    grp = network.group(cluster, ctx.tp, 1)
    count = max(1, round(elems / layer.output_elems)) if layer.output_elems else 1
    nbytes = elems / count * ctx.tokens * DTYPE_BYTES[ctx.precision]
    if ctx.sequence_parallel:
        rs = network.reduce_scatter_s(cluster, nbytes, grp)
        return count * (rs + network.all_gather_s(cluster, nbytes, grp)), count * rs
    return count * network.all_reduce_s(cluster, nbytes, grp), 0.0


def _exposed(comm_s: float, overlap_with_s: float, ctx: Context) -> float:
    """TP communication left on the critical path.

    Without overlap all of it. With TransformerEngine-style userbuffers the
    collective is split into tp chunks pipelined with the GEMM that consumes or
    produces it (Wang et al. 2023, 'Overlap communication with dependent
    computation'): what exceeds the GEMM stays exposed, and at least one chunk.
    """
    if not ctx.tp_comm_overlap:
        return comm_s
    return max(comm_s - overlap_with_s, comm_s / ctx.tp)


def _eager_s(eager, params: float, ctx: Context, cluster: Cluster) -> tuple[float, float]:
    """(fwd, bwd) of a layer's elementwise kernels as torch runs them eagerly (planner.cost.eager),
    the per-micro-batch cast of its weight gradients to fp32 included."""
    sp = ctx.tp if ctx.sequence_parallel else 1
    fwd = {c: ctx.tokens * (fh / sp + ft / ctx.tp) for c, fh, ft, _, _ in eager.by_class}
    bwd = {c: ctx.tokens * (bh / sp + bt / ctx.tp) for c, _, _, bh, bt in eager.by_class}
    if ctx.eager_regime != "fp32":      # mixed precision: bf16 weight gradients cast to the fp32 .grad
        bwd["cast_up"] = bwd.get("cast_up", 0.0) + params * CAST_UP_BYTES
    dev = cluster.device
    return eager_s(fwd, eager.fwd_kernels, dev), eager_s(bwd, eager.bwd_kernels, dev)


def _sync_waits(layer: Layer, fwd_s: float, bwd_s: float, cluster: Cluster) -> tuple[float, float]:
    """(fwd, bwd) seconds the layer's TP (or CP) group waits at its blocking collectives for the rank that
    happens to be behind: after t seconds of work, c sqrt(t) each ([runtime] sync_wait_coefficient,
    measured by the profile; 0 on GPUs). A block's work is split by two collectives each way (attention
    and MLP; Shoeybi et al. 2019, Fig. 3), another layer's by one."""
    c = cluster.sync_wait_coefficient
    if not c:
        return 0.0, 0.0
    n = 2 if layer.kind == "block" else 1
    return n * c * math.sqrt(fwd_s / n), n * c * math.sqrt(bwd_s / n)


def layer_cost(layer: Layer, ctx: Context, cluster: Cluster) -> LayerCost:
    """Time, recompute and saved activations of one layer for one micro-batch on one rank."""
    dev, dt = cluster.device, DTYPE_BYTES[ctx.precision]
    fwd = bwd = flops = tp_gemm_fwd = tp_gemm_bwd = wgrad = 0.0
    core_fwd = cp_fwd = cp_bwd = kept = floor = 0.0
    gemm_rate = dev.peak(ctx.precision) * dev.gemm_efficiency
    if ctx.fp8:             # the floor holds at the fastest rate a GEMM of the layer runs at
        gemm_rate = max(gemm_rate, dev.gemm_peak(fp8_recipes.RECIPES[ctx.fp8].gemm_dtype) * dev.gemm_efficiency)
    saved = workspace = 0.0
    routed = sum(op.params for op in layer.ops if op.routed) if ctx.ep > 1 else 0.0
    expert_params = routed / ctx.ep
    params = layer.params_replicated + (layer.params - layer.params_replicated - routed) / ctx.tp + expert_params
    ft = modes.of(ctx.finetune, ctx.lora_rank, ctx.lora_targets, lora_style(ctx.framework))
    adapters = ft.adapters(layer.ops)
    keeps_input = _kept_linear_inputs(layer, ft)
    bwd_flops = 0.0
    dgrad_only = False          # some linear runs its input gradient alone (``matmul_flops_bwd``)
    compiled = ctx.compiled and layer.kind == "block"
    eager = dict(layer.eager).get(ctx.eager_regime) if ctx.eager_regime and not compiled else None
    sac = _SacOutputs()         # what operator-level selective checkpointing keeps (policy "op")
    discard_redo, discard_freed = _discarded(layer)
    discard = discard_fwd = discard_flops = 0.0     # what the output-discarding checkpoint frees and redoes
    fwd_by_op: list[tuple[float, float]] = []       # (forward seconds, matmul FLOPs) of each op, priced one by one
    eager_loss = RUNTIMES[ctx.framework].loss == "eager" if ctx.framework in RUNTIMES else True
    experts_part = _experts_part(layer) if ctx.ep_comm_overlap and routed else frozenset()
    fuses_swiglu = ctx.framework in RUNTIMES and RUNTIMES[ctx.framework].timing.fuses_swiglu and not compiled
    mlp_fwd = mlp_bwd = mlp_wgrad = 0.0     # of the experts' part (``_overlapped_exchange_s``)
    for i, op in enumerate(layer.ops):
        f = b = op_wgrad = 0.0
        if op.measured_fwd_s is not None:        # measured by `meshplan profile --ops`, per token, alone
            share = ctx.tokens / _op_divisor(op, ctx) / cluster.time_share     # processes sharing cores
            f = op.measured_fwd_s * share
            b = (op.measured_bwd_s if op.measured_bwd_s is not None else 2 * op.measured_fwd_s) * share
            if op.kind == "linear" and not ft.trains(op):    # frozen: the input gradient alone (half of it)
                b /= 2
                dgrad_only = True
            elif op.kind == "linear":                    # dgrad and wgrad: 2 m n k FLOPs each
                wgrad += b / 2
                op_wgrad = b / 2
            fwd, bwd, floor = fwd + f, bwd + b, floor + f + b
            fl = 2.0 * op.in_features * op.out_features * op.tokens_factor * ctx.tokens / _op_divisor(op, ctx)
            bwd_flops += (2 if ft.trains(op) or op.kind != "linear" else 1) * fl
        elif op.kind == "linear":
            f, b, fl = _linear(op, ctx, cluster)
            w = linear_wgrad_s(op, ctx, cluster)
            if ft.trains(op):
                wgrad += w
                op_wgrad = w
                floor += 3 * fl / gemm_rate              # gemm_s >= 2 m n k / rate: padding only adds
                bwd_flops += 2 * fl
            else:                                        # frozen: its input gradient (dgrad) alone
                b -= w
                dgrad_only = True
                floor += 2 * fl / gemm_rate
                bwd_flops += fl
                if ft.quantized(op.kind, op.name):      # QLoRA: the NF4 weight dequantized for each GEMM that
                    dq = nf4_dequantize_s(op, ctx, cluster)     # reads it (forward, input gradient); not in the
                    f, b = f + dq, b + dq                # floor: it does not grow with the tokens
                if i in adapters:
                    af, ab, aw, afl = lora_adapter_s(op, *adapters[i], ctx, cluster, ft.rank)
                    f, b, wgrad, fl = f + af, b + ab, wgrad + aw, fl + afl
                    floor += 3 * afl / gemm_rate
                    bwd_flops += 2 * afl
            fwd, bwd, flops = fwd + f, bwd + b, flops + fl
            if op.tp != "replicate" and not (op.routed and ctx.ep > 1):
                tp_gemm_fwd, tp_gemm_bwd = tp_gemm_fwd + f, tp_gemm_bwd + b
        elif op.kind == "attention":
            f, b, cf, cb, kept = _attention(op, ctx, cluster)
            fwd, bwd, core_fwd, cp_fwd, cp_bwd = fwd + f, bwd + b, f, cf, cb
            if ctx.attention == "flash":                 # linear in the micro-batch (unfused: bound 0)
                floor += f + b
            floor += _cp_exposed_floor(op, ctx, cluster)
        elif eager is not None:     # priced as a whole below
            pass
        else:   # elementwise and embedding: memory-bound; byte counts are given for 2-byte activations
            scale = ctx.tokens * dt / 2 / _split(op.split, ctx) * _routed_share(op, ctx)
            if compiled:    # inductor's fused kernels, at the rate the profile measured for their class
                kind = "norm" if op.norm else "stream"
                f, b = (eager_s({kind: op.bytes_fwd * scale}, 0, dev), eager_s({kind: op.bytes_bwd * scale}, 0, dev))
            else:
                f, b = memory_bound_s(op.bytes_fwd * scale, dev), memory_bound_s(op.bytes_bwd * scale, dev)
            if op.kind == "embedding" and not ft.trains(op):     # a frozen table: no backward (ids need none)
                b = 0.0
            fwd, bwd, floor = fwd + f, bwd + b, floor + f + b
        if i in experts_part:
            mlp_fwd, mlp_bwd, mlp_wgrad = mlp_fwd + f, mlp_bwd + b, mlp_wgrad + op_wgrad
        if op.kind == "linear":
            sac.linear(op, ctx, f, fl)
        elif op.kind == "attention":
            sac.attention(op, ctx, f)
        fwd_by_op.append((f if op.kind in ("linear", "attention") or eager is None or op.measured_fwd_s is not None
                          else 0.0, fl if op.kind == "linear" else 0.0))
        if op.name in discard_redo:                      # Megatron-Core's output-discarding checkpoint redoes it
            discard_fwd, discard_flops = discard_fwd + f, discard_flops + (fl if op.kind == "linear" else 0.0)
        if op.kind != "linear" or i in keeps_input:
            kept_by_op = op.saved if not compiled or op.compiled_saved is None or _gathered(op, ctx) \
                else op.compiled_saved
            if fuses_swiglu and op.fused_saved is not None:
                kept_by_op = op.fused_saved
            shares = [1.0] * len(kept_by_op)
            if op.saves_linear_input and kept_by_op:    # the next linear's input: kept as that linear keeps it
                shares[0] = _fp8_input_share(next(o for o in layer.ops[i + 1:] if o.kind == "linear"), ctx)
            kept_bytes = [_saved_bytes(s, ctx) * share * _routed_share(op, ctx) * _fp8_saved_share(op, ctx)
                          for s, share in zip(kept_by_op, shares)]
            saved += sum(kept_bytes)
            if op.name in discard_freed and kept_bytes:     # what it keeps of a discarded output: the attention
                discard += kept_bytes[0] if op.kind == "attention" else sum(kept_bytes)     # core's q, k and v
        if i in adapters:           # LoRA's B keeps its r-wide input, whole on every TP rank
            saved += ft.rank * op.tokens_factor * ctx.tokens * dt
        if op.unfused and op.unfused not in dev.fused_kernels and not compiled:
            saved += sum(_saved_bytes(s, ctx) for s in op.unfused_saved)
        transient = op.eager_workspace if op.eager_workspace is not None and eager_loss else op.workspace
        workspace = max(workspace, sum(_saved_bytes(s, ctx) for s in transient))
    frozen_params = frozen_bytes = 0.0
    frozen_ops = [op for op in layer.ops if op.params and not ft.trains(op)]
    if frozen_ops:              # stored, not trained (planner/finetune.py): the base under LoRA, a traced module's own
        if len(frozen_ops) == sum(1 for op in layer.ops if op.params):      # the whole layer: its share above
            frozen_params, params, expert_params = params, 0.0, 0.0
        else:
            frozen_params = sum(_rank_params(op, ctx) for op in frozen_ops)
            params -= frozen_params
            expert_params -= sum(_rank_params(op, ctx) for op in frozen_ops if op.routed and ctx.ep > 1)
        nf4 = [op for op in frozen_ops if ft.quantized(op.kind, op.name)]
        quantized = sum(_rank_params(op, ctx) for op in nf4)
        tensors = sum(op.num_gemms for op in nf4 if not op.fused_with_previous)       # one weight per GEMM
        frozen_bytes = ((frozen_params - quantized) * dt + quantized * modes.NF4_BYTES_PER_WEIGHT
                        + tensors * modes.NF4_TABLE_BYTES_PER_TENSOR)
    params += sum(modes.adapter_params(*adapters[i], ft.rank, layer.ops[i].tp, ctx.tp) for i in adapters)
    if eager is not None:
        f, b = _eager_s(eager, params, ctx, cluster)
        fwd, bwd, floor = fwd + f, bwd + b, floor + f + b
    elif compiled and ctx.eager_regime not in ("", "fp32"):
        # outside the compiled graph: autograd casts the bf16 weight gradients to the fp32 .grad, as eager
        b = eager_s({"cast_up": params * CAST_UP_BYTES}, 0, cluster.device)
        bwd, floor = bwd + b, floor + b
    by_experts = layer.tp_allreduce_expert_elems if routed else 0.0     # exchanged instead (``_expert_exchange_s``)
    tp_fwd_all, tp_fwd_rs = _tp_comm(layer, ctx, cluster, layer.tp_allreduce_fwd_elems - by_experts)
    tp_fwd = _exposed(tp_fwd_all, tp_gemm_fwd, ctx)
    tp_bwd = _exposed(_tp_comm(layer, ctx, cluster, layer.tp_allreduce_bwd_elems - by_experts)[0], tp_gemm_bwd, ctx)
    exchange_fwd, exchange_bwd = _expert_exchange_s(layer, ctx, cluster) if routed else (0.0, 0.0)
    wait_fwd, wait_bwd = _sync_waits(layer, fwd, bwd, cluster) if tp_fwd_all or cp_fwd else (0.0, 0.0)
    if experts_part and exchange_fwd + exchange_bwd > 0:
        others_fwd = fwd + tp_fwd + cp_fwd + wait_fwd - mlp_fwd
        others_bwd = bwd + tp_bwd + cp_bwd + wait_bwd - mlp_bwd
        exchange_fwd, exchange_bwd = _overlapped_exchange_s(exchange_fwd, exchange_bwd, others_fwd, others_bwd,
                                                            mlp_fwd, mlp_bwd, mlp_wgrad, cluster.comm_sm_fraction)
    if tp_fwd_all:
        tp_fwd, tp_bwd = tp_fwd + wait_fwd, tp_bwd + wait_bwd
        if layer.kind == "block" and priced_as(ctx.framework) == "torch":     # DTensor's host time (a CPU profile)
            tp_fwd, tp_bwd = tp_fwd + dev.tp_block_overhead_s[0], tp_bwd + dev.tp_block_overhead_s[1]
    fwd_total = fwd + tp_fwd + cp_fwd + exchange_fwd + (0.0 if tp_fwd_all else wait_fwd)
    bwd_total = bwd + tp_bwd + cp_bwd + exchange_bwd + (0.0 if tp_fwd_all else wait_bwd)
    # what each recompute policy keeps and redoes (planner/recompute.py), from what this layer is
    if layer.kind == "embedding":
        input_bytes = 8.0 * ctx.tokens                  # the int64 token ids
    else:       # the residual stream
        input_bytes = layer.output_elems * ctx.tokens * residual_bytes(ctx.eager_regime, ctx.precision) \
            / (ctx.tp if ctx.sequence_parallel else 1)
    # the reduce-scatters' share of the exposed forward TP time: their outputs are kept under "op"
    rs_share = tp_fwd * tp_fwd_rs / tp_fwd_all if tp_fwd_all else 0.0
    tail_s, tail_flops = _checkpoint_tail(layer, ctx, fwd_by_op, keeps_input)
    facts = BlockFacts(
        tail_fwd_s=tail_s, tail_flops=tail_flops,
        discard_bytes=discard, discard_fwd_s=discard_fwd, discard_flops=discard_flops,
        saved_bytes=saved + kept, attention_core_bytes=kept if ctx.attention == "unfused" else 0.0,
        attention_core_fwd_s=core_fwd + cp_fwd if ctx.attention == "unfused" and core_fwd else 0.0,
        input_bytes=input_bytes, fwd_s=fwd_total, bwd_s=bwd_total, matmul_flops_fwd=flops,
        workspace_bytes=workspace, op_kept_bytes=sac.kept_bytes, op_kept_s=sac.kept_s, op_redo_flops=sac.redo_flops,
        saved_comm_s=rs_share, host_copy_s=_host_copy_s(saved + kept, cluster),
        device_is_host=cluster.device_kind == "cpu")
    return LayerCost(
        fwd_s=fwd_total, bwd_s=bwd_total, by_policy={p.name: p.cost(facts) for p in POLICY_RECORDS},
        tp_comm_s=tp_fwd + tp_bwd, cp_comm_s=cp_fwd + cp_bwd + (0.0 if tp_fwd_all else wait_fwd + wait_bwd),
        params=params, matmul_flops_fwd=flops, expert_params=expert_params, ep_comm_s=exchange_fwd + exchange_bwd,
        routed_params=expert_params if ctx.ep > 1 else sum(
            _rank_params(op, ctx) for op in layer.ops if op.routed and op.params and ft.trains(op)),
        work_floor_s=floor, wgrad_s=wgrad, frozen_bytes=frozen_bytes, frozen_params=frozen_params,
        matmul_flops_bwd=bwd_flops if dgrad_only or not ft.full else None)


def _discarded(layer: Layer) -> tuple[frozenset[str], frozenset[str]]:
    """``recompute.discarded_ops`` of a block (nothing for other layers), once per layer object: the search prices a
    layer in thousands of contexts."""
    memo = device_memo(layer, "discarded_ops")
    if "ops" not in memo:
        memo["ops"] = discarded_ops(layer.ops) if layer.kind == "block" else (frozenset(), frozenset())
    return memo["ops"]


def _experts_part(layer: Layer) -> frozenset[int]:
    """The ops of a MoE block that Megatron-Core's overlapped schedule runs as its ``mlp`` part, between the
    dispatch and the combine: the routed experts' linears and what lies between them (their activation), and the
    shared experts."""
    routed = [i for i, op in enumerate(layer.ops) if op.routed]
    if not routed:
        return frozenset()
    return frozenset(range(routed[0], routed[-1] + 1)) | {i for i, op in enumerate(layer.ops) if "shared" in op.name}


def _overlapped_exchange_s(exchange_fwd: float, exchange_bwd: float, others_fwd: float, others_bwd: float,
                           mlp_fwd: float, mlp_bwd: float, mlp_wgrad: float, contention: float = 0.0
                           ) -> tuple[float, float]:
    """(forward, backward) seconds of a MoE layer's token exchange left exposed where Megatron-Core runs it beside
    another micro-batch's compute (--overlap-moe-expert-parallel-comm, with Megatron-Bridge's --delay-wgrad-compute):
    the forward of micro-batch i + 1 and the backward of micro-batch i go through each layer together, the
    all-to-alls on a communication stream, in three phases (megatron/core/models/common/model_chunk_schedule_plan.py
    ``TransformerLayerSchedulePlan.run`` at Megatron-LM 92c8482e):

        1. combine backward (i)                    beside attention forward (i + 1), through the router
        2. dispatch forward (i + 1), then          beside the experts' input-gradient backward (i), then their
           dispatch backward (i)                   deferred weight gradients (i) and their forward (i + 1)
        3. combine forward (i + 1)                 beside the router's and attention's backward (i)

    each phase as long as the longer of its two streams, and its compute slower by the SMs the all-to-all occupies
    while both run (``contention``: the profile's comm_sms share, as the data-parallel overlap's,
    planner/cost/step.py ``exposed_s``). Dispatch and combine move the same tokens; the counts' exchange opens the
    forward dispatch. What the phases take beyond the layer's compute of one forward and one backward is exposed,
    split between forward and backward as the exchanges are. Not modelled: the first forward and the last backward
    of a step, which have no partner and hide nothing, and the host's time of launching two micro-batches' kernels
    between the dispatch's reads of the token counts."""
    combine_fwd = combine_bwd = exchange_bwd / 2
    dispatch_fwd, dispatch_bwd = exchange_fwd - combine_fwd, exchange_bwd / 2

    def phase(comm: float, compute: float) -> float:
        return max(comm, compute) + contention * min(comm, compute)
    phases = (phase(combine_bwd, others_fwd)
              + phase(dispatch_fwd, mlp_bwd - mlp_wgrad) + phase(dispatch_bwd, mlp_wgrad + mlp_fwd)
              + phase(combine_fwd, others_bwd))
    exposed = max(0.0, phases - (others_fwd + others_bwd + mlp_fwd + mlp_bwd))
    share = exchange_fwd / (exchange_fwd + exchange_bwd)
    return exposed * share, exposed * (1 - share)


def _checkpoint_tail(layer: Layer, ctx: Context, fwd_by_op: list[tuple[float, float]],
                     keeps_input: frozenset[int]) -> tuple[float, float]:
    """(forward seconds, matmul FLOPs) of the ops a checkpoint that stops early does not redo
    (``Timing.checkpoint_early_stop``): those after the last op whose saved tensor backward needs. A linear saves
    its input, which the op before it made, so the rebuild ends there; any other op that saves (a norm's
    statistics, an activation's input, a dropout's mask, attention's outputs) is redone itself. Zero where the
    runtime re-runs the whole forward, and for the rest of the ops (only a block is checkpointed)."""
    if layer.kind != "block" or not (ctx.framework in RUNTIMES and RUNTIMES[ctx.framework].timing.checkpoint_early_stop):
        return 0.0, 0.0
    last = -1
    for i in range(len(layer.ops) - 1, -1, -1):
        op = layer.ops[i]
        if op.kind == "linear" and i in keeps_input:
            last = i - 1
            break
        if op.kind != "linear" and (op.saved or op.kind == "attention"):
            last = i
            break
    tail = fwd_by_op[last + 1:]
    return sum(f for f, _ in tail), sum(fl for _, fl in tail)


def _gathered(op: Op, ctx: Context) -> bool:
    """Whether ``op`` saves an input all-gathered by sequence parallelism: a collective's output, which the
    partitioner does not recompute."""
    return ctx.sequence_parallel and ctx.tp > 1 and any(s.gathered_input for s in op.saved)


def _kept_linear_inputs(layer: Layer, ft: modes.Adapters) -> frozenset[int]:
    """The linears (indices in ``layer.ops``) whose saved input (``Op.saved``) is kept: those whose input some
    weight gradient reads, a trained weight's (``Adapters.trains``: all of them under full training but a traced
    module's frozen ones) or a LoRA target's A: the linear itself or a linear after it reading the same input
    (``Op.reads_previous_input``: k and v after q). A frozen linear saves nothing for itself (planner/finetune.py)."""
    kept, owner = set(), None
    for i, op in enumerate(layer.ops):
        if op.kind != "linear":
            continue
        if not op.reads_previous_input:
            owner = i
        if ft.trains(op):
            kept.add(i)
        if (ft.trains(op) or ft.target(op.name)) and owner is not None:
            kept.add(owner)
    return frozenset(kept)


def _rank_params(op: Op, ctx: Context) -> float:
    """One op's parameters on one rank, as ``layer_cost`` counts a layer's: what tensor parallelism cannot split
    (``op_replicated_params``) whole, the rest over tp; routed experts over ep instead, under expert parallelism."""
    if op.routed and ctx.ep > 1:
        return op.params / ctx.ep
    whole = op_replicated_params(op)
    return whole + (op.params - whole) / ctx.tp


def lora_adapter_s(op: Op, in_features: float, out_features: float, ctx: Context, cluster: Cluster,
                   rank: int) -> tuple[float, float, float, float]:
    """(forward, backward, of which weight gradients, forward matmul FLOPs) of a LoRA adapter of ``in_features`` x
    ``out_features`` on linear ``op`` (``Adapters.adapters``: the linear's own, or its fused module's) for
    one micro-batch on one rank (Hu et al. 2021, Sec 4.1: h = x W + s (x A) B), as PEFT's lora.Linear runs it
    (peft/tuners/lora/layer.py ``Linear.forward``: ``result + lora_B(lora_A(dropout(x))) * scaling``; Megatron-Bridge's
    LoRALinear the same: ``linear_output + adapter_output``, the scaling on B's output). A is
    (in x r) and B (r x out), B's output split by a column-parallel base and A's input by a row-parallel one
    (planner/finetune.py). Two thin GEMMs each way (``gemm_s``, whose memory floor prices them): forward x A and
    (x A) B; input gradient dy B^T and (dy B^T) A^T; weight gradients x^T (dy B^T) and (x A)^T dy. Elementwise, at
    HBM speed: forward, the scaling (read and write the output) and the add into the base output (read two, write
    one), 5 passes over the output; backward, the scaling's gradient (2 passes over the output) and the sum of the
    input's two gradients, base and adapter (read two, write one over the input)."""
    dev, dt, p = cluster.device, DTYPE_BYTES[ctx.precision], ctx.precision
    m = ctx.tokens * op.tokens_factor
    a_in = in_features / (ctx.tp if op.tp == "row" else 1)
    b_out = out_features / (ctx.tp if op.tp == "column" else 1)
    fwd = gemm_s(m, rank, a_in, dev, p) + gemm_s(m, b_out, rank, dev, p) + memory_bound_s(5 * m * b_out * dt, dev)
    dgrad = gemm_s(m, rank, b_out, dev, p) + gemm_s(m, a_in, rank, dev, p) \
        + memory_bound_s((2 * b_out + 3 * a_in) * m * dt, dev)
    wgrad = gemm_s(a_in, rank, m, dev, p) + gemm_s(rank, b_out, m, dev, p)
    return fwd, dgrad + wgrad, wgrad, 2.0 * m * rank * (a_in + b_out)


def nf4_dequantize_s(op: Op, ctx: Context, cluster: Cluster) -> float:
    """One dequantization of a QLoRA base linear's NF4 weight (its TP shard) to the compute dtype: a memory-bound
    kernel reading the packed weight and writing the bf16 one (planner/finetune.py ``dequantize_bytes_per_weight``)."""
    weights = op.params / (ctx.tp if op.tp != "replicate" else 1)
    return memory_bound_s(weights * modes.dequantize_bytes_per_weight(DTYPE_BYTES[ctx.precision]), cluster.device)


def linear_wgrad_s(op: Op, ctx: Context, cluster: Cluster) -> float:
    """Of a linear's backward (dgrad + wgrad, ``grouped_gemms_s``), the weight-gradient GEMM alone: (k x m) @ (m x n)
    on the shapes ``linear_s`` and ``expert_linear_s`` use, in the dtype the FP8 recipe runs wgrad in. What a
    split-backward schedule defers as W (Qi et al., ICLR 2024, Sec 2.1: W is the weight gradient, B the input
    gradient, F the forward). FP8 cast kernels and TP collectives of the backward stay with the input gradient."""
    if op.routed and ctx.ep > 1:
        count = op.num_gemms / ctx.ep
        m = ctx.tokens / ctx.tp * op.tokens_factor * ctx.ep / op.num_gemms * ctx.expert_imbalance
        n, k = op.out_features, op.in_features
    else:
        count = op.num_gemms
        n = op.out_features / (ctx.tp if op.tp == "column" else 1)
        k = op.in_features / (ctx.tp if op.tp == "row" else 1)
        m = ctx.tokens * op.tokens_factor / op.num_gemms
    dtype = ctx.precision
    if ctx.fp8 and fp8_converts(op, ctx.fp8, ctx.framework):
        recipe = fp8_recipes.RECIPES[ctx.fp8]
        dtype = recipe.gemm_dtype if "wgrad" in recipe.fp8_gemms else "bf16"
    return grouped_gemms_s(count, k, n, m, cluster, dtype, expert_gemms_at_once(op, ctx, cluster))[0]


class _SacOutputs:
    """The outputs torchtitan's operator-level selective checkpointing keeps, op by op in forward order
    (torchtitan/distributed/activation_checkpoint.py, ``SelectiveAC``; the same rule as its
    earlier ``_apply_op_sac``): an op's output is saved (MUST_SAVE) when the op is in the save list, and
    every other op recomputed (PREFER_RECOMPUTE). The save list is torch's compute-intensive ops
    (torch._functorch.partitioners.get_default_op_list: aten.mm, addmm, bmm, the flash and efficient
    attention kernels) plus the other SDPA kernels and the reduce-scatter, except that of aten.mm (and
    aten.linear) only every other one is saved, counted per block and per forward: the 1st, 3rd, 5th...
    A biased linear runs as aten.addmm (aten/src/ATen/native/Linear.cpp: 2-D input, or 3-D contiguous
    input flattened) and is always saved; an unbiased one runs as aten.mm and falls under the rule."""

    def __init__(self):
        self.kept_bytes = 0.0           # outputs saved
        self.kept_s = 0.0               # forward seconds of the ops whose outputs are saved
        self.redo_flops = 0.0           # matmul FLOPs of the mms recomputed
        self.mm_count = 0

    def linear(self, op: Op, ctx: Context, fwd_s: float, flops: float) -> None:
        dt = DTYPE_BYTES[ctx.precision]
        if op.tp == "row" and ctx.sequence_parallel and ctx.tp > 1:
            # its reduce-scatter (a _c10d_functional.reduce_scatter_tensor under DTensor SP) is saved whether
            # or not the mm before it is
            self.kept_bytes += op.out_features * ctx.tokens * dt / ctx.tp
        addmm = op.params > op.num_gemms * op.in_features * op.out_features      # a bias
        if not addmm:
            self.mm_count += 1
            if self.mm_count % 2 == 0:                   # every second mm is recomputed
                self.redo_flops += flops
                return
        # a column-parallel output is split over tp; a row-parallel one is the full width of partial sums
        width = op.out_features * op.tokens_factor / (ctx.tp if op.tp == "column" else 1)
        self.kept_bytes += width * ctx.tokens * dt
        self.kept_s += fwd_s

    def attention(self, op: Op, ctx: Context, fwd_s: float) -> None:
        """The attention kernel's outputs: its output and, for flash kernels, the fp32 log-sum-exp per head
        and query; unfused attention (the math path) saves its two batched matmuls, the scores and the
        output."""
        heads = op.heads / ctx.tp
        out = heads * op.head_dim * ctx.tokens * DTYPE_BYTES[ctx.precision]
        if ctx.attention == "flash":
            extra = 4.0 * heads * ctx.tokens
        else:
            extra = ctx.micro_batch * heads * ctx.seq_len / ctx.cp * ctx.seq_len * DTYPE_BYTES[ctx.precision]
        self.kept_bytes += out + extra
        self.kept_s += fwd_s


def _host_copy_s(nbytes: float, cluster: Cluster) -> float:
    """One copy of a layer's saved bytes between the device and the host, as activation offload makes it.
    On a GPU: over its host link ([host] pcie_GBps of the cluster profile, per direction) or its share of a
    PCIe switch's uplink ([host] gpus_per_uplink; network.host_bytes_per_s), or its share of the node's host
    DRAM bandwidth where that is less: every GPU of the node offloads at once ([host] memory_GBps at its
    memory_efficiency, of the hosts the job's GPUs of the node use: ``Cluster.host_share``, over those GPUs). Not
    modelled: a PCIe link shared with the GPU's NIC traffic (GPUDirect RDMA). In a CPU process: the clone of the
    saved storages, read and written at the measured copy rate (hbm_GBps counts read + write bytes)."""
    if nbytes <= 0:
        return 0.0
    if cluster.device_kind == "cpu":
        return 2 * nbytes / (cluster.device.hbm_bytes_per_s * cluster.device.hbm_efficiency)
    per_node = cluster.gpus_on_a_node
    rate = min(network.fabric(cluster).host_bytes_per_s, cluster.job_host_dram_bytes_per_s / per_node)
    return nbytes / rate
