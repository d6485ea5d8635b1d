"""Qwen3's per-head q and k norms in the executor's reference model (executor/models.py ``QKNorm``), and dense Qwen3
config.json files read by the planner. Their tensor-parallel training against one process: tests/test_executor_plans.py
(the ``qwen3`` model)."""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from executor_support import TINY_QWEN3
from moe_support import built_as_planned
from planner.model import config_json, load_model


def test_the_q_and_k_of_every_head_are_rms_normed_before_rope():
    """The attention's output is that of q and k each divided by the root mean square of its own head's channels
    and scaled by the norm's weight, then rotated (transformers' Qwen3Attention), written out here op by op."""
    from executor.models import build_model, rope
    torch.manual_seed(0)
    spec = TINY_QWEN3
    attn = build_model(spec, "cpu").layers["0"].attn
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(2, spec.seq_len, spec.hidden)
    hd = spec.head_dim

    def rms(t, w):          # over each head's hd channels
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    q = (x @ attn.q_proj.weight.T).view(2, spec.seq_len, -1, hd)
    k = (x @ attn.k_proj.weight.T).view(2, spec.seq_len, -1, hd)
    v = (x @ attn.v_proj.weight.T).view(2, spec.seq_len, -1, hd)
    positions = torch.arange(spec.seq_len)

    def attention(q, k):
        y = F.scaled_dot_product_attention(rope(q, positions).transpose(1, 2), rope(k, positions).transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return y.transpose(1, 2).reshape(2, spec.seq_len, -1) @ attn.o_proj.weight.T
    got = attn(x)
    torch.testing.assert_close(got, attention(rms(q, attn.qk_norm.q.weight), rms(k, attn.qk_norm.k.weight)),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, attention(q, k), atol=1e-3)      # without the norms it differs: the test sees them


def test_the_model_has_the_planner_s_parameters_and_its_norms_start_at_one():
    from executor.models import full_init
    model = built_as_planned(TINY_QWEN3)
    names = [n for n, _ in model.named_parameters() if ".qk_norm." in n]
    assert names[:2] == ["layers.0.attn.qk_norm.q.weight", "layers.0.attn.qk_norm.k.weight"]
    assert len(names) == 2 * TINY_QWEN3.num_layers
    assert torch.equal(full_init(names[0], torch.Size([TINY_QWEN3.head_dim]), TINY_QWEN3, 0),
                       torch.ones(TINY_QWEN3.head_dim))


def test_a_dense_qwen3_config_reads_back_as_the_spec(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_json(TINY_QWEN3)))
    spec = load_model(str(path))
    assert spec.qk_norm and not spec.qkv_bias and spec.head_dim == TINY_QWEN3.head_dim
    assert spec.num_params() == TINY_QWEN3.num_params()
    # Qwen3-8B as its config.json on the Hugging Face Hub gives it; its model card (Qwen/Qwen3-8B): 8.2B parameters,
    # 6.95B without the embeddings
    path.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
                                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                "intermediate_size": 12288, "vocab_size": 151936, "max_position_embeddings": 40960,
                                "tie_word_embeddings": False}))
    qwen3_8b = load_model(str(path))
    embeddings = 2 * 151936 * 4096
    assert qwen3_8b.qk_norm and round(qwen3_8b.num_params() / 1e9, 1) == 8.2
    assert round((qwen3_8b.num_params() - embeddings) / 1e9, 2) == 6.95


def test_the_dense_qwen3_zoo_models_have_their_model_cards_parameters():
    """qwen3-8b and qwen3-32b: 8.2B and 32.8B parameters, 6.95B and 31.2B without the embeddings (Qwen/Qwen3-8B and
    Qwen/Qwen3-32B model cards); transformers' Qwen3 module of each spec (what tracing a zoo model builds) the same."""
    from planner.model import ZOO
    def as_the_card_rounds(count, card):       # the card's figure to as many decimals as it gives
        return f"{count / 1e9:.{len(card.split('.')[1])}f}" == card
    for name, total, body in (("qwen3-8b", "8.2", "6.95"), ("qwen3-32b", "32.8", "31.2")):
        spec = ZOO[name]
        embeddings = 2 * spec.vocab_size * spec.hidden
        assert spec.qk_norm and as_the_card_rounds(spec.num_params(), total), name
        assert as_the_card_rounds(spec.num_params() - embeddings, body), name
    import transformers         # meshplan[hf], which CI installs (meshplan[all])
    from planner.trace.zoo import hf_config
    config = hf_config(TINY_QWEN3)
    assert type(config).__name__ == "Qwen3Config"
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in module.parameters()) == TINY_QWEN3.num_params()


def test_the_eager_tables_family_gets_the_q_and_k_norms_added():
    """A Qwen3 block is priced for torch eager as the Llama block of its family (planner/eager_table.py has no
    q/k norms) plus its two RMSNorms as fused kernels, counted by hand for the tiny Qwen3 (q 64 and kv 32 wide,
    heads of 16) under autocast (norms in fp32, 4 bytes): forward reads q and k and writes them, 2 x 4 x 96 bytes,
    and an fp32 rstd per head, 4 x 6: 792 bytes a token; backward reads dy, x and rstd and writes dx (3 x 4 x 96 +
    24), then gamma's pass reads dy and x (2 x 4 x 96): 1,944 bytes. One kernel forward and two backward each."""
    from planner.eager_bytes import layer_eager_bytes
    from executor_support import TINY_LLAMA

    def norm_row(spec):
        eager = dict(layer_eager_bytes(spec, "block"))["autocast"]
        row = next(r for r in eager.by_class if r[0] == "norm")
        return row, eager
    (_, fh, ft, bh, bt), qwen = norm_row(TINY_QWEN3)
    (_, lfh, lft, lbh, lbt), llama = norm_row(TINY_LLAMA)
    assert (fh, bh) == (lfh, lbh)                  # the block norms over h: the same
    assert (ft - lft, bt - lbt) == (792.0, 1944.0)
    assert (qwen.fwd_kernels - llama.fwd_kernels, qwen.bwd_kernels - llama.bwd_kernels) == (2, 4)
    assert (qwen.fwd_ops - llama.fwd_ops, qwen.bwd_ops - llama.bwd_ops) == (2, 2)
