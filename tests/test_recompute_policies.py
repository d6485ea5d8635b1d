"""The recompute policies in the cost model, against bytes and seconds computed here by hand.

Per token of a Llama-3 8B block (h 4096, q 4096, kv 1024, f 14336, 32 heads) in bf16 under flash
attention, what autograd saves without recompute (planner/layers.py, Korthikanti et al. 2022 Sec 4.1
with SwiGLU): two norms' inputs and fp32 rstd, the q projection's input, q k v and the attention
output, the gate's input, SwiGLU's three f-wide tensors and the down projection's input, and the
kernel's fp32 log-sum-exp per head.
"""
import pytest

from planner.cluster import load_cluster
from planner.cost.layer import Context, layer_cost
from planner.errors import UserError
from planner.layers import build_layer_graph
from planner.model import ZOO
from planner.recompute import every_k_layers, parse_recompute

H, Q, KV, F, HEADS = 4096, 4096, 1024, 14336, 32
LLAMA = build_layer_graph(ZOO["llama3-8b"])
H100 = load_cluster("h100-80g", 8)
TOKENS = 2 * 8192
NONE_PER_TOKEN = 2 * (4 * H + 2 * Q + 2 * KV + 4 * F) + 2 * 4 + 4 * HEADS     # 168,072 B


def cost(graph, *, tp=1, sp=False, mb=2, seq=8192, cluster=H100, precision="bf16", regime="", framework="torch"):
    ctx = Context(micro_batch=mb, seq_len=seq, tp=tp, cp=1, sequence_parallel=sp, precision=precision,
                  attention="flash", framework=framework, tp_comm_overlap=False, eager_regime=regime)
    return layer_cost(graph.layers[1], ctx, cluster)


def test_no_recompute_is_the_hand_count():
    assert NONE_PER_TOKEN == 168_072
    assert cost(LLAMA).policy("none").act_bytes == pytest.approx(NONE_PER_TOKEN * TOKENS, rel=1e-9)


def test_autocast_keeps_the_residual_stream_in_fp32():
    """Under torch's autocast (DDP or no wrapper) the residual stream is fp32: each of the block's two norms saves its
    fp32 input, 2 bytes more per element than bf16 (FSDP2's regime), and a checkpoint of the whole block keeps its
    fp32 input; the measured peaks of the executor's H100 plans (benchmarks/gpu_validate.py: mean |error| 7.0% -> 3.9%,
    full-recompute rows within 0.3%) are what found it."""
    bf16, autocast = cost(LLAMA, regime="bf16"), cost(LLAMA, regime="autocast")
    assert bf16.policy("none").act_bytes == pytest.approx(NONE_PER_TOKEN * TOKENS, rel=1e-9)
    assert autocast.policy("none").act_bytes - bf16.policy("none").act_bytes == pytest.approx(2 * 2 * H * TOKENS)
    assert bf16.policy("full").act_bytes == pytest.approx(2 * H * TOKENS)
    assert autocast.policy("full").act_bytes == pytest.approx(4 * H * TOKENS)


def test_op_keeps_odd_matmuls_attention_and_the_input():
    """torchtitan's SelectiveAC: mm outputs 1, 3, 5, 7 of q k v o gate up down are saved (q, v, gate,
    down), the attention kernel's output and log-sum-exp, and the checkpoint keeps the block's input."""
    per_token = 2 * (H + Q + KV + Q + F + H) + 4 * HEADS
    assert per_token == 63_616
    assert cost(LLAMA).policy("op").act_bytes == pytest.approx(per_token * TOKENS, rel=1e-9)


def test_op_under_tensor_and_sequence_parallelism():
    """tp 8 with SP: column outputs split 8 ways, a row-parallel mm output is the full width of partial
    sums, each row-parallel reduce-scatter output (1/8) is saved too, the input is the sequence shard."""
    t = 8
    per_token = 2 * (H / t + Q / t + KV / t + H / t + F / t + H + H / t + Q / t) + 4 * HEADS / t
    got = cost(LLAMA, tp=t, sp=True).policy("op").act_bytes
    assert got == pytest.approx(per_token * TOKENS, rel=1e-9)


def test_op_saves_every_biased_linear():
    """GPT's linears have biases: aten.addmm, always saved (the every-other rule counts aten.mm only)."""
    spec = ZOO["gpt-18.4b"]
    h, heads = spec.hidden, spec.num_heads
    assert spec.ffn_hidden == 4 * h and spec.linear_bias
    per_token = 2 * (h + 3 * h + h + 4 * h + h + h) + 4 * heads       # input, q k v, o, fc1, fc2, attention
    got = cost(build_layer_graph(spec), mb=1, seq=2048).policy("op").act_bytes
    assert got == pytest.approx(per_token * 2048, rel=1e-9)


def test_op_recomputes_less_than_full_and_more_than_none():
    c = cost(LLAMA, regime="bf16")
    op, full = c.policy("op").recompute_s, c.policy("full").recompute_s
    assert 0 < op < full < c.fwd_s
    # the recomputed mms (k, o, up) are 2 (h kv + q h + h f) FLOPs per token
    assert c.policy("op").recompute_flops == pytest.approx(2 * (H * KV + Q * H + H * F) * TOKENS, rel=1e-9)


# h100-80g's host side: PCIe 50 GB/s per GPU, but 8 GPUs share 614.4 GB/s of DRAM at 0.5 efficiency
HOST_RATE = min(50e9, 614.4e9 * 0.5 / 8)        # 38.4 GB/s per GPU


def test_offload_moves_everything_to_the_host_over_pcie():
    """Nothing kept on the device between forward and backward, all of it on the host; the copy each way
    at the GPU's share of the host (HOST_RATE), exposed where it exceeds the layer's forward (out) and
    backward (in)."""
    c = cost(LLAMA, regime="bf16")
    i = c.policy("activation-offload")
    nbytes = NONE_PER_TOKEN * TOKENS
    assert i.act_bytes == 0 and i.host_bytes == pytest.approx(nbytes, rel=1e-9)
    copy_s = nbytes / HOST_RATE
    assert copy_s > c.bwd_s > c.fwd_s            # this block: slower to move than to compute
    assert i.recompute_s == pytest.approx((copy_s - c.fwd_s) + (copy_s - c.bwd_s), rel=1e-9)
    # two layers on the device at a time: the one in backward and the next, copied in beside it
    assert i.peak_extra_bytes == pytest.approx(c.policy("none").peak_extra_bytes + 2 * nbytes, rel=1e-9)


def test_offload_is_free_where_compute_hides_the_copy():
    """At 256k tokens causal attention (quadratic) outlasts the copies (linear): nothing exposed (at 128k, since
    cuDNN's attention kernel prices the executor's on an H100, the forward no longer hides them)."""
    c = cost(LLAMA, mb=1, seq=262144)
    nbytes = NONE_PER_TOKEN * 262144
    assert nbytes / HOST_RATE < c.fwd_s < c.bwd_s
    assert c.policy("activation-offload").recompute_s == 0.0


def test_offload_shares_a_pcie_switch_uplink_between_two_a100s():
    """DGX A100: two GPUs behind each PCIe switch share its x16 link to the CPU (gpus_per_uplink = 2), so
    each copies at 25 / 2 = 12.5 GB/s when all offload, below its DRAM share (409.6 x 0.5 / 8 = 25.6);
    a single GPU has the link to itself."""
    from planner.network import host_bytes_per_s
    a100 = load_cluster("a100-80g", 8)
    assert host_bytes_per_s(a100) == pytest.approx(12.5e9)
    assert host_bytes_per_s(load_cluster("a100-80g", 1)) == pytest.approx(25e9)
    assert host_bytes_per_s(H100) == pytest.approx(50e9)          # no shared uplink documented
    c = cost(LLAMA, cluster=a100, regime="bf16")
    copy_s = NONE_PER_TOKEN * TOKENS / 12.5e9
    expected = max(0.0, copy_s - c.fwd_s) + max(0.0, copy_s - c.bwd_s)
    assert c.policy("activation-offload").recompute_s == pytest.approx(expected, rel=1e-9) and expected > 0


def test_every_k_expands_over_the_blocks_counted_from_one():
    policies = every_k_layers(LLAMA, 3)
    blocks = [p for p, layer in zip(policies, LLAMA.layers) if layer.is_block]
    assert [i + 1 for i, p in enumerate(blocks) if p == "full"] == [3, 6, 9, 12, 15, 18, 21, 24, 27, 30]
    assert all(p == "none" for p, layer in zip(policies, LLAMA.layers) if not layer.is_block)


@pytest.mark.parametrize("text", ["every-0", "every-x", "every-", "sometimes"])
def test_bad_recompute_is_one_line(cli, text):
    with pytest.raises(UserError):
        parse_recompute(text)
    out = cli("plan", "--model", "gpt-1.7b", "--gpus", "8", "--recompute", text)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "--recompute" in out.stderr


def test_every_k_on_the_cli_is_the_pattern_in_plan_json(cli, tmp_path):
    out = cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--dp", "8", "--tp", "1",
              "--pp", "1", "--zero", "3", "--micro-batch", "1", "--global-batch", "16", "--recompute", "every-4",
              "--json")
    assert out.returncode == 0, out.stderr
    import json
    config = json.loads(out.stdout)["config"]
    assert config["recompute"] == "every-4"
    assert config["recompute_layers"] == list(every_k_layers(LLAMA, 4))


# -- the output layer: logits and the loss as each runtime computes them ---------------------------

V = 128256


def head(framework: str, tp: int = 1):
    ctx = Context(micro_batch=2, seq_len=8192, tp=tp, cp=1, sequence_parallel=tp > 1, precision="bf16",
                  attention="flash", framework=framework, tp_comm_overlap=False,
                  eager_regime="bf16" if framework == "torch" else "")
    return layer_cost(LLAMA.layers[-1], ctx, H100)


@pytest.mark.parametrize("framework", ["torch", "deepspeed"])
def test_eager_cross_entropy_holds_fp32_log_probs_and_two_fp32_gradients(framework):
    """torch's F.cross_entropy on fp32 logits (meshplan's executor, torchtitan; the Hugging Face loss DeepSpeed
    trains with): log_softmax keeps its fp32 output, backward holds nll_loss's and log_softmax's fp32
    gradients at once. At 16,384 tokens of a 128,256 vocabulary: 7.8 GiB kept, 15.7 GiB in backward."""
    c = head(framework)
    assert c.policy("none").act_bytes == pytest.approx(TOKENS * (V * 4 + H * 2), rel=1e-9)       # + the head's input
    assert c.policy("none").peak_extra_bytes == pytest.approx(TOKENS * V * 8, rel=1e-9)


@pytest.mark.parametrize("tp", [1, 8])
def test_megatron_vocab_parallel_cross_entropy_writes_its_gradient_in_place(tp):
    """Megatron-LM's _VocabParallelCrossEntropy keeps the fp32 softmax of its vocabulary shard and turns it
    into the gradient in place; only the cast to bf16 is new in backward."""
    c = head("megatron", tp)
    assert c.policy("none").act_bytes == pytest.approx(TOKENS * V * 4 / tp + TOKENS / tp * H * 2, rel=1e-9)
    assert c.policy("none").peak_extra_bytes == pytest.approx(TOKENS * V * 2 / tp, rel=1e-9)


def test_full_recompute_stops_early_under_torch_checkpoint_and_not_under_megatron():
    """torch.utils.checkpoint (non-reentrant, early_stop=True) stops once the down projection's saved input
    (SwiGLU's product) is rebuilt: the down projection, 2 f h FLOPs per token, is not redone. Megatron-LM's
    CheckpointFunction re-runs the whole forward."""
    torch_full = cost(LLAMA).policy("full")
    flops_fwd = cost(LLAMA).matmul_flops_fwd
    assert torch_full.recompute_flops == pytest.approx(flops_fwd - 2 * F * H * TOKENS, rel=1e-9)
    megatron = cost(LLAMA, framework="megatron")
    assert megatron.policy("full").recompute_s == megatron.fwd_s
    assert megatron.policy("full").recompute_flops == pytest.approx(megatron.matmul_flops_fwd, rel=1e-9)
    assert torch_full.recompute_s < megatron.policy("full").recompute_s


def test_a_residual_dropout_keeps_the_whole_forward_in_the_rebuild():
    """GPT with dropout: the residual add after the last linear saves its dropout mask, so even a checkpoint
    that stops early re-runs everything, the 4h -> h projection included."""
    gpt = cost(build_layer_graph(ZOO["gpt-18.4b"]), mb=1, seq=2048)
    assert gpt.policy("full").recompute_flops == pytest.approx(gpt.matmul_flops_fwd, rel=1e-9)


def _megatron_block(name, index):
    ctx = Context(micro_batch=1, seq_len=4096, tp=1, cp=1, sequence_parallel=False, precision="bf16",
                  attention="flash", framework="megatron", tp_comm_overlap=False)
    return layer_cost(build_layer_graph(ZOO[name]).layers[1 + index], ctx, H100)


def test_discard_frees_the_router_input_and_the_experts_activation_output():
    """Megatron-Core's output-discarding recompute (--recompute-modules layernorm moe_act) on a Qwen3-30B-A3B block
    (h 2048, top-8 of experts 768 wide, no MLA): the pre-MLP norm's output, which the router keeps, and the experts'
    activation output, which their down-projection keeps, go (bf16: 2 bytes each); the norm (4 h bytes a token
    through HBM) and the activation (10 f k) are redone, at the H100 profile's 3350 GB/s x 0.90."""
    h, f, k, tokens = 2048, 768, 8, 4096
    spec = ZOO["qwen3-30b-a3b"]
    assert (spec.hidden, spec.expert_ffn, spec.experts_per_token, spec.is_mla) == (h, f, k, False)
    cost = _megatron_block("qwen3-30b-a3b", 0)
    none, discard = cost.policy("none"), cost.policy("discard")
    assert none.act_bytes - discard.act_bytes == pytest.approx(2 * (h + k * f) * tokens, rel=1e-9)
    assert discard.recompute_s == pytest.approx((4 * h + 10 * f * k) * tokens / (3350e9 * 0.90), rel=1e-9)
    assert discard.recompute_flops == 0.0


def test_discard_under_mla_also_frees_q_k_v_and_the_input_norms_output():
    """DeepSeek-V3 (MLA: q through rank 1536, 128 heads of q.k width 192 and v 128; h 7168; top-8 experts 2048 wide;
    3 dense blocks first): --recompute-modules layernorm moe_act mla_up_proj. Its input norm is a module of its own
    under MLA, and q_down keeps its output (kv_down shares it); the up-projections' q, k and v, which the attention
    core keeps, go; a dense block frees those two alone. The up-projections are redone: their forward FLOPs."""
    h, k, f, heads, qk, v, r_q, r_kv = 7168, 8, 2048, 128, 192, 128, 1536, 512
    q = heads * qk
    attention = h + 2 * q + heads * v            # q_down's input, and the core's q, k (as wide as q) and v
    dense, moe = _megatron_block("deepseek-v3", 0), _megatron_block("deepseek-v3", 3)
    tokens = 4096
    assert dense.policy("none").act_bytes - dense.policy("discard").act_bytes == \
        pytest.approx(2 * attention * tokens, rel=1e-9)
    assert moe.policy("none").act_bytes - moe.policy("discard").act_bytes == \
        pytest.approx(2 * (attention + h + k * f) * tokens, rel=1e-9)
    up = 2 * tokens * (r_q * q + r_kv * heads * (qk - 64 + v))     # q_up and kv_up (no-RoPE key and value)
    assert moe.policy("discard").recompute_flops == pytest.approx(up, rel=1e-9)
    assert dense.policy("discard").recompute_flops == pytest.approx(up, rel=1e-9)


def test_discard_is_none_where_a_block_has_nothing_to_discard():
    # Llama 3: TransformerEngine fuses both norms into the next linear, no experts, no MLA
    cost = _megatron_block("llama3-8b", 0)
    assert cost.policy("discard") == cost.policy("none") and cost.policy("discard").recompute_s == 0.0


def test_discard_under_delayed_scaling_is_refused_and_never_searched():
    """Megatron-Core refuses the moe_act and layernorm recompute modules under FP8 delayed scaling
    (transformer_config.py at core_v0.15.0): fixed, it is an error naming --recompute; searched, it is not offered."""
    from planner import api
    from planner.search.space import Space
    job = api.load_job("qwen3-30b-a3b", cluster="h100-80g", gpus=8, framework="megatron", precision="fp8-delayed")
    with pytest.raises(UserError) as caught:
        Space(job.graph, 8, job.workload, api.Knobs(recompute="discard"))
    assert caught.value.field == "--recompute" and "delayed scaling" in str(caught.value)
    assert "discard" not in Space(job.graph, 8, job.workload, api.Knobs()).recomputes()
    current = api.load_job("qwen3-30b-a3b", cluster="h100-80g", gpus=8, framework="megatron",
                           precision="fp8-tensorwise")
    assert "discard" in Space(current.graph, 8, current.workload, api.Knobs()).recomputes()
    # nor is a whole config taken with it (the bf16 plan's configs seed the FP8 recipes' searches: DeepSeek-V3 on
    # 1152 GB200 came out fp8-delayed with discard, from the bf16 plan's)
    from planner.config import ParallelConfig
    config = ParallelConfig(dp=8, tp=1, pp=1, zero=1, micro_batch=1, num_microbatches=job.workload.global_batch // 8,
                            recompute="discard")
    with pytest.raises(UserError, match="delayed scaling"):
        Space(job.graph, 8, job.workload, api.Knobs()).check(config)
    Space(current.graph, 8, current.workload, api.Knobs()).check(config)


def test_autocast_pipelines_send_the_fp32_residual_stream():
    """torch: a stage boundary carries the residual stream in its dtype, fp32 under autocast (ZeRO-1 beside a
    pipeline: no wrapper), bf16 under FSDP2's replicate (ZeRO-0); Megatron-LM sends bf16 whatever the stage."""
    from planner import network
    from planner.config import ParallelConfig, Workload
    from planner.cost.step import CostCache, stages_share_a_node
    cluster = load_cluster("h100-80g", 16)
    for framework, wide in (("torch", True), ("megatron", False)):
        cache = CostCache(LLAMA, cluster, Workload(global_batch=16, seq_len=8192, framework=framework))
        zero0, zero1 = (ParallelConfig(dp=2, tp=1, pp=8, micro_batch=1, zero=z) for z in (0, 1))
        hidden = 8192 * H
        same = stages_share_a_node(cluster, zero0)
        assert cache.hop_s(zero0) == pytest.approx(network.p2p_s(cluster, 2 * hidden, same_node=same))
        assert cache.hop_s(zero1) == pytest.approx(network.p2p_s(cluster, (4 if wide else 2) * hidden,
                                                                  same_node=same))
