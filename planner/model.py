"""What is trained: the architecture of a transformer language model.

``ModelSpec`` is a plain value read from the zoo below or from a Hugging Face
``config.json``. ``layers.build_layer_graph`` turns it into the layer graph the
cost model and the search consume; a traced ``nn.Module`` produces the same
layer graph type (see ``planner.trace``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from .errors import UserError, one_of


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, as its config states it."""

    name: str
    num_layers: int                 # transformer blocks
    hidden: int                     # model width h
    num_heads: int                  # query heads a
    num_kv_heads: int               # key/value heads g (grouped-query attention when g < a)
    head_dim: int                   # d; a * d is usually h
    ffn_hidden: int                 # MLP inner width f
    vocab_size: int                 # V (as trained: padded where the source pads)
    seq_len: int                    # default training sequence length
    max_positions: int              # rows of the learned position table (0 with RoPE)
    mlp: Literal["gelu", "swiglu"]  # GELU: two linears; SwiGLU: gate, up, down
    norm: Literal["layernorm", "rmsnorm"]
    linear_bias: bool               # biases on every linear (GPT-2 / Megatron GPT)
    qkv_bias: bool                  # biases on q, k, v only (Qwen2)
    tied_embeddings: bool           # LM head shares the input embedding matrix
    dropout: bool                   # dropout layers active in training (Megatron GPT: 0.1)
    num_experts: int = 0            # 0: dense MLP; else routed experts per MoE layer
    experts_per_token: int = 0      # top-k routing
    sliding_window: int = 0         # 0: full causal attention
    fused_qkv: bool = False         # q, k and v are one parameter tensor (GPT-2's c_attn, Megatron GPT's
                                    # query_key_value): one module for runtimes that work per module
    # -- mixtures of experts (Fedus et al. 2022; DeepSeek-AI 2024, DeepSeek-V3, arXiv:2412.19437, Sec 2.1.2)
    moe_ffn_hidden: int = 0         # one routed expert's inner width (0: ffn_hidden, as Mixtral)
    shared_experts: int = 0         # experts every token goes through (DeepSeek, Qwen2-MoE)
    shared_ffn_hidden: int = 0      # one shared expert's inner width (0: moe_ffn_hidden)
    shared_expert_gate: bool = False    # a sigmoid gate (an h x 1 linear) scales the shared experts' output (Qwen2-MoE)
    dense_layers: int = 0           # the first blocks have a dense MLP of ffn_hidden (first_k_dense_replace)
    router_scores: str = "softmax"  # "softmax" over the experts' logits (Mixtral, Qwen-MoE, GPT-OSS) or "sigmoid" of
                                    # each (DeepSeek-V3, Kimi K2: scoring_func)
    router_renormalize: bool = True     # the top-k weights renormalised to sum to one (norm_topk_prob; with softmax
                                        # that is a softmax over the top-k logits); off: kept as scored (Qwen2-MoE)
    router_groups: int = 0          # experts in this many groups, the top-k drawn from the best router_groups_used of
    router_groups_used: int = 0     # them (n_group, topk_group: DeepSeek-V3's node-limited routing); 0: no groups
    router_scale: float = 1.0       # the routed experts' weights times this (routed_scaling_factor)
    router_bias_rate: float = 0.0   # > 0: a per-expert bias added to the sigmoid scores that choose the experts (not
                                    # to their weights), moved by this much a step toward balance (DeepSeek-V3's
                                    # auxiliary-loss-free balancing, its bias update speed; 0: none)
    # -- multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, Sec 2.1): low-rank q and kv
    q_lora_rank: int = 0            # q's down-projection rank (0: a full-rank q projection)
    kv_lora_rank: int = 0           # the latent kv rank; > 0 makes attention MLA
    qk_rope_head_dim: int = 0       # of head_dim (q's and k's width per head), the part RoPE rotates
    v_head_dim: int = 0             # v's width per head (0: head_dim)
    # -- attention variants
    sliding_every: int = 0          # with sliding_window: blocks i with i % sliding_every == 0 slide, the
                                    # others attend fully (GPT-OSS alternates: 2); 0: every block slides
    attention_sinks: bool = False   # a learned logit per head in every softmax (GPT-OSS)
    swiglu_limit: float = 0.0       # > 0: GPT-OSS's clamped SwiGLU experts (gate clamped above, up both ways, at
                                    # this value; transformers' GptOssConfig.swiglu_limit); 0: silu(gate) x up
    qk_norm: bool = False           # RMSNorm of q and k per head (Qwen3)
    source: str = ""                # where these numbers come from

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def o_dim(self) -> int:
        """The attention's output width (the output projection's input): heads x v's head width."""
        return self.num_heads * (self.v_head_dim or self.head_dim)

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    @property
    def shared_ffn(self) -> int:
        """The shared experts' inner width, all of them together (one dense MLP of that width)."""
        return self.shared_experts * (self.shared_ffn_hidden or self.expert_ffn)

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` routes its tokens to experts (the first ``dense_layers`` do not)."""
        return self.is_moe and index >= self.dense_layers

    def slides(self, index: int) -> bool:
        """Whether block ``index`` attends through the sliding window."""
        return bool(self.sliding_window) and (not self.sliding_every or index % self.sliding_every == 0)

    def mlp_params(self, width: int) -> int:
        """One MLP (or expert) of inner width ``width``."""
        h = self.hidden
        if self.mlp == "gelu":
            return 2 * h * width + ((width + h) if self.linear_bias else 0)
        return 3 * h * width + ((2 * width + h) if self.linear_bias else 0)

    def attention_params(self) -> int:
        h, heads = self.hidden, self.num_heads
        if self.is_mla:
            rope = self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.q_dim) if self.q_lora_rank \
                else h * self.q_dim
            kv = h * (self.kv_lora_rank + rope) + self.kv_lora_rank \
                + self.kv_lora_rank * heads * (self.head_dim - rope + (self.v_head_dim or self.head_dim))
            return q + kv + self.o_dim * h
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.o_dim * h
        if self.linear_bias:
            attn += self.q_dim + 2 * self.kv_dim + h
        elif self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        if self.attention_sinks:
            attn += heads
        return attn

    def block_params(self, index: int = 0) -> int:
        """Parameters of transformer block ``index``."""
        h = self.hidden
        norm = (2 * h if self.norm == "layernorm" else h) * 2
        if not self.is_moe_block(index):
            return norm + self.attention_params() + self.mlp_params(self.ffn_hidden)
        router = h * self.num_experts + (self.num_experts if self.linear_bias else 0)
        shared = (self.mlp_params(self.shared_ffn) + (h if self.shared_expert_gate else 0)) if self.shared_experts else 0
        return norm + self.attention_params() + self.num_experts * self.mlp_params(self.expert_ffn) + router + shared

    def active_params(self) -> int:
        """Parameters a token goes through: the routed experts it is sent to, not all of them."""
        idle = (self.num_experts - self.experts_per_token) * self.mlp_params(self.expert_ffn) if self.is_moe else 0
        return self.num_params() - idle * (self.num_layers - min(self.dense_layers, self.num_layers))

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden + self.max_positions * self.hidden

    def final_norm_params(self) -> int:
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def head_params(self) -> int:
        """Parameters the LM head owns (0 when tied to the embedding)."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden

    def num_params(self) -> int:
        dense = min(self.dense_layers, self.num_layers) if self.is_moe else self.num_layers
        return (self.embedding_params() + dense * self.block_params(0)
                + (self.num_layers - dense) * self.block_params(self.num_layers - 1)
                + self.final_norm_params() + self.head_params())

    def validate(self, source: str) -> "ModelSpec":
        """Check the shape is one a transformer can have; raise UserError naming the field."""
        for field in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                      "ffn_hidden", "vocab_size", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"must be a positive integer, got {value!r}", source=source, field=field)
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"{self.num_heads} query heads are not a multiple of "
                            f"{self.num_kv_heads} key/value heads", source=source, field="num_kv_heads")
        if self.is_moe and not 0 < self.experts_per_token <= self.num_experts:
            raise UserError(f"experts per token must be 1..{self.num_experts}, got {self.experts_per_token}",
                            source=source, field="experts_per_token")
        for field in ("moe_ffn_hidden", "shared_experts", "shared_ffn_hidden", "dense_layers", "q_lora_rank",
                      "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "sliding_every", "sliding_window"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UserError(f"must be a non-negative integer, got {value!r}", source=source, field=field)
        self._validate_router(source)
        if not self.is_moe:
            for field in ("moe_ffn_hidden", "shared_experts", "shared_ffn_hidden", "dense_layers"):
                if getattr(self, field):
                    raise UserError(f"{getattr(self, field)} without routed experts (num_experts is 0)",
                                    source=source, field=field)
        if self.dense_layers > self.num_layers:
            raise UserError(f"{self.dense_layers} dense blocks of {self.num_layers}", source=source,
                            field="dense_layers")
        if self.is_mla and not 0 < self.qk_rope_head_dim < self.head_dim:
            raise UserError(f"multi-head latent attention rotates 1..{self.head_dim - 1} of each head's "
                            f"{self.head_dim} q/k dimensions, got {self.qk_rope_head_dim}", source=source,
                            field="qk_rope_head_dim")
        if not self.is_mla and (self.q_lora_rank or self.qk_rope_head_dim):
            raise UserError("a low-rank q or a RoPE part of the head needs multi-head latent attention "
                            "(kv_lora_rank > 0)", source=source, field="kv_lora_rank")
        if self.sliding_every and not self.sliding_window:
            raise UserError(f"{self.sliding_every} without a sliding window", source=source, field="sliding_every")
        if not _real(self.swiglu_limit) or not self.swiglu_limit >= 0:
            raise UserError(f"must be a number >= 0, got {self.swiglu_limit!r}", source=source, field="swiglu_limit")
        if self.swiglu_limit and (self.mlp != "swiglu" or not self.is_moe or self.dense_layers or self.shared_experts):
            raise UserError(f"{self.swiglu_limit} clamps GPT-OSS's SwiGLU experts: routed SwiGLU experts only (no dense "
                            "blocks, no shared experts)", source=source, field="swiglu_limit")
        return self

    def _validate_router(self, source: str) -> None:
        if self.router_scores not in ROUTER_SCORES:
            raise UserError(f"unknown value {self.router_scores!r}; allowed: {one_of(ROUTER_SCORES)}", source=source,
                            field="router_scores")
        if not _real(self.router_scale) or not self.router_scale > 0:
            raise UserError(f"must be a number > 0, got {self.router_scale!r}", source=source, field="router_scale")
        rate = self.router_bias_rate
        if not _real(rate) or not rate >= 0:
            raise UserError(f"must be a number >= 0, got {rate!r}", source=source, field="router_bias_rate")
        if rate and self.router_scores != "sigmoid":
            raise UserError(f"{rate}: the balancing bias is added to sigmoid scores (DeepSeek-V3's router); this "
                            "router's are softmax", source=source, field="router_bias_rate")
        for field in ("router_groups", "router_groups_used"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UserError(f"must be a non-negative integer, got {value!r}", source=source, field=field)
        groups, used = self.router_groups, self.router_groups_used
        if not self.is_moe:         # no router: its fields say nothing (a dense variant of a MoE spec keeps them)
            return
        if not groups:
            if used:
                raise UserError(f"{used} groups used without expert groups (router_groups is 0)", source=source,
                                field="router_groups_used")
            return
        if self.num_experts % groups:
            raise UserError(f"{groups} groups do not divide the {self.num_experts} routed experts", source=source,
                            field="router_groups")
        if not 0 < used <= groups or self.experts_per_token % used \
                or self.experts_per_token // used > self.num_experts // groups:
            raise UserError(f"{used} of {groups} groups cannot give the top {self.experts_per_token} (each group its "
                            f"top {self.experts_per_token} / {used}, as Megatron-Core's group-limited routing scores "
                            "them)", source=source, field="router_groups_used")


ROUTER_SCORES = ("softmax", "sigmoid")


def _gpt(name: str, layers: int, hidden: int, heads: int, *, seq: int = 2048, vocab: int = 51200,
         source: str) -> ModelSpec:
    """A Megatron GPT: GELU MLP of 4h, learned positions, LayerNorm, biases, tied embeddings."""
    return ModelSpec(name=name, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=heads,
                     head_dim=hidden // heads, ffn_hidden=4 * hidden, vocab_size=vocab, seq_len=seq,
                     max_positions=seq, mlp="gelu", norm="layernorm", linear_bias=True, qkv_bias=False,
                     tied_embeddings=True, dropout=True, fused_qkv=True, source=source)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           seq: int, *, source: str, experts: int = 0, top_k: int = 0) -> ModelSpec:
    """A Llama-family model: SwiGLU, RoPE, RMSNorm, no biases, untied embeddings."""
    return ModelSpec(name=name, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=hidden // heads, ffn_hidden=ffn, vocab_size=vocab, seq_len=seq,
                     max_positions=0, mlp="swiglu", norm="rmsnorm", linear_bias=False, qkv_bias=False,
                     tied_embeddings=False, dropout=False, num_experts=experts, experts_per_token=top_k,
                     source=source)


_NAR21 = "Narayanan et al., SC'21 (arXiv:2104.04473), Table 1; seq 2048, vocab 51200"
_GPT3 = "Brown et al. 2020 (arXiv:2005.14165), Table 2.1 (GPT-3 175B); Narayanan et al. SC'21, Sec 5.2"
_L2 = "Touvron et al. 2023 (arXiv:2307.09288) / Hugging Face meta-llama/Llama-2-*-hf config.json"
_L3 = "Llama Team 2024, 'The Llama 3 Herd of Models' (arXiv:2407.21783), Table 3 / HF config.json"
_MIX = "Jiang et al. 2024 (arXiv:2401.04088) / HF mistralai/Mixtral-8x7B-v0.1 config.json"
_MIX22 = ("Mistral AI, Mixtral 8x22B (April 2024): HF mistralai/Mixtral-8x22B-v0.1 config.json (hidden 6144, 56 layers, "
          "48/8 heads, experts of 16384, 8 experts, top 2, vocabulary 32000); 141B parameters, 39B active; "
          "sequence 4096 assumed")
_DSV3 = ("DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv:2412.19437), Sec 4.2: 61 layers, hidden 7168, 128 "
         "heads of 128 + 64 (RoPE), v 128, q rank 1536, kv rank 512, 1 shared + 256 routed experts of 2048, top 8, "
         "the first 3 layers dense (18432), sequence 4096; 671B parameters, 37B active; Sec 2.1.2: sigmoid affinities, "
         "the top 8 of the best 4 of 8 groups (node-limited), renormalised; transformers 5.23 DeepseekV3Config (n_group "
         "8, topk_group 4, routed_scaling_factor 2.5, norm_topk_prob); the multi-token-prediction module left out")
_K2 = ("Kimi Team 2025, Kimi K2 (arXiv:2507.20534), Sec 2.3 and Table 2: DeepSeek-V3's architecture with 64 heads, "
       "384 experts (top 8, 1 shared), 1 dense layer, vocabulary 163840; 1.04T parameters, 32B active; HF "
       "moonshotai/Kimi-K2-Base config.json (sigmoid scores, n_group 1: no groups, routed_scaling_factor 2.827, "
       "norm_topk_prob); sequence 4096")
_Q3 = ("Qwen Team 2025, Qwen3 Technical Report (arXiv:2505.09388), Table 2 (layers, heads, 128 experts, top 8) / HF "
       "Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B config.json (hidden, head_dim 128, moe_intermediate_size, QK norm, "
       "norm_topk_prob true); "
       "sequence 4096 (its first pre-training stages)")
_Q3D = ("Qwen Team 2025, Qwen3 Technical Report (arXiv:2505.09388), Table 1 (36 and 64 layers, 32/8 and 64/8 "
        "heads, untied embeddings) / HF Qwen/Qwen3-8B and Qwen/Qwen3-32B config.json (hidden 4096 and 5120, "
        "intermediate 12288 and 25600, head_dim 128, QK norm); 8.2B and 32.8B parameters as their model cards give; "
        "sequence 4096 (its first pre-training stage)")
_OSS = ("OpenAI 2025, gpt-oss-120b & gpt-oss-20b Model Card (arXiv:2508.10925), Sec 2.1 and Table 1: hidden 2880, "
        "64 query / 8 key-value heads of 64, experts of 2880 (top 4), banded window of 128 tokens on every other "
        "layer, a learned sink per head, biases; 36 layers and 128 experts (116.8B, 5.1B active) or 24 and 32 "
        "(20.9B, 3.6B active); HF openai/gpt-oss-* config.json; sequence 4096 assumed")

# GPT-OSS's experts clamp their gate and up projections at 7 and scale the gate's sigmoid by 1.702 (OpenAI 2025,
# gpt-oss model card, arXiv:2508.10925, Sec 2.1; transformers' GptOssConfig swiglu_limit and swiglu_alpha defaults)
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_SWIGLU_ALPHA = 1.702

# DeepSeek-V3's bias update speed (arXiv:2412.19437, Sec 4.2: gamma 0.001 for its first 14.3T tokens); configs with
# its router (topk_method noaux_tc, transformers' e_score_correction_bias) do not carry it: models read so take it
DEEPSEEK_V3_BIAS_RATE = 0.001

ZOO: dict[str, ModelSpec] = {m.name: m for m in (
    _gpt("gpt-1.7b", 24, 2304, 24, source=_NAR21),
    _gpt("gpt-3.6b", 30, 3072, 32, source=_NAR21),
    _gpt("gpt-7.5b", 36, 4096, 32, source=_NAR21),
    _gpt("gpt-18.4b", 40, 6144, 48, source=_NAR21),
    _gpt("gpt-39.1b", 48, 8192, 64, source=_NAR21),
    _gpt("gpt-76.1b", 60, 10240, 80, source=_NAR21),
    _gpt("gpt-145.6b", 80, 12288, 96, source=_NAR21),
    _gpt("gpt-310.1b", 96, 16384, 128, source=_NAR21),
    _gpt("gpt-529.6b", 105, 20480, 128, source=_NAR21),
    _gpt("gpt-1t", 128, 25600, 160, source=_NAR21),
    _gpt("gpt3-175b", 96, 12288, 96, source=_GPT3),
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, source=_L2),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, source=_L2),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, source=_L2),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, source=_L3),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, source=_L3),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, source=_L3),
    _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096, source=_MIX, experts=8, top_k=2),
    _llama("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32000, 4096, source=_MIX22, experts=8, top_k=2),
    replace(_llama("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, 4096, source=_DSV3, experts=256, top_k=8),
            head_dim=192, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536, kv_lora_rank=512,
            moe_ffn_hidden=2048, shared_experts=1, dense_layers=3, router_scores="sigmoid", router_groups=8,
            router_groups_used=4, router_scale=2.5, router_bias_rate=DEEPSEEK_V3_BIAS_RATE),
    replace(_llama("kimi-k2", 61, 7168, 64, 64, 18432, 163840, 4096, source=_K2, experts=384, top_k=8),
            head_dim=192, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536, kv_lora_rank=512,
            moe_ffn_hidden=2048, shared_experts=1, dense_layers=1, router_scores="sigmoid", router_scale=2.827,
            router_bias_rate=DEEPSEEK_V3_BIAS_RATE),
    replace(_llama("qwen3-8b", 36, 4096, 32, 8, 12288, 151936, 4096, source=_Q3D), head_dim=128, qk_norm=True),
    replace(_llama("qwen3-32b", 64, 5120, 64, 8, 25600, 151936, 4096, source=_Q3D), head_dim=128, qk_norm=True),
    replace(_llama("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, 4096, source=_Q3, experts=128, top_k=8),
            head_dim=128, moe_ffn_hidden=768, qk_norm=True),
    replace(_llama("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 151936, 4096, source=_Q3, experts=128, top_k=8),
            head_dim=128, moe_ffn_hidden=1536, qk_norm=True),
    replace(_llama("gpt-oss-20b", 24, 2880, 64, 8, 2880, 201088, 4096, source=_OSS, experts=32, top_k=4),
            head_dim=64, linear_bias=True, attention_sinks=True, sliding_window=128, sliding_every=2,
            swiglu_limit=GPT_OSS_SWIGLU_LIMIT),
    replace(_llama("gpt-oss-120b", 36, 2880, 64, 8, 2880, 201088, 4096, source=_OSS, experts=128, top_k=4),
            head_dim=64, linear_bias=True, attention_sinks=True, sliding_window=128, sliding_every=2,
            swiglu_limit=GPT_OSS_SWIGLU_LIMIT),
)}

# Other names people use for the same models. Narayanan's Table 1 has no 175B
# row (its GPT-3-sized row is 145.6B); GPT-3 175B is the model of its Sec 5.2.
ALIASES = {"gpt-175b": "gpt3-175b", "gpt-1008b": "gpt-1t", "gpt3": "gpt3-175b"}

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
                         "deepseek_v3", "gpt_oss")

# What transformers assumes for each field a config.json leaves out: the defaults of its config classes
# (GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig,
# DeepseekV3Config, GptOssConfig of transformers 5.23; checked against
# the installed transformers by tests/test_model.py). Only the fields meshplan reads.
HF_DEFAULTS = {
    "gpt2": {"n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "n_inner": None, "vocab_size": 50257,
             "resid_pdrop": 0.1, "attn_pdrop": 0.1, "embd_pdrop": 0.1, "tie_word_embeddings": True},
    "llama": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": None,
              "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 2048, "head_dim": None,
              "attention_bias": False, "tie_word_embeddings": False},
    "mistral": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 131072, "head_dim": None,
                "sliding_window": 4096, "tie_word_embeddings": False},
    "qwen2": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
              "intermediate_size": 22016, "vocab_size": 151936, "max_position_embeddings": 32768,
              "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False},
    "qwen3": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
              "intermediate_size": 22016, "vocab_size": 151936, "max_position_embeddings": 32768, "head_dim": 128,
              "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
              "attention_bias": False},
    "mixtral": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 131072, "head_dim": None,
                "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2,
                "tie_word_embeddings": False},
    "qwen2_moe": {"hidden_size": 2048, "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16,
                  "intermediate_size": 5632, "vocab_size": 151936, "max_position_embeddings": 32768,
                  "sliding_window": 0, "use_sliding_window": False, "tie_word_embeddings": False, "num_experts": 60,
                  "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True, "norm_topk_prob": False},
    "qwen3_moe": {"hidden_size": 2048, "num_attention_heads": 32, "num_hidden_layers": 24, "num_key_value_heads": 4,
                  "intermediate_size": 6144, "vocab_size": 151936, "max_position_embeddings": 32768,
                  "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
                  "num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False, "norm_topk_prob": False},
    "deepseek_v3": {"hidden_size": 7168, "num_attention_heads": 128, "num_hidden_layers": 61,
                    "num_key_value_heads": 128, "intermediate_size": 18432, "vocab_size": 129280,
                    "max_position_embeddings": 4096, "tie_word_embeddings": False, "n_routed_experts": 256,
                    "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                    "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "attention_bias": False, "n_group": 8,
                    "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True},
    "gpt_oss": {"hidden_size": 2880, "num_attention_heads": 64, "num_hidden_layers": 36, "num_key_value_heads": 8,
                "intermediate_size": 2880, "vocab_size": 201088, "max_position_embeddings": 131072, "head_dim": 64,
                "sliding_window": 128, "tie_word_embeddings": False, "num_local_experts": 128,
                "num_experts_per_tok": 4, "attention_bias": True},
}
GPT2_ATTRIBUTE_MAP = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
                      "max_position_embeddings": "n_positions"}
ATTRIBUTE_MAPS = {"gpt2": GPT2_ATTRIBUTE_MAP, "qwen3_moe": {"num_experts": "num_local_experts"},
                  "gpt_oss": {"num_experts": "num_local_experts"}}


def zoo_names() -> list[str]:
    return list(ZOO)


def _zoo_name(source: str) -> str:
    return ALIASES.get(source.lower(), source.lower())


def is_zoo_model(source: str) -> bool:
    """Whether ``source`` names a zoo model (else it is a config.json or a folder holding one)."""
    return _zoo_name(source) in ZOO


def load_model(source: str, *, seq_len: int | None = None) -> ModelSpec:
    """A zoo name or a path to a Hugging Face config.json (or a folder holding one)."""
    if is_zoo_model(source):
        spec = ZOO[_zoo_name(source)]
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            if source.endswith(".json") or "/" in source:
                raise UserError("no such file", source=source)
            raise UserError(f"unknown model {source!r}; known: {one_of(zoo_names())}, "
                            "or a path to a Hugging Face config.json", field="--model")
        spec = load_hf_config(path)
    if seq_len is not None:
        spec = replace(spec, seq_len=seq_len)
    return spec


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; a missing file, bad JSON or another top-level value is a UserError
    that names the file (and the line and column)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"cannot read: {e.strerror}", source=str(path)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}",
                        source=str(path)) from None
    if not isinstance(data, dict):
        raise UserError(f"expected a JSON object, got {type(data).__name__}", source=str(path))
    return data


class _Fields:
    """Typed access to a config.json's fields, with errors that name the file and field."""

    def __init__(self, data: dict, source: str):
        self.data, self.source = data, source

    def int(self, *keys: str, default: int | None = None) -> int:
        for key in keys:
            if key in self.data and self.data[key] is not None:
                value = self.data[key]
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise UserError(f"must be a positive integer, got {value!r}", source=self.source, field=key)
                return value
        if default is None:
            raise UserError("missing (required)", source=self.source, field=" or ".join(keys))
        return default

    def count(self, key: str, default: int = 0) -> int:
        """A non-negative integer; absent or null: ``default``."""
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"must be a non-negative integer, got {value!r}", source=self.source, field=key)
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise UserError(f"must be true or false, got {value!r}", source=self.source, field=key)
        return value

    def positive(self, key: str, default: float) -> float:
        """A number > 0; absent or null: ``default``."""
        value = self.data.get(key)
        if value is None:
            return default
        if not _real(value) or not value > 0:
            raise UserError(f"must be a number > 0, got {value!r}", source=self.source, field=key)
        return float(value)


def _real(value) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def config_json(spec: ModelSpec) -> dict:
    """The Hugging Face config.json ``load_hf_config`` reads back as ``spec``, for the families written here:
    GPT-2 (GELU MLP, learned positions, tied embeddings), Llama, Qwen3 where ``spec`` norms q and k, and Mixtral
    where ``spec`` has routed experts."""
    if spec.mlp == "gelu":
        return {"model_type": "gpt2", "n_layer": spec.num_layers, "n_embd": spec.hidden, "n_head": spec.num_heads,
                "n_inner": spec.ffn_hidden, "vocab_size": spec.vocab_size, "n_positions": spec.max_positions,
                "resid_pdrop": 0.0, "attn_pdrop": 0.0, "embd_pdrop": 0.0, "tie_word_embeddings": True}
    if spec.qk_norm and spec.num_experts:
        raise ValueError(f"{spec.name}: config_json writes no Qwen3-MoE config")
    out = {"model_type": "mixtral" if spec.num_experts else "qwen3" if spec.qk_norm else "llama",
           "num_hidden_layers": spec.num_layers,
           "hidden_size": spec.hidden, "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
           "intermediate_size": spec.ffn_hidden, "vocab_size": spec.vocab_size,
           "max_position_embeddings": spec.seq_len, "tie_word_embeddings": False}
    if spec.num_experts:
        out.update(num_local_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token)
    if spec.qk_norm:
        out.update(head_dim=spec.head_dim)
    return out


def load_hf_config(path: Path) -> ModelSpec:
    """Read a Hugging Face config.json of a supported model_type into a ModelSpec."""
    source = str(path)
    data = read_json(path)
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"unsupported value {model_type!r}; supported: {one_of(SUPPORTED_MODEL_TYPES)}",
                        source=source, field="model_type")
    # the config class's attribute_map: other names a file may use for its own fields
    data = {**{own: data[other] for other, own in ATTRIBUTE_MAPS.get(model_type, {}).items() if other in data},
            **data}
    defaulted = sorted(k for k in HF_DEFAULTS[model_type] if k not in data)
    data = {**HF_DEFAULTS[model_type], **data}      # what transformers assumes for what the file leaves out
    f = _Fields(data, source)
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    said = f"{source} (model_type {model_type}" + (f"; transformers' defaults for {', '.join(defaulted)}"
                                                    if defaulted else "") + ")"
    if model_type == "gpt2":
        hidden = f.int("n_embd", "hidden_size")
        heads = f.int("n_head", "num_attention_heads")
        if hidden % heads:
            raise UserError(f"n_embd {hidden} is not a multiple of n_head {heads}", source=source, field="n_embd")
        positions = f.int("n_positions", "max_position_embeddings", default=1024)
        dropout = any(float(data.get(k) or 0) > 0 for k in ("resid_pdrop", "attn_pdrop", "embd_pdrop"))
        spec = ModelSpec(
            name=name, num_layers=f.int("n_layer", "num_hidden_layers"), hidden=hidden, num_heads=heads,
            num_kv_heads=heads, head_dim=hidden // heads, ffn_hidden=f.int("n_inner", default=4 * hidden),
            vocab_size=f.int("vocab_size"), seq_len=positions, max_positions=positions, mlp="gelu",
            norm="layernorm", linear_bias=True, qkv_bias=False,
            tied_embeddings=f.bool("tie_word_embeddings", True), dropout=dropout, fused_qkv=True, source=said)
    else:
        hidden = f.int("hidden_size")
        heads = f.int("num_attention_heads")
        if data.get("head_dim") is not None:
            head_dim = f.int("head_dim")
        else:
            if hidden % heads:
                raise UserError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                                "and no head_dim is given", source=source, field="hidden_size")
            head_dim = hidden // heads
        experts = f.int("num_local_experts", default=8) if model_type == "mixtral" else 0
        top_k = f.int("num_experts_per_tok", default=2) if model_type == "mixtral" else 0
        window = data.get("sliding_window") if data.get("use_sliding_window", True) else None
        spec = ModelSpec(
            name=name, num_layers=f.int("num_hidden_layers"), hidden=hidden, num_heads=heads,
            num_kv_heads=f.int("num_key_value_heads", default=heads), head_dim=head_dim,
            ffn_hidden=f.int("intermediate_size"), vocab_size=f.int("vocab_size"),
            seq_len=f.int("max_position_embeddings", default=4096), max_positions=0, mlp="swiglu",
            norm="rmsnorm", linear_bias=False,
            qkv_bias=True if model_type == "qwen2" else f.bool("attention_bias", False),
            tied_embeddings=f.bool("tie_word_embeddings", False), dropout=False,
            num_experts=experts, experts_per_token=top_k,
            sliding_window=window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else 0,
            source=said)
        spec = _TYPE_READERS.get(model_type, lambda spec, f: spec)(spec, f)
    return spec.validate(source)


def _leading_dense(f: "_Fields", num_layers: int) -> int:
    """Qwen-MoE's dense blocks (``mlp_only_layers``, and every block off ``decoder_sparse_step``), as the count of
    leading dense blocks meshplan expresses; another layout is refused, naming the field."""
    step = f.int("decoder_sparse_step", default=1)
    dense = sorted(set(f.data.get("mlp_only_layers") or [])
                   | {i for i in range(num_layers) if (i + 1) % step})
    if dense != list(range(len(dense))):
        raise UserError(f"dense blocks {dense}: only leading dense blocks are supported (the first K blocks)",
                        source=f.source, field="mlp_only_layers")
    return len(dense)


def _qwen_moe(spec: ModelSpec, f: "_Fields") -> ModelSpec:
    """Qwen2-MoE (a gated shared expert, q/k/v biases) and Qwen3-MoE (q/k norms, no shared expert)."""
    qwen3 = f.data.get("model_type") == "qwen3_moe"
    shared = 0 if qwen3 else f.count("shared_expert_intermediate_size")
    return replace(spec, num_experts=f.int("num_local_experts" if qwen3 else "num_experts"),
                   experts_per_token=f.int("num_experts_per_tok"), moe_ffn_hidden=f.int("moe_intermediate_size"),
                   shared_experts=1 if shared else 0, shared_ffn_hidden=shared, shared_expert_gate=bool(shared),
                   qk_norm=qwen3,
                   qkv_bias=not qwen3 and f.bool("qkv_bias", True),
                   dense_layers=_leading_dense(f, spec.num_layers), router_renormalize=f.bool("norm_topk_prob", False))


def _deepseek_v3(spec: ModelSpec, f: "_Fields") -> ModelSpec:
    """DeepSeek-V3 (and Kimi K2, the same architecture): multi-head latent attention, one shared expert beside
    the routed ones, the first ``first_k_dense_replace`` blocks dense. Its multi-token-prediction module
    (``num_nextn_predict_layers``) is left out."""
    nope, rope = f.int("qk_nope_head_dim"), f.int("qk_rope_head_dim")
    return replace(spec, num_kv_heads=spec.num_heads, head_dim=nope + rope, qk_rope_head_dim=rope,
                   v_head_dim=f.int("v_head_dim"), q_lora_rank=f.count("q_lora_rank"),
                   kv_lora_rank=f.int("kv_lora_rank"), num_experts=f.int("n_routed_experts"),
                   experts_per_token=f.int("num_experts_per_tok"), moe_ffn_hidden=f.int("moe_intermediate_size"),
                   shared_experts=f.count("n_shared_experts"), dense_layers=f.count("first_k_dense_replace"),
                   **_deepseek_router(f))


def _deepseek_router(f: "_Fields") -> dict:
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter, Sec 2.1.2 of its report): sigmoid scores, the top-k
    from the best ``topk_group`` of ``n_group`` groups (one group: none), renormalised where ``norm_topk_prob``,
    times ``routed_scaling_factor``, the experts chosen with a balancing bias (``e_score_correction_bias``) moved at
    DeepSeek-V3's rate, which configs do not carry."""
    method = f.data.get("topk_method", "noaux_tc")
    if method != "noaux_tc":         # transformers' DeepseekV3TopkRouter implements this one only
        raise UserError(f"unsupported value {method!r}; supported: noaux_tc", source=f.source, field="topk_method")
    scoring = f.data.get("scoring_func", "sigmoid")
    if scoring not in ROUTER_SCORES:
        raise UserError(f"unsupported value {scoring!r}; supported: {one_of(ROUTER_SCORES)}", source=f.source,
                        field="scoring_func")
    groups = f.int("n_group")
    return dict(router_scores=scoring, router_renormalize=f.bool("norm_topk_prob", True),
                router_groups=groups if groups > 1 else 0, router_groups_used=f.int("topk_group") if groups > 1 else 0,
                router_scale=f.positive("routed_scaling_factor", 1.0),
                router_bias_rate=DEEPSEEK_V3_BIAS_RATE if scoring == "sigmoid" else 0.0)


def _gpt_oss(spec: ModelSpec, f: "_Fields") -> ModelSpec:
    """GPT-OSS: experts of ``intermediate_size`` with biases (and the router's), attention with biases and a
    learned sink per head, sliding-window and full attention alternating (``layer_types``)."""
    types = f.data.get("layer_types") or ["sliding_attention", "full_attention"] * ((spec.num_layers + 1) // 2)
    sliding = [t == "sliding_attention" for t in types[:spec.num_layers]]
    every = next((k for k in (1, 2) if sliding == [i % k == 0 for i in range(spec.num_layers)]), None)
    if every is None:
        raise UserError("only every block sliding, or sliding and full attention alternating from the first, "
                        "is supported", source=f.source, field="layer_types")
    alpha = f.data.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)
    if alpha != GPT_OSS_SWIGLU_ALPHA:
        raise UserError(f"{alpha!r}: only GPT-OSS's {GPT_OSS_SWIGLU_ALPHA} is supported", source=f.source,
                        field="swiglu_alpha")
    return replace(spec, num_experts=f.int("num_local_experts"), experts_per_token=f.int("num_experts_per_tok"),
                   linear_bias=True, qkv_bias=False, attention_sinks=True, sliding_every=0 if every == 1 else 2,
                   swiglu_limit=f.positive("swiglu_limit", GPT_OSS_SWIGLU_LIMIT))


def _qwen3(spec: ModelSpec, f: "_Fields") -> ModelSpec:
    """Qwen3 (dense): Llama's block with an RMSNorm of every head's q and k (transformers' Qwen3Attention)."""
    return replace(spec, qk_norm=True)


# what each model type adds to the Llama-style fields read above (experts, latent attention, q/k norms, ...)
_TYPE_READERS = {"qwen3": _qwen3, "qwen2_moe": _qwen_moe, "qwen3_moe": _qwen_moe, "deepseek_v3": _deepseek_v3,
                "gpt_oss": _gpt_oss}
