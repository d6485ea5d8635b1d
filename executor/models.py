"""meshplan's reference GPT and Llama: real torch modules for config models.

The module paths are exactly the op names of ``planner.layers.build_layer_graph``
(``embed.tokens``, ``layers.{i}.attn.q_proj``, ``layers.{i}.mlp.fc1``, ``norm``,
``lm_head``...), and the parameter count is exactly ``ModelSpec.num_params()``,
so the executor can apply a plan's per-module TP styles and stage boundaries by
name. Blocks live in an ``nn.ModuleDict`` keyed "0", "1", ... so a pipeline
stage that deletes the blocks it does not run keeps the others' paths
(torchtitan's ``models/llama3/model`` does the same).

GPT (Radford et al. 2019; Megatron GPT): learned positions, LayerNorm with bias,
biases on every linear, GELU MLP, LM head tied to the token embedding.
Llama (Touvron et al. 2023): RMSNorm, RoPE (Su et al. 2021), SwiGLU MLP, grouped-
query attention, no biases (q/k/v biases when ``qkv_bias``), untied head.
Mixtures of experts (Mixtral, DeepSeek, Qwen-MoE): the Llama block with routed and shared
experts in place of the MLP after the first ``dense_layers`` blocks (executor/moe.py).
DeepSeek-V2/V3: multi-head latent attention in place of the q/k/v projections (``LatentAttention``).

Attention heads are counted from the projected tensors' last dimension, so the
same code runs a tensor-parallel shard that holds heads / tp of them.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.nn.attention.bias import causal_lower_right

from planner.model import ModelSpec
from .lora import ADAPTER_LEAVES, adapter_init
from .moe import MoE
from .support import check_model

ROPE_THETA = 10000.0   # Su et al. 2021 (RoFormer), Sec 3.4.2; Llama 2 uses the same base
# the RMSNorms of multi-head latent attention's latents: DeepSeek-V3's inference/model.py and transformers'
# DeepseekV3Attention build them with RMSNorm's default eps, 1e-6 (the executor's block norms keep 1e-5)
LATENT_NORM_EPS = 1e-6
# Qwen3's q and k norms: its configs' rms_norm_eps, 1e-6 (Qwen/Qwen3-8B and Qwen3-30B-A3B config.json; transformers'
# Qwen3Config default)
QK_NORM_EPS = 1e-6


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "layernorm":
        return nn.LayerNorm(spec.hidden)
    return nn.RMSNorm(spec.hidden, eps=1e-5)


def _dropout(spec: ModelSpec) -> nn.Module:
    """Megatron GPT's 0.1 dropout where the spec trains with dropout; nothing otherwise."""
    return nn.Dropout(0.1) if spec.dropout else nn.Identity()


@dataclass(frozen=True)
class SequenceLayout:
    """Which tokens of each sequence this rank holds: all of them (cp 1), or under context
    parallelism chunks ``rank`` and ``2 cp - 1 - rank`` of 2 cp equal chunks (Dubey et al. 2024,
    Llama 3, Sec 3.3.2: every rank gets an early and a late chunk, the same causal work)."""

    cp: int = 1
    rank: int = 0

    def positions(self, local: int, device) -> torch.Tensor:
        """Global positions of this rank's ``local`` tokens, in the order it holds them. (local,)"""
        if self.cp == 1:
            return torch.arange(local, device=device)
        c = local // 2
        early, late = self.rank * c, (2 * self.cp - 1 - self.rank) * c
        return torch.cat([torch.arange(early, early + c, device=device), torch.arange(late, late + c, device=device)])

    def query_blocks(self, local: int) -> list[tuple[int, int, int]]:
        """(first, end) of each run of consecutive local queries and the global end of the keys it
        attends to (causally, up to its last query)."""
        if self.cp == 1:
            return [(0, local, local)]
        c = local // 2
        return [(0, c, (self.rank + 1) * c), (c, local, (2 * self.cp - self.rank) * c)]


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels by position-dependent angles. x: (B, S, nh, hd); positions: (S,)."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.to(torch.float32), inv_freq)                              # (S, hd/2)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]               # (1, S, 1, hd/2)
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]                                        # (B, S, nh, hd/2)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)                     # (B, S, nh, hd/2, 2)
    return out.flatten(-2).type_as(x)                                                         # (B, S, nh, hd)


class QKNorm(nn.Module):
    """Qwen3's RMSNorm of every head's query and key over the head dimension, before RoPE (transformers'
    ``Qwen3Attention``: ``q_norm`` and ``k_norm``, RMSNorm(head_dim, eps=rms_norm_eps), applied to the projections
    viewed as (B, S, heads, head_dim)). One module for the planner's one ``qk_norm`` op (planner/layers.py), its
    two norms ``q`` and ``k``; under tensor parallelism each rank norms its own heads with the shared weights, whose
    gradients executor/parallelize.py ``apply_tp`` sums over the heads' ranks."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.q = nn.RMSNorm(spec.head_dim, eps=QK_NORM_EPS)
        self.k = nn.RMSNorm(spec.head_dim, eps=QK_NORM_EPS)


class Attention(nn.Module):
    """Causal self-attention; the core is one ``scaled_dot_product_attention`` call per run of
    consecutive queries (one, or two under context parallelism, after ``exchange`` gathered the
    keys and values of the whole sequence: executor/context.py). Qwen3's per-head q and k norms
    (``QKNorm``) where the spec has them. Block ``index`` of a model with a sliding window shorter than the
    sequence (on the blocks ``ModelSpec.slides``), or with attention sinks (GPT-OSS), runs the written-out core
    ``masked_attention`` instead, given which keys each query sees."""

    def __init__(self, spec: ModelSpec, index: int = 0):
        super().__init__()
        h, q, kv = spec.hidden, spec.q_dim, spec.kv_dim
        bias = spec.linear_bias or spec.qkv_bias
        self.head_dim = spec.head_dim
        self.rope = spec.max_positions == 0
        self.dropout_p = 0.1 if spec.dropout else 0.0
        self.q_proj = nn.Linear(h, q, bias=bias)
        self.k_proj = nn.Linear(h, kv, bias=bias)
        self.v_proj = nn.Linear(h, kv, bias=bias)
        self.o_proj = nn.Linear(q, h, bias=spec.linear_bias)
        self.qk_norm = QKNorm(spec) if spec.qk_norm else None
        # this block's sliding window where it is shorter than the sequence (a longer one is full causal attention)
        self.window = spec.sliding_window if spec.slides(index) and spec.sliding_window < spec.seq_len else 0
        self.masked = bool(self.window) or spec.attention_sinks     # the core is given a mask (``masked_attention``)
        # a module attribute so selective recompute can wrap exactly this call; with sinks a module, which holds them
        self.core = SinkAttention(spec.num_heads) if spec.attention_sinks else \
            masked_attention if self.masked else sdpa
        self.layout = SequenceLayout()      # this rank's tokens (context parallelism)
        self.exchange = None                # (B, nkv, S/cp, hd) -> (B, nkv, S, hd) under context parallelism

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape                                          # (B, S, h); S local under CP
        q = self.q_proj(x).view(bsz, seq, -1, self.head_dim)           # (B, S, nh, hd); nh local under TP
        k = self.k_proj(x).view(bsz, seq, -1, self.head_dim)           # (B, S, nkv, hd)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim)           # (B, S, nkv, hd)
        if self.qk_norm is not None:
            q, k = self.qk_norm.q(q), self.qk_norm.k(k)                # each head over its hd channels
        if self.rope:
            positions = self.layout.positions(seq, x.device)
            q, k = rope(q, positions), rope(k, positions)
        return self.o_proj(attend(self, q, k, v))                      # (B, S, h)


def attend(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The causal core of ``attn`` (an ``Attention`` or a ``LatentAttention``: its ``core``, ``layout``,
    ``exchange`` and ``dropout_p``) on this rank's tokens, the heads concatenated for the output projection.
    q: (B, S, nh, hd), k: (B, S, nkv, hd), v: (B, S, nkv, hv) -> (B, S, nh hv); S local under CP."""
    bsz, seq = q.shape[:2]
    dropout_p = attn.dropout_p if attn.training else 0.0
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, n, S, hd)
    if attn.exchange is not None:
        k, v = attn.exchange(k), attn.exchange(v)                      # (B, nkv, S cp, hd), in sequence order
    blocks = attn.layout.query_blocks(seq)
    if getattr(attn, "masked", False):
        positions = attn.layout.positions(seq, q.device)               # (S,): the local queries' global positions
        y = torch.cat([attn.core(q[:, :, first:end], k[:, :, :keys], v[:, :, :keys], dropout_p,
                                 visible(positions[first:end], keys, attn.window))
                       for first, end, keys in blocks], dim=2)         # (B, nh, S, hv)
    else:
        y = torch.cat([attn.core(q[:, :, first:end], k[:, :, :keys], v[:, :, :keys], dropout_p)
                       for first, end, keys in blocks], dim=2)         # (B, nh, S, hv)
    return y.transpose(1, 2).reshape(bsz, seq, -1)                     # (B, S, nh hv)


def visible(positions: torch.Tensor, keys: int, window: int) -> torch.Tensor:
    """Which of keys 0 .. ``keys`` - 1 the queries at global ``positions`` see: the causal ones, and where there is
    a ``window`` only those within it (query i sees key j when i - window < j <= i: transformers' sliding-window
    mask). (L,) -> (L, keys) bool"""
    gap = positions[:, None] - torch.arange(keys, device=positions.device)[None, :]    # (L, keys): i - j
    return (gap >= 0) & (gap < window) if window else gap >= 0


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, allowed: torch.Tensor,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The attention core written out, as transformers' eager GPT-OSS attention: the scores scaled by 1/sqrt(hd),
    the keys a query does not see (``allowed`` False) masked out, a softmax that also spans one learned
    logit per head where given (``sinks``: attention sinks, OpenAI 2025, gpt-oss model card, arXiv:2508.10925,
    Sec 2.1: the sink takes a share of the probability and adds no value), dropout, then the values. The scores
    are materialised, and the planner prices this core so (planner/runtimes.py ``unfused_core``).
    q: (B, nh, L, hd), k: (B, nkv, S, hd), v: (B, nkv, S, hv), allowed: (L, S), sinks: (nh,) -> (B, nh, L, hv)"""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:                                                     # GQA: each key/value head serves a group
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5           # (B, nh, L, S)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, sink], dim=-1)                     # (B, nh, L, S + 1)
    # in the scores' dtype, given explicitly so that autocast does not run it in fp32: bf16 under autocast (the
    # kernel accumulates in fp32), so backward keeps one 2-byte copy of the probabilities, which the cost model
    # prices (an fp32 softmax would keep 4 bytes a score and its bf16 cast 2 more)
    probs = F.softmax(scores, dim=-1, dtype=scores.dtype)
    if sinks is not None:
        probs = probs[..., :-1]                                        # the sink's share, dropped
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return probs.to(v.dtype) @ v                                       # (B, nh, L, hv)


class SinkAttention(nn.Module):
    """``masked_attention`` with a learned sink logit per head (GPT-OSS): the planner's ``core`` op, which holds
    them (planner/layers.py). Under tensor parallelism the sinks are split with the heads (executor/parallelize.py
    ``apply_tp``: a DTensor sharded on dim 0, each rank its own heads')."""

    def __init__(self, heads: int):
        super().__init__()
        self.sinks = nn.Parameter(torch.empty(heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                allowed: torch.Tensor) -> torch.Tensor:
        sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks     # (nh,) local heads
        return masked_attention(q, k, v, dropout_p, allowed, sinks)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-AI 2024, DeepSeek-V2, arXiv:2405.04434, Sec 2.1, eqs. 9-19;
    DeepSeek-V3, arXiv:2412.19437, Sec 2.1.1; transformers' ``DeepseekV3Attention``), under the op names of
    planner/layers.py ``_mla_ops``. q through a rank-``q_lora_rank`` bottleneck (``q_down``, RMSNorm
    ``q_norm``, ``q_up``; one full-rank ``q_proj`` where the rank is 0); keys and values from one latent of
    rank ``kv_lora_rank`` (``kv_down``'s first channels, RMSNorm ``kv_norm``, ``kv_up`` to every head's no-RoPE
    key and value), beside a RoPE key of ``qk_rope_head_dim`` channels (``kv_down``'s last ones) shared by
    every head. Each head's q and k are [no-RoPE part, RoPE part] (``head_dim`` wide; RoPE on the second,
    as ``rope`` rotates Llama's, DeepSeek's interleaved pairs); the softmax scale is 1/sqrt(head_dim)
    (SDPA's default; DeepSeek-V3's YaRN mscale is not applied: no long-context scaling here); v is
    ``v_head_dim`` wide. No biases (DeepSeek's ``attention_bias`` false; the planner counts none).
    Causal; under context parallelism the expanded keys and values are gathered as ``Attention``'s are."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, heads, r_q, r_kv = spec.hidden, spec.num_heads, spec.q_lora_rank, spec.kv_lora_rank
        self.head_dim, self.rope_dim = spec.head_dim, spec.qk_rope_head_dim
        self.nope_dim, self.v_dim = spec.head_dim - spec.qk_rope_head_dim, spec.v_head_dim or spec.head_dim
        self.kv_rank, self.q_bottleneck = r_kv, r_q > 0
        self.dropout_p = 0.1 if spec.dropout else 0.0
        if r_q:
            self.q_down = nn.Linear(h, r_q, bias=False)
            self.q_norm = nn.RMSNorm(r_q, eps=LATENT_NORM_EPS)
            self.q_up = nn.Linear(r_q, heads * spec.head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * spec.head_dim, bias=False)
        self.kv_down = nn.Linear(h, r_kv + self.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(r_kv, eps=LATENT_NORM_EPS)
        self.kv_up = nn.Linear(r_kv, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=False)
        self.core = sdpa   # as Attention's: selective recompute wraps exactly this call
        self.layout = SequenceLayout()      # this rank's tokens (context parallelism)
        self.exchange = None                # (B, nh, S/cp, d) -> (B, nh, S, d) under context parallelism
        self.tp_mesh = None                 # where q_up/q_proj and kv_up split the heads (``shares_rope_key``)

    def shares_rope_key(self, tp_mesh) -> None:
        """Tensor parallelism splits the heads (q_up or q_proj and kv_up column parallel, o_proj row parallel,
        the down-projections and norms replicated: Megatron-Core's MLASelfAttention): each rank's heads use
        the one RoPE key, so its gradient there sums this rank's heads only; it is summed over ``tp_mesh``
        (Megatron's copy to the tensor-parallel region, Shoeybi et al. 2019, Sec 3: identity forward,
        all-reduce backward). The latent's and q's paths need nothing: the column-parallel linears they
        enter all-reduce their input's gradient."""
        self.tp_mesh = tp_mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape                                          # (B, S, h); S local under CP
        q = self.q_up(self.q_norm(self.q_down(x))) if self.q_bottleneck else self.q_proj(x)  # (B, S, nh hd)
        q_nope, q_pe = q.view(bsz, seq, -1, self.head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)   # (B, S, r_kv), (B, S, dr)
        if self.tp_mesh is not None:       # identity; the gradient all-reduced over the tp ranks
            k_pe = DTensor.from_local(k_pe, self.tp_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
        kv = self.kv_up(self.kv_norm(latent)).view(bsz, seq, -1, self.nope_dim + self.v_dim)   # (B, S, nh, dn + dv)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)     # (B, S, nh, dn), (B, S, nh, dv)
        positions = self.layout.positions(seq, x.device)
        q_pe, k_pe = rope(q_pe, positions), rope(k_pe.unsqueeze(2), positions)   # (B, S, nh, dr), (B, S, 1, dr)
        q = torch.cat([q_nope, q_pe], dim=-1)                         # (B, S, nh, hd)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)   # (B, S, nh, hd)
        return self.o_proj(attend(self, q, k, v))                      # (B, S, nh dv) -> (B, S, h)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The attention core: (B, nh, L, hd), (B, nkv, S, hd) x 2 -> (B, nh, L, hd), causal with the
    queries the last L of the S positions (``causal_lower_right``; L = S is the usual causal
    mask); key/value heads shared by groups (GQA)."""
    gqa = k.shape[1] != q.shape[1]
    if q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          dropout_p=dropout_p, enable_gqa=gqa)


class GeluMLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.fc1 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=spec.linear_bias)
        self.fc2 = nn.Linear(spec.ffn_hidden, spec.hidden, bias=spec.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))      # (B, S, h) -> (B, S, f) -> (B, S, h)


class SwiGLU(nn.Module):
    """Shazeer 2020, 'GLU Variants Improve Transformer', eq. 6."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden, spec.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(spec.hidden, spec.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(spec.ffn_hidden, spec.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))   # (B, S, h) -> (B, S, f) -> (B, S, h)


def _mlp(spec: ModelSpec, index: int) -> nn.Module:
    """Block ``index``'s MLP: routed experts where it is a MoE block (executor/moe.py), else dense."""
    if spec.is_moe_block(index):
        return MoE(spec)
    return GeluMLP(spec) if spec.mlp == "gelu" else SwiGLU(spec)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec, index: int = 0):
        super().__init__()
        self.attn_norm = _norm(spec)
        self.attn = LatentAttention(spec) if spec.is_mla else Attention(spec, index)
        self.mlp_norm = _norm(spec)
        self.mlp = _mlp(spec, index)
        self.dropout = _dropout(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x)))             # (B, S, h)
        return x + self.dropout(self.mlp(self.mlp_norm(x)))            # (B, S, h)


class Embedding(nn.Module):
    """Token embedding, plus learned positions for GPT."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tokens = nn.Embedding(spec.vocab_size, spec.hidden)
        self.positions = nn.Embedding(spec.max_positions, spec.hidden) if spec.max_positions else None
        self.dropout = _dropout(spec)
        self.layout = SequenceLayout()      # this rank's tokens (context parallelism)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)                                            # (B, S) -> (B, S, h)
        if self.positions is not None:
            x = x + self.positions(self.layout.positions(ids.shape[1], ids.device))   # + (S, h)
        return self.dropout(x)


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (the modules a stage does not run are None)."""

    def __init__(self, spec: ModelSpec, keep: tuple[str, ...] | None = None):
        """``keep``: the layer paths to build (a pipeline stage's: "embed", "layers.3", "norm",
        "lm_head"); None builds them all."""
        super().__init__()
        check_model(spec, source=f"model {spec.name}")

        def built(path: str) -> bool:
            return keep is None or path in keep

        self.spec = spec
        self.embed = Embedding(spec) if built("embed") else None
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.num_layers) if built(f"layers.{i}")})
        self.norm = _norm(spec) if built("norm") else None
        self.lm_head = nn.Linear(spec.hidden, spec.vocab_size, bias=False) if built("lm_head") else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the LM head's weight with the token embedding (GPT), where both are here."""
        if self.spec.tied_embeddings and self.embed is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed.tokens.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x              # (B, S) ids -> (B, S, h)
        for block in self.layers.values():
            h = block(h)                                                # (B, S, h)
        h = self.norm(h) if self.norm is not None else h
        return self.lm_head(h) if self.lm_head is not None else h       # (B, S, V) logits


def build_model(spec: ModelSpec, device: str | torch.device = "meta",
                keep: tuple[str, ...] | None = None) -> Transformer:
    """The reference model of ``spec`` (only the layers ``keep`` names, where given); on the meta
    device by default (no memory, no init)."""
    with torch.device(device):
        return Transformer(spec, keep)


def init_key(name: str, spec: ModelSpec) -> str:
    """The parameter a name stands for: a pipeline stage's copy of a tied head is the embedding."""
    return "embed.tokens.weight" if spec.tied_embeddings and name == "lm_head.weight" else name


def full_init(name: str, shape: torch.Size, spec: ModelSpec, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of a parameter, a function of its name and the seed only.

    GPT-2's scheme (Radford et al. 2019, Sec 2.3): normal(0, 0.02) weights, the
    residual projections scaled by 1/sqrt(2 L); zero biases, unit norm weights. LoRA adapters
    (executor/lora.py): theirs (``adapter_init``).
    """
    key = init_key(name, spec)
    leaf = key.rsplit(".", 1)[-1]
    if leaf in ADAPTER_LEAVES:
        return adapter_init(key, shape, seed)
    if leaf == "bias":
        return torch.zeros(shape)
    if key.endswith("norm.weight") or key == "norm.weight" or ".qk_norm." in key:
        return torch.ones(shape)
    digest = zlib.crc32(key.encode())          # stable across processes (hash() is not)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + digest)
    std = 0.02
    if key.endswith(("o_proj.weight", "fc2.weight", "down_proj.weight")):
        std /= math.sqrt(2 * spec.num_layers)
    return torch.randn(shape, generator=gen) * std


def canonical_name(name: str) -> str:
    """A parameter's path in the unwrapped model (DDP adds ``module.``, checkpoint wrappers their own)."""
    name = name.removeprefix("module.")
    return name.replace("_checkpoint_wrapped_module.", "")


@torch.no_grad()
def materialize(model: Transformer, *, seed: int, device: torch.device) -> None:
    """Allocate a meta-device (possibly sharded) model on ``device`` and initialise it.

    Each parameter's full value comes from ``full_init`` (a function of its name and the
    seed), and each rank keeps its own shard of it (``distribute_tensor`` with no source
    rank: no communication), so every plan starts from the same weights.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor
    model.to_empty(device=device)
    model.tie_weights()
    for module in model.modules():      # MoE's balancing bias and its counts (executor/moe.py): zero at the start
        if isinstance(module, MoE):
            for buffer in module.buffers(recurse=False):
                buffer.zero_()
    for name, param in model.named_parameters():
        full = full_init(canonical_name(name), param.shape, model.spec, seed).to(device)
        if isinstance(param, DTensor):
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)
