"""A zoo model or config.json as a real ``transformers`` module (on the meta device) to trace.

The zoo's GPTs are Megatron GPTs (GELU MLP, learned positions, tied embeddings):
``GPT2Config(n_embd, n_layer, n_head, n_inner, vocab_size, n_positions)``; the
Llama family maps to ``LlamaConfig`` (``MixtralConfig`` for a mixture of
experts, ``DeepseekV3Config`` with latent attention, ``GptOssConfig`` with attention
sinks, ``Qwen3MoeConfig``/``Qwen2MoeConfig`` with q/k norms or a gated shared expert,
``MistralConfig`` with a sliding window, ``Qwen2Config`` with q/k/v biases). Needs
``transformers``; no weights are downloaded or allocated.
"""
from __future__ import annotations

from ..errors import UserError
from ..model import GPT_OSS_SWIGLU_LIMIT, ModelSpec


def hf_config(spec: ModelSpec):
    try:
        import transformers as tf
    except ImportError:
        raise UserError("tracing a zoo model needs transformers (pip install meshplan[hf])",
                        field="--model") from None
    if spec.mlp == "gelu":
        return tf.GPT2Config(n_embd=spec.hidden, n_layer=spec.num_layers, n_head=spec.num_heads,
                             n_inner=spec.ffn_hidden, vocab_size=spec.vocab_size, n_positions=spec.max_positions,
                             tie_word_embeddings=spec.tied_embeddings,
                             **({} if spec.dropout else {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}))
    common = dict(hidden_size=spec.hidden, num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, intermediate_size=spec.ffn_hidden,
                  vocab_size=spec.vocab_size, max_position_embeddings=spec.seq_len,
                  tie_word_embeddings=spec.tied_embeddings)
    experts = dict(num_experts_per_tok=spec.experts_per_token)
    if spec.is_mla:
        common.pop("head_dim")
        return tf.DeepseekV3Config(
            n_routed_experts=spec.num_experts, n_shared_experts=spec.shared_experts, first_k_dense_replace=spec.dense_layers,
            moe_intermediate_size=spec.expert_ffn, q_lora_rank=spec.q_lora_rank or None, kv_lora_rank=spec.kv_lora_rank,
            qk_nope_head_dim=spec.head_dim - spec.qk_rope_head_dim, qk_rope_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.v_head_dim or spec.head_dim, n_group=spec.router_groups or 1,
            topk_group=spec.router_groups_used or 1, routed_scaling_factor=spec.router_scale,
            norm_topk_prob=spec.router_renormalize, **experts, **common)
    if spec.attention_sinks:
        common["intermediate_size"] = spec.expert_ffn
        return tf.GptOssConfig(num_local_experts=spec.num_experts, sliding_window=spec.sliding_window or None,
                               swiglu_limit=spec.swiglu_limit or GPT_OSS_SWIGLU_LIMIT,
                               layer_types=["sliding_attention" if spec.slides(i) else "full_attention"
                                            for i in range(spec.num_layers)], **experts, **common)
    if spec.is_moe and (spec.qk_norm or spec.shared_experts):
        cls = tf.Qwen3MoeConfig if spec.qk_norm else tf.Qwen2MoeConfig
        shared = {} if spec.qk_norm else {"shared_expert_intermediate_size": spec.shared_ffn}
        return cls(num_experts=spec.num_experts, moe_intermediate_size=spec.expert_ffn,
                   mlp_only_layers=list(range(spec.dense_layers)), norm_topk_prob=spec.router_renormalize, **shared,
                   **experts, **common)
    if spec.is_moe:
        return tf.MixtralConfig(num_local_experts=spec.num_experts, sliding_window=spec.sliding_window or None,
                                **experts, **common)
    if spec.qk_norm:
        return tf.Qwen3Config(**common)
    if spec.qkv_bias:
        return tf.Qwen2Config(**common)
    if spec.sliding_window:
        return tf.MistralConfig(sliding_window=spec.sliding_window, **common)
    return tf.LlamaConfig(**common)


def build_hf_module(spec: ModelSpec, device: str = "meta"):
    """(module, example input ids of one sequence) for a zoo spec, parameters on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device(device):
        module = AutoModelForCausalLM.from_config(hf_config(spec))
    return module, torch.zeros(1, spec.seq_len, dtype=torch.long, device="meta")
