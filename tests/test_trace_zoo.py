"""Traced transformers models against the analytical layer graph of the same architecture.

The reference is planner.layers.build_layer_graph (written from the papers, not
from the trace): parameter counts must be equal, FLOPs within 2%. The HF configs
are written out here field by field from the zoo spec (the task's recipe), not
with the tracer's own helper.
"""
import pytest
import torch

from planner.layers import build_layer_graph
from planner.model import ZOO, load_model
from planner.trace import trace_module

import transformers  # the [hf] extra, which CI installs: missing, it fails, never skips


def _meta(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _check_against_analytical(result, module, spec):
    graph, analytical = result.graph, build_layer_graph(spec)
    seq = spec.seq_len
    assert graph.num_params == spec.num_params() == sum(p.numel() for p in module.parameters())
    ratio = graph.model_flops_per_token(seq) / analytical.model_flops_per_token(seq)
    assert abs(ratio - 1) < 0.02, ratio
    if not spec.sliding_window:   # (a masked kernel computes the full square; the model count skips it)
        # the aten-level count: every matmul the trace saw, per token, against the analytical forward
        aten_ratio = result.fwd_flops / result.tokens / (analytical.model_flops_per_token(seq) / 3)
        assert abs(aten_ratio - 1) < 0.02, aten_ratio
    # backward: dgrad + wgrad for every weight (2x), attention's five products against two (2.5x)
    assert 2.0 <= result.bwd_flops / result.fwd_flops < 2.1
    blocks = [layer for layer in graph.layers if layer.is_block]
    assert len(blocks) == spec.num_layers
    assert len({layer.signature for layer in blocks}) == 1        # costed and searched once
    return graph


def test_gpt_1_7b_from_the_zoo_config():
    spec = ZOO["gpt-1.7b"]
    config = transformers.GPT2Config(n_embd=spec.hidden, n_layer=spec.num_layers, n_head=spec.num_heads,
                                     n_inner=4 * spec.hidden, vocab_size=spec.vocab_size, n_positions=spec.seq_len)
    module = _meta(config)
    result = trace_module(module, torch.zeros(1, spec.seq_len, dtype=torch.long))
    graph = _check_against_analytical(result, module, spec)
    assert graph.tied_embeddings and graph.tied_params == spec.vocab_size * spec.hidden
    assert graph.num_heads == spec.num_heads and graph.hidden == spec.hidden and graph.seq_len == spec.seq_len


def test_llama3_8b_from_the_zoo_config():
    spec = ZOO["llama3-8b"]
    config = transformers.LlamaConfig(hidden_size=spec.hidden, num_hidden_layers=spec.num_layers,
                                      num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                                      intermediate_size=spec.ffn_hidden, vocab_size=spec.vocab_size,
                                      max_position_embeddings=spec.seq_len, tie_word_embeddings=False)
    module = _meta(config)
    result = trace_module(module, torch.zeros(1, 2048, dtype=torch.long))
    graph = _check_against_analytical(result, module, load_model("llama3-8b", seq_len=2048))
    assert (graph.num_heads, graph.num_kv_heads) == (32, 8)      # grouped-query heads seen through repeat_kv
    assert not graph.tied_embeddings


@pytest.mark.parametrize("config_class, extra", [
    ("MistralConfig", {"sliding_window": 64}),
    ("Qwen2Config", {}),
    ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
])
def test_small_configs_through_the_planner_reader(tmp_path, config_class, extra):
    """The same config.json read by meshplan's own reader (analytical) and by transformers (traced)."""
    config = getattr(transformers, config_class)(
        hidden_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, intermediate_size=256,
        vocab_size=512, max_position_embeddings=128, **extra)
    config.to_json_file(str(tmp_path / "config.json"))
    spec = load_model(str(tmp_path / "config.json"))
    module = _meta(config)
    result = trace_module(module, torch.zeros(2, spec.seq_len, dtype=torch.long))
    _check_against_analytical(result, module, spec)
    if spec.is_moe:
        experts = [op for layer in result.graph.layers for op in layer.ops if op.num_gemms > 1]
        assert {(op.num_gemms, op.tokens_factor) for op in experts} == {(4, 2.0)}    # 4 experts, top-2
