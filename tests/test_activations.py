"""Saved activations and FLOPs of the analytical layer graph against Korthikanti et al. 2022.

Table 2 of "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), bytes per transformer layer with 16-bit activations and
1-byte dropout masks, materialised attention scores.
"""
import pytest

from planner.cluster import load_cluster
from planner.cost.layer import Context, layer_cost
from planner.layers import build_layer_graph
from planner.model import ZOO

SPEC = ZOO["gpt-18.4b"]                   # h 6144, a 48, dropout on: Megatron's GPT
S, B, H, A = 2048, 2, SPEC.hidden, SPEC.num_heads
CLUSTER = load_cluster("a100-80g", 8)
BLOCK = build_layer_graph(SPEC).layers[1]
# our graph also keeps the norms' fp32 statistics (mean, rstd: 16 bytes per token per
# layer), which the paper's accounting leaves out
STATS = 16 * S * B


def act(tp, sp, policy, attention="unfused"):
    ctx = Context(micro_batch=B, seq_len=S, tp=tp, cp=1, sequence_parallel=sp, precision="fp16",
                  attention=attention, framework="megatron", tp_comm_overlap=False)
    cost = layer_cost(BLOCK, ctx, CLUSTER)
    return cost.policy(policy).act_bytes


def sbh(x):
    return S * B * H * x


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_no_recompute_tensor_parallel(tp):
    expected = sbh(10 + 24 / tp + 5 * A * S / (H * tp))
    stats = STATS if tp == 1 else STATS          # norms are replicated without SP
    assert act(tp, False, "none") == pytest.approx(expected + stats, rel=1e-6)


@pytest.mark.parametrize("tp", [2, 8])
def test_no_recompute_sequence_parallel(tp):
    expected = sbh(34 / tp + 5 * A * S / (H * tp))
    assert act(tp, True, "none") == pytest.approx(expected + STATS / tp, rel=1e-6)


@pytest.mark.parametrize("tp", [1, 4])
def test_selective_recompute(tp):
    assert act(tp, False, "selective") == pytest.approx(sbh(10 + 24 / tp) + STATS, rel=1e-6)


def test_selective_recompute_with_sequence_parallel():
    assert act(8, True, "selective") == pytest.approx(sbh(34 / 8) + STATS / 8, rel=1e-6)


@pytest.mark.parametrize("tp,sp", [(1, False), (8, False), (8, True)])
def test_full_recompute_keeps_layer_input(tp, sp):
    assert act(tp, sp, "full") == pytest.approx(sbh(2) / (tp if sp else 1), rel=1e-9)


def test_flash_attention_drops_the_score_term():
    # the fused kernel keeps q, k, v, the output and an fp32 log-sum-exp per head
    flash = act(1, False, "none", attention="flash")
    assert flash == pytest.approx(sbh(34) + STATS + 4 * A * S * B, rel=1e-6)


def test_model_flops_match_korthikanti_appendix_a():
    # 72 B s l h^2 (1 + s/(6h) + V/(12 h l)) per step: forward + backward, no recompute
    for name in ("gpt-1.7b", "gpt-145.6b", "gpt3-175b"):
        spec = ZOO[name]
        graph = build_layer_graph(spec)
        l, h, V, s = spec.num_layers, spec.hidden, spec.vocab_size, spec.seq_len
        expected = 72 * s * l * h * h * (1 + s / (6 * h) + V / (12 * h * l))
        assert graph.model_flops_per_token(s) * s == pytest.approx(expected, rel=1e-9)


def test_identical_blocks_share_a_signature():
    graph = build_layer_graph(ZOO["llama3-8b"])
    assert {layer.signature for layer in graph.layers if layer.is_block} == {"block"}
    assert graph.num_blocks == 32 and graph.num_params == ZOO["llama3-8b"].num_params()
