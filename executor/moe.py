"""Mixture-of-experts MLP blocks and expert parallelism (ep).

Module paths are the op names of ``planner.layers._mlp_ops``: ``layers.{i}.mlp.router`` (an h x E linear),
``layers.{i}.mlp.gate_proj / up_proj / down_proj`` (the E routed SwiGLU experts, each one parameter of
shape (E, out, in): nn.Linear's weights stacked), ``layers.{i}.mlp.shared.gate_proj / up_proj / down_proj``
(the shared experts, one dense SwiGLU of ``spec.shared_ffn``) and ``layers.{i}.mlp.shared.gate`` (h x 1).

Routing is the spec's (``route``): Mixtral's by default (Jiang et al. 2024, arXiv:2401.04088, Sec 2.1; Hugging
Face transformers' ``MixtralSparseMoeBlock``, also Qwen3-MoE's with ``norm_topk_prob``): softmax over the router
logits in fp32, the top-k experts, their weights renormalised to sum to one, and the block's output
``sum_k w_k expert_k(x) + shared(x)`` (the shared part times ``sigmoid(gate(x))`` with a shared-expert gate:
Qwen2-MoE, whose weights are not renormalised). DeepSeek-V3's (arXiv:2412.19437, Sec 2.1.2): sigmoid affinities,
the top-k within the best expert groups, renormalised and scaled, with its per-expert bias for auxiliary-loss-free
balancing, which chooses experts but weights none (``update_expert_bias``), which the executor applies to every
mixture of experts as torchtitan does (at DeepSeek-V3's rate where the spec has one, else ``LOAD_BALANCE_RATE``):
the cost model prices balanced routing, and without it a softmax router's choices drift to a few experts. Every token
reaches its k experts: no capacity factor, no token dropped.

Expert parallelism as torchtitan runs it (``torchtitan/models/common/token_dispatcher.py``,
``AllToAllTokenDispatcher``): the experts of each MoE block are split over the ``ep`` ranks (rank r holds
experts [r E/ep, (r+1) E/ep): their weights are DTensors sharded on dim 0 over the ``ep`` mesh); each rank
sorts its (token, expert) pairs by expert, exchanges the counts with one ``all_to_all_single``, sends each
token to the rank holding its expert with a second (uneven splits), runs its local experts, and sends the
outputs back with the reverse one. The exchanges are differentiable (``AllToAll``: the backward of an
all-to-all is the reverse all-to-all).
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from planner.model import GPT_OSS_SWIGLU_ALPHA, ModelSpec
from planner.trace.experts import grouped_experts


# torchtitan's MoE.Config.load_balance_coeff default (torchtitan/models/common/moe.py at b5bcd76c6, also set by its
# GPT-OSS, Qwen3 and DeepSeek-V3 flavours): the bias of auxiliary-loss-free balancing (Wang et al. 2024,
# arXiv:2408.15664) moves by this much a step for every MoE, softmax-scored ones included (Megatron-Core refuses the
# bias on softmax scores: a Megatron export of such a model has none, ModelSpec.router_bias_rate 0)
LOAD_BALANCE_RATE = 1e-3


def route(logits: torch.Tensor, k: int, *, scores: str = "softmax", renormalize: bool = True, groups: int = 0,
          groups_used: int = 0, scale: float = 1.0, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router (``ModelSpec.router_*``): Mixtral's by default (HF ``MixtralSparseMoeBlock.forward``: softmax in
    fp32, top-k, renormalised), Qwen2-MoE's without renormalising (its ``norm_topk_prob`` false), DeepSeek-V3's with
    sigmoid scores drawn from the best ``groups_used`` of ``groups`` expert groups (each scored by the sum of its
    best k / groups_used: Megatron-Core's group_limited_topk, transformers' DeepseekV3TopkRouter's top 2 at
    DeepSeek-V3's 8 of 4 groups), renormalised (a 1e-20 floor under the sum) and times ``scale``
    (routed_scaling_factor); ``bias`` (E,), its balancing bias, is added to the scores that choose the groups and
    the experts, not to the weights (DeepSeek-V3 Sec 2.1.2). logits: (T, E) -> (weights (T, k) in the logits'
    dtype, expert ids (T, k))."""
    if scores == "sigmoid":
        affinity = torch.sigmoid(logits.float())                          # (T, E)
    else:
        affinity = F.softmax(logits, dim=-1, dtype=torch.float32)         # (T, E)
    chosen_from = affinity if bias is None else affinity + bias
    if groups:
        tokens, experts = affinity.shape
        per_group = experts // groups
        best = chosen_from.view(tokens, groups, per_group).topk(k // groups_used, dim=-1).values.sum(dim=-1)  # (T, g)
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(groups_used, dim=-1).indices, True)
        chosen_from = chosen_from.masked_fill(~kept.repeat_interleave(per_group, dim=1), float("-inf"))
    weights, chosen = chosen_from.topk(k, dim=-1)                         # (T, k)
    if bias is not None:
        weights = affinity.gather(1, chosen)                              # the bias chooses, it does not weight
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if scores == "sigmoid" else 0.0))
    if scale != 1.0:
        weights = weights * scale
    return weights.to(logits.dtype), chosen


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))                # (R, h)
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _runs_grouped_mm(x: torch.Tensor) -> bool:
    """Where the experts run as one ``torch._grouped_mm``: bf16 on CUDA devices of compute capability
    9.0 and later (torchtitan's condition); the CPU and the others take the loop over experts."""
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes ``x`` in: autocast's where autocast is on for its device (it casts
    a linear's input and weight to that dtype), else ``x``'s own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def grouped_product(x: torch.Tensor, w: torch.Tensor, counts: list[int] | torch.Tensor, grouped: bool) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts[e]`` rows for expert e) times each expert's weight
    transposed, one grouped GEMM (``grouped``) or a loop. x: (R, in), w: (e, out, in) -> (R, out). ``counts``: a
    list, or for the grouped GEMM, whose group ends are a device tensor, the counts on the device (no copy to
    the host).

    The weight is cast to ``x``'s dtype once, as one tensor (autocast does not cover _grouped_mm, and
    casts a linear's weight so), and the loop takes the experts' weights from one ``unbind``: its
    backward stacks the experts' gradients into one tensor, where indexing the stacked weight per expert
    (``w[e]``) made each expert's backward allocate, zero and add a gradient of the whole stack (E of
    them a step: on an H200, 38 ms of fp32 adds and fills in a 32-expert model's 0.2 s step, round 2's
    moe-32e row, benchmarks/results/gpu_round2_runs.json)."""
    w = w.to(x.dtype)
    if grouped:
        offs = torch.as_tensor(counts, device=x.device).cumsum(0).to(torch.int32)  # (e,) end of each group
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    ws = w.unbind(0)
    return torch.cat([rows @ ws[e].T for e, rows in enumerate(x.split(counts))])


class GroupedLinear(nn.Module):
    """E linears of ``in_features`` -> ``out_features``, weight (E, out, in), and with ``bias`` a bias (E, out)
    (GPT-OSS's experts); under expert parallelism each a DTensor sharded on dim 0 over the ep ranks, this rank's
    experts its local rows."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features)) if bias else None

    def forward(self, x: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """x: (R, in), its rows grouped by local expert, ``counts[e]`` rows for expert e -> (R, out)."""
        w = _local(self.weight)                                           # (e, out, in): the local experts
        # in the dtype a linear would compute in: under autocast its dtype, whatever the residual stream's
        # (fp32 where the parameters are: without the cast the grouped GEMM never ran under autocast)
        x = x.to(compute_dtype(x))
        out = grouped_product(x, w, counts, _runs_grouped_mm(x))          # (R, out)
        if self.bias is None:
            return out
        # each row its expert's bias: repeated by the counts (on the device where they are: output_size reads
        # nothing back)
        repeats = torch.as_tensor(counts, device=x.device)
        return out + _local(self.bias).to(out.dtype).repeat_interleave(repeats, dim=0, output_size=x.shape[0])


class SharedExperts(nn.Module):
    """The shared experts as one dense SwiGLU of their total width (Shazeer 2020, eq. 6), with
    Qwen2-MoE's sigmoid gate where the spec has one."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f = spec.hidden, spec.shared_ffn
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)
        self.gate = nn.Linear(h, 1, bias=False) if spec.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (T, h)
        return y * torch.sigmoid(self.gate(x)) if self.gate is not None else y


class ClampedSwiGLU(torch.autograd.Function):
    """GPT-OSS's expert activation, (clamp(up, -L, L) + 1) * g * sigmoid(1.702 g) with g = clamp(gate, max=L), as one
    function that keeps only its two inputs for backward and recomputes the rest there (Megatron-Core's fused
    bias-activation does the same for its quick-GEGLU with a clamp), so that the executor keeps what the cost model
    prices for a SwiGLU; written out, autograd would keep six tensors of the experts' width. Its gradients are
    autograd's of the written-out form: the clamps pass the gradient where the input lies within their bounds,
    bounds included (torch's clamp backward)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.limit = limit
        g = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * g * torch.sigmoid(g * GPT_OSS_SWIGLU_ALPHA)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        limit = ctx.limit
        g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
        s = torch.sigmoid(g * GPT_OSS_SWIGLU_ALPHA)
        glu = g * s
        d_gate = grad * (u + 1) * (s + glu * GPT_OSS_SWIGLU_ALPHA * (1 - s)) * (gate <= limit)
        d_up = grad * glu * ((up >= -limit) & (up <= limit))
        return d_gate, d_up, None


class MoE(nn.Module):
    """Routed experts (top-k of E) beside the shared experts; token-dropless."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f, e = spec.hidden, spec.expert_ffn, spec.num_experts
        self.num_experts, self.top_k = e, spec.experts_per_token
        self.router = nn.Linear(h, e, bias=spec.linear_bias)
        self.gate_proj = GroupedLinear(e, h, f, bias=spec.linear_bias)
        self.up_proj = GroupedLinear(e, h, f, bias=spec.linear_bias)
        self.down_proj = GroupedLinear(e, f, h, bias=spec.linear_bias)
        self.limit = spec.swiglu_limit      # GPT-OSS's clamped SwiGLU where > 0
        self.routing = dict(scores=spec.router_scores, renormalize=spec.router_renormalize, groups=spec.router_groups,
                            groups_used=spec.router_groups_used, scale=spec.router_scale)     # ``route``'s
        # the balancing bias and the tokens each expert got since its last update: at the spec's rate (DeepSeek-V3's),
        # else at torchtitan's for every mixture of experts, softmax routers' too (``LOAD_BALANCE_RATE``)
        self.bias_rate = spec.router_bias_rate or LOAD_BALANCE_RATE
        self.register_buffer("expert_bias", torch.zeros(e))
        self.register_buffer("tokens_per_expert", torch.zeros(e), persistent=False)
        self.shared = SharedExperts(spec) if spec.shared_experts else None
        self.ep_group = None        # the ranks the experts are split over (``apply_ep``); None: all here
        self.ep = 1

    def experts(self, x: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """The local experts' SwiGLU on rows grouped by expert; GPT-OSS's clamped one where the spec has a limit
        (transformers' ``GptOssExperts``: the gate clamped above and the up projection both ways at the limit,
        (up + 1) * gate * sigmoid(1.702 gate)). (R, h) -> (R, h)"""
        gate, up = self.gate_proj(x, counts), self.up_proj(x, counts)    # (R, f) each
        if self.limit:
            return self.down_proj(ClampedSwiGLU.apply(gate, up, self.limit), counts)
        return self.down_proj(F.silu(gate) * up, counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape                                                   # (B, S, h)
        tokens = x.reshape(-1, shape[-1])                                 # (T, h)
        weights, chosen = route(self.router(tokens), self.top_k, **self.routing, bias=self.expert_bias)  # (T, k) x 2
        order = chosen.flatten().argsort(stable=True)                     # (T k,): pairs sorted by expert
        # rows per expert without a copy to the host (torch.bincount reads the largest index back on a GPU)
        flat = chosen.flatten()
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))                               # (E,)
        with torch.no_grad():   # a recomputed forward counts its layer's tokens twice: the update's signs stay
            self.tokens_per_expert += counts
        # in the experts' compute dtype from here (autocast's): what the dispatch sends, as torchtitan's does
        routed = tokens[order // self.top_k].to(compute_dtype(tokens))   # (T k, h)
        if self.ep_group is None:
            # the grouped GEMM takes the counts on the device: without expert parallelism nothing of the block
            # waits for the GPU (the loop splits rows on the host, so it reads them back once)
            out = self.experts(routed, counts if _runs_grouped_mm(routed) else counts.tolist())
        else:
            out = exchange(routed, counts, self.ep, self.ep_group, self.experts)
        out = out * weights.flatten()[order].unsqueeze(-1)                # (T k, h)
        # in the experts' dtype (bf16 under autocast, as a dense MLP's output is)
        y = out.new_zeros(tokens.shape).index_add(0, order // self.top_k, out)  # (T, h)
        if self.shared is not None:     # on (B, S, h): under TP its styles take the sequence as dim 1
            y = y + self.shared(x).reshape(y.shape)
        return y.view(shape)


def exchange(routed: torch.Tensor, counts: torch.Tensor, ep: int, group, experts) -> torch.Tensor:
    """Send each (token, expert) row to the rank holding its expert, run the local experts on what arrives, send
    the outputs back (torchtitan's dispatch and combine). routed: (N, h) sorted by expert; counts: (E,) rows per
    expert; ``experts(rows, counts)``: this rank's E / ep experts on rows grouped by local expert, ``counts[e]``
    rows for expert e (a list). -> (N, h)"""
    local = counts.numel() // ep
    with torch.no_grad():
        sent = counts.view(ep, local)                                     # (ep, e): rows to each rank's experts
        got = torch.empty_like(sent)                                      # (ep, e): rows from each rank
        dist.all_to_all_single(got, sent, group=group)
    in_splits, out_splits = sent.sum(1).tolist(), got.sum(1).tolist()
    arrived = AllToAll.apply(routed, out_splits, in_splits, group)       # (R, h), by source rank
    # rows arrive by source rank, then local expert; the experts take them grouped by expert
    expert_of = torch.arange(local, device=routed.device).repeat(ep).repeat_interleave(got.flatten())
    by_expert = expert_of.argsort(stable=True)                            # (R,)
    out = experts(arrived[by_expert], got.sum(0).tolist())                # (R, h)
    back = torch.empty_like(by_expert)
    back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    return AllToAll.apply(out[back], in_splits, out_splits, group)       # (N, h)


class _LocalExperts:
    """A transformers grouped-experts module as its own forward sees it on one rank under expert parallelism: its
    parameters this rank's experts (each DTensor's local rows, through which the gradients flow back), its
    ``num_experts`` their count, anything else the module's."""

    def __init__(self, module: nn.Module, count: int):
        self.__dict__.update({name: _local(p) for name, p in module.named_parameters(recurse=False)},
                             num_experts=count, _module=module)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_module"], name)


def _grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The forward of a transformers grouped-experts module (planner/trace/experts.py) under expert parallelism
    (``apply_ep``): its (token, expert) pairs sorted by expert and exchanged as meshplan's own blocks exchange them
    (``exchange``), each rank running the module's own forward (``_meshplan_forward``, whichever experts
    implementation its config chose) on the rows that arrive, every row routed to one local expert with weight one;
    the outputs, back on their tokens' ranks, weighted and summed per token. hidden_states: (T, h), top_k_index and
    top_k_weights: (T, k) -> (T, h)"""
    forward, ep, group = self._meshplan_forward, self._meshplan_ep, self._meshplan_ep_group
    k = top_k_index.shape[-1]
    flat = top_k_index.flatten()
    order = flat.argsort(stable=True)                                     # (T k,): pairs sorted by expert
    counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))                                   # (E,)
    routed = hidden_states[order // k]                                    # (T k, h)

    def local_experts(rows: torch.Tensor, local_counts: list[int]) -> torch.Tensor:
        ids = torch.arange(len(local_counts), device=rows.device).repeat_interleave(
            torch.tensor(local_counts, device=rows.device), output_size=rows.shape[0]).unsqueeze(-1)   # (R, 1)
        ones = torch.ones(ids.shape, dtype=top_k_weights.dtype, device=rows.device)
        return forward(_LocalExperts(self, len(local_counts)), rows, ids, ones)

    out = exchange(routed, counts, ep, group, local_experts)              # (T k, h)
    out = out * top_k_weights.flatten()[order].unsqueeze(-1).to(out.dtype)
    return out.new_zeros(hidden_states.shape).index_add(0, order // k, out).to(hidden_states.dtype)


def update_expert_bias(models, groups=()) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (arXiv:2412.19437, Sec 2.1.2), after each optimizer step: each
    MoE block's bias moves by its rate toward balance, up for the experts that got fewer tokens than the mean over
    the step and down for those that got more (torchtitan's and Megatron-Core's update, on the tokens of the global
    batch: the counts summed over ``groups``, whose ranks together hold the other tokens of the same layers, dp x cp
    x tp under tensor parallelism's sequence split, each an all-reduce of every block's counts stacked, as
    torchtitan's optimizer hook sums them); the counts start again."""
    blocks = [moe for model in models for moe in moe_blocks(model).values()]
    if not blocks:
        return
    counts = torch.stack([moe.tokens_per_expert for moe in blocks])       # (blocks, E)
    for group in groups:
        dist.all_reduce(counts, group=group)
    for moe, got in zip(blocks, counts):
        moe.expert_bias += moe.bias_rate * torch.sign(got.mean() - got)
        moe.tokens_per_expert.zero_()


@contextlib.contextmanager
def kept_counts(model: nn.Module):
    """The tokens each MoE block of ``model`` counted for its balancing bias, as they were before the block of code
    this wraps (a forward that is not training's)."""
    blocks = list(moe_blocks(model).values())
    saved = [moe.tokens_per_expert.clone() for moe in blocks]
    try:
        yield
    finally:
        for moe, counts in zip(blocks, saved):
            moe.tokens_per_expert.copy_(counts)


def moe_blocks(model: nn.Module) -> dict[str, MoE]:
    """{path: MoE module} of the MoE blocks ``model`` (or a stage of it) holds."""
    return {path: m for path, m in model.named_modules() if isinstance(m, MoE)}


def expert_modules(moe: MoE) -> list[nn.Module]:
    """The routed experts of one MoE block: its data-parallel unit under expert parallelism."""
    return [moe.gate_proj, moe.up_proj, moe.down_proj]


def expert_units(model: nn.Module) -> list[tuple[int, int, list[nn.Module]]]:
    """(routed experts, ep, the modules holding them) of each mixture-of-experts layer ``model`` (or a stage of it)
    holds: meshplan's own blocks' three grouped linears (``expert_modules``), a traced module's transformers
    grouped-experts module (planner/trace/experts.py). Their data-parallel unit under expert parallelism."""
    own = [(moe.num_experts, moe.ep, expert_modules(moe)) for moe in moe_blocks(model).values()]
    return own + [(m.num_experts, getattr(m, "_meshplan_ep", 1), [m]) for m in grouped_experts(model).values()]


def routed_expert_params(model: nn.Module) -> frozenset[int]:
    """ids of every routed experts' parameter ``model`` holds, split by expert parallelism or not: stacks of
    experts that data parallelism shards along ``executor.zero1.expert_dim``."""
    return frozenset(id(p) for _, _, units in expert_units(model) for unit in units for p in unit.parameters())


def expert_parallel_params(model: nn.Module) -> set[int]:
    """ids of the routed experts' weights that expert parallelism splits (``apply_ep``): their replicas
    are the efsdp ranks, not all the data-parallel ones."""
    return {id(p) for _, ep, units in expert_units(model) if ep > 1 for unit in units for p in unit.parameters()}


def apply_ep(model: nn.Module, ep_mesh) -> None:
    """Expert parallelism: each MoE layer's routed experts sharded on dim 0 over ``ep_mesh`` (DTensor
    ``Shard(0)``: rank r holds experts [r E/ep, (r+1) E/ep)), tokens exchanged with all-to-alls: meshplan's own
    blocks' (``MoE``), and a traced module's transformers grouped experts, whose forward becomes
    ``_grouped_experts_forward`` around their own."""
    for _, _, units in expert_units(model):
        for unit in units:
            for name, p in list(unit.named_parameters(recurse=False)):     # the weight, and a bias
                setattr(unit, name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None),
                                                 requires_grad=p.requires_grad))
    for moe in moe_blocks(model).values():
        moe.ep_group, moe.ep = ep_mesh.get_group(), ep_mesh.size()
    for experts in grouped_experts(model).values():
        experts._meshplan_forward = type(experts).forward
        experts._meshplan_ep, experts._meshplan_ep_group = ep_mesh.size(), ep_mesh.get_group()
        experts.forward = types.MethodType(_grouped_experts_forward, experts)
