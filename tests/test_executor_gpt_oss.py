"""GPT-OSS in the executor (executor/models.py masked_attention and SinkAttention, executor/moe.py's biased,
clamped experts): the attention core, the experts and the router against transformers' own GPT-OSS modules on
the same weights (an implementation this project did not write), the model against the planner's layer graph,
selective recompute of the written-out core, and the model trained on gloo under tensor, context, expert and
pipeline parallelism against one process (losses and the first step's gradients within 1e-4)."""
from __future__ import annotations

import zlib
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from executor_support import TINY_LLAMA, reference_run
from moe_support import assert_equals_single_process, built_as_planned, trained_results

SEQ = 16
# GPT-OSS's block at tiny widths: biases on every linear, a learned sink per head, a window of 4 on every other
# block (the first slides), 8 biased experts (top 2) with the clamped SwiGLU
TINY_GPT_OSS = replace(TINY_LLAMA, name="tiny-gpt-oss", num_layers=2, hidden=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, ffn_hidden=64, vocab_size=64, linear_bias=True, num_experts=8, experts_per_token=2,
                       sliding_window=4, sliding_every=2, attention_sinks=True, swiglu_limit=7.0)
# the attention alone (sinks and windows) in a dense model, for tensor parallelism (the torch runtime splits no
# experts' GEMMs over tp)
TINY_SINKS = replace(TINY_LLAMA, name="tiny-sinks", sliding_window=4, sliding_every=2, attention_sinks=True)


def _hf():
    from transformers.models.gpt_oss import modeling_gpt_oss     # meshplan[hf], which CI installs
    return modeling_gpt_oss


# -- the modules against transformers' ------------------------------------------------------------------

@pytest.mark.parametrize("window", [0, 4], ids=["full", "window-4"])
def test_the_sink_attention_core_is_transformers_eager_gpt_oss_attention(window):
    """Forward and gradients (q, k, v and the sinks) of SinkAttention equal transformers' eager_attention_forward
    for GPT-OSS given the same additive mask (its sliding-window mask: key j visible to query i when i - W < j <= i)."""
    from executor.models import SinkAttention, visible
    hf = _hf()
    torch.manual_seed(0)
    b, heads, kv_heads, seq, hd = 2, 4, 2, 12, 8
    q = torch.randn(b, heads, seq, hd, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, seq, hd, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, seq, hd, dtype=torch.float64, requires_grad=True)
    core = SinkAttention(heads).double()
    with torch.no_grad():
        core.sinks.copy_(torch.randn(heads))
    allowed = visible(torch.arange(seq), seq, window)
    got = core(q, k, v, 0.0, allowed)
    i = torch.arange(seq)
    ok = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
    mask = torch.zeros(seq, seq, dtype=torch.float64).masked_fill(~ok, float("-inf"))[None, None]
    module = SimpleNamespace(sinks=core.sinks, num_key_value_groups=heads // kv_heads, training=False)
    want, _ = hf.eager_attention_forward(module, q, k, v, mask, scaling=hd ** -0.5)
    torch.testing.assert_close(got, want.transpose(1, 2))          # transformers returns (B, S, nh, hd)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v, core.sinks))
    wants = torch.autograd.grad(want.square().sum(), (q, k, v, core.sinks))
    for name, g, w in zip("q k v sinks".split(), grads, wants):
        torch.testing.assert_close(g, w, msg=lambda m: f"{name}: {m}")


def test_the_experts_are_transformers_gpt_oss_experts_and_route_as_its_router():
    """The clamped SwiGLU experts with biases (at a limit the activations reach, so the clamps act) and the router
    (top-k of the logits, softmax over them) against transformers' GptOssExperts and GptOssTopKRouter holding
    the same weights (its gate and up projections interleaved in one tensor, each (in, out))."""
    from executor.moe import MoE
    hf = _hf()
    from transformers import GptOssConfig
    torch.manual_seed(1)
    limit = 0.05
    spec = replace(TINY_GPT_OSS, swiglu_limit=limit)
    moe = MoE(spec).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    e, h, f = spec.num_experts, spec.hidden, spec.expert_ffn
    config = GptOssConfig(hidden_size=h, intermediate_size=f, num_local_experts=e, num_experts_per_tok=2,
                          swiglu_limit=limit)
    experts, router = hf.GptOssExperts(config).double(), hf.GptOssTopKRouter(config).double()
    with torch.no_grad():
        gate_up = torch.empty(e, h, 2 * f, dtype=torch.float64)
        gate_up[..., ::2], gate_up[..., 1::2] = moe.gate_proj.weight.transpose(1, 2), moe.up_proj.weight.transpose(1, 2)
        experts.gate_up_proj.copy_(gate_up)
        bias = torch.empty(e, 2 * f, dtype=torch.float64)
        bias[:, ::2], bias[:, 1::2] = moe.gate_proj.bias, moe.up_proj.bias
        experts.gate_up_proj_bias.copy_(bias)
        experts.down_proj.copy_(moe.down_proj.weight.transpose(1, 2))
        experts.down_proj_bias.copy_(moe.down_proj.bias)
        router.weight.copy_(moe.router.weight)
        router.bias.copy_(moe.router.bias)
    x = (torch.randn(3, 5, h, dtype=torch.float64) * 3).requires_grad_()
    tokens = x.reshape(-1, h)
    _, scores, indices = router(tokens)
    want = experts(tokens, indices, scores)
    got = moe(x).reshape(-1, h)
    pre = torch.einsum("th,ehf->tef", tokens, experts.gate_up_proj) + experts.gate_up_proj_bias
    assert (pre[..., ::2] > limit).any() and (pre[..., 1::2].abs() > limit).any()      # the clamps act
    torch.testing.assert_close(got, want)
    # and the input's gradient (through the experts, the routing weights and the router) is transformers'
    weight = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad((got * weight).sum(), x)[0],
                               torch.autograd.grad((want * weight).sum(), x)[0])


def test_the_clamped_swiglu_keeps_its_inputs_only_and_has_autograds_gradients():
    """ClampedSwiGLU (executor/moe.py) against the activation written out with torch ops and differentiated by
    autograd, inputs on both sides of the clamps and on their bounds (where torch's clamp passes the gradient)."""
    from executor.moe import ClampedSwiGLU
    from planner.model import GPT_OSS_SWIGLU_ALPHA
    limit = 1.0
    gate = torch.cat([torch.randn(64, dtype=torch.float64) * 2, torch.tensor([limit, -limit], dtype=torch.float64)])
    up = torch.cat([torch.randn(64, dtype=torch.float64) * 2, torch.tensor([-limit, limit], dtype=torch.float64)])
    gate, up = gate.requires_grad_(), up.requires_grad_()
    g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
    want = (u + 1) * g * torch.sigmoid(g * GPT_OSS_SWIGLU_ALPHA)
    got = ClampedSwiGLU.apply(gate, up, limit)
    torch.testing.assert_close(got, want)
    saved = got.grad_fn.saved_tensors                          # nothing but the inputs kept for backward
    assert len(saved) == 2 and saved[0] is gate and saved[1] is up
    weight = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * weight).sum(), (gate, up)),
                    torch.autograd.grad((want * weight).sum(), (gate, up))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_kept_bytes_per_block_match_the_cost_model(policy):
    """What a GPT-OSS block keeps for backward (tests/held_bytes.py, by liveness), sliding and full, against the
    cost model's unfused core (as the torch runtime prices it: runtimes.unfused_core) within 10%."""
    from held_bytes import block_held_bytes

    from executor.models import build_model, sdpa
    from planner.cluster import load_cluster
    from planner.cost.layer import Context, layer_cost
    from planner.layers import build_layer_graph
    micro_batch = 2
    ctx = Context(micro_batch=micro_batch, seq_len=SEQ, tp=1, cp=1, sequence_parallel=False, precision="fp32",
                  attention="unfused", framework="torch", tp_comm_overlap=False)
    layers = build_layer_graph(TINY_GPT_OSS).layers
    torch.manual_seed(0)
    for index, block in build_model(TINY_GPT_OSS, "cpu").layers.items():
        for p in block.parameters():
            p.data.normal_(0, 0.1)
        kept, _ = block_held_bytes(block, policy, torch.randn(micro_batch, SEQ, TINY_GPT_OSS.hidden),
                                   attention_core=sdpa)
        want = layer_cost(layers[1 + int(index)], ctx, load_cluster("cpu-gloo")).policy(policy).act_bytes
        assert abs(kept - want) <= 0.10 * want, f"layers.{index} {policy}: kept {kept} B, predicted {want:.0f}"


def test_the_gpt_oss_model_has_the_planner_module_paths_and_parameter_count():
    model = built_as_planned(TINY_GPT_OSS)
    blocks = list(model.layers.values())
    assert [b.attn.window for b in blocks] == [4, 0]        # the first block slides, the second attends fully
    assert model.layers["0"].attn.core.sinks.shape == (TINY_GPT_OSS.num_heads,)
    assert model.layers["0"].mlp.gate_proj.bias.shape == (TINY_GPT_OSS.num_experts, TINY_GPT_OSS.ffn_hidden)
    built_as_planned(TINY_SINKS)


def test_under_context_parallelism_each_rank_sees_the_keys_of_its_queries_global_positions():
    """The mask of each CP rank's two query chunks (executor/models.py SequenceLayout) is the rows of one
    process's mask at those positions, the keys up to the chunk's last."""
    from executor.models import SequenceLayout, visible
    full = visible(torch.arange(SEQ), SEQ, 4)
    for rank in range(2):
        layout = SequenceLayout(cp=2, rank=rank)
        positions = layout.positions(SEQ // 2, "cpu")
        for first, end, keys in layout.query_blocks(SEQ // 2):
            rows = positions[first:end]
            assert torch.equal(visible(rows, keys, 4), full[rows, :keys])
            assert not full[rows, keys:].any()           # nothing visible beyond the keys the chunk is given


@pytest.mark.parametrize("index", [0, 1], ids=["sliding", "full"])
def test_selective_recompute_of_the_written_out_core_changes_nothing(index):
    """``selective`` checkpoints the block's own core (the SinkAttention module: its forward wrapped), which
    recomputes in backward: the block's output and every gradient are those without recompute."""
    from executor.activations import apply_policy
    from executor.models import Block, sdpa
    torch.manual_seed(2)
    blocks = []
    for policy in ("none", "selective"):
        block = Block(TINY_GPT_OSS, index)
        for name, p in block.named_parameters():
            p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1
        apply_policy(block, policy, attention_core=sdpa)
        blocks.append(block)
    x = torch.randn(2, SEQ, TINY_GPT_OSS.hidden, requires_grad=True)
    outs = [b(x) for b in blocks]
    torch.testing.assert_close(outs[0], outs[1])
    grads = [torch.autograd.grad(o.square().sum(), [x, *b.parameters()]) for o, b in zip(outs, blocks)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert blocks[1].attn.core.forward.func.__name__ == "checkpoint"


# -- trained on gloo against one process -------------------------------------------------------------------

STEPS = 3
# name -> (world size, plan knobs); dp is world / (pp cp) unless given
PLANS = {
    "tp2": (2, {"tp": 2, "dp": 1}),                                   # the sinks split with the heads
    "tp2-sp-cp2": (4, {"tp": 2, "cp": 2, "dp": 1, "sequence_parallel": True}),   # windows over CP's chunks
    "ep2": (2, {"ep": 2}),                                            # biased experts split over two ranks
    "cp2-ep2-zero3": (4, {"ep": 2, "cp": 2, "dp": 2, "zero": 3}),
    "pp2-ep2-selective": (4, {"ep": 2, "pp": 2, "schedule": "1f1b", "micro_batch": 2, "recompute": "selective"}),
}
CASES = [("sinks", "tp2"), ("sinks", "tp2-sp-cp2"), ("gpt-oss", "ep2"), ("gpt-oss", "cp2-ep2-zero3"),
         ("gpt-oss", "pp2-ep2-selective")]
SPECS = {"sinks": TINY_SINKS, "gpt-oss": TINY_GPT_OSS}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return trained_results(CASES, PLANS, SPECS, tmp_path_factory.mktemp("gpt-oss"), STEPS)


@pytest.fixture(scope="module")
def references():
    return {model: reference_run(spec, steps=STEPS) for model, spec in SPECS.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("model,plan", CASES)
def test_gpt_oss_losses_and_gradients_equal_single_process(results, references, model, plan):
    assert_equals_single_process(*results[model, plan], references[model])


@pytest.mark.distributed
@pytest.mark.parametrize("model,plan", [case for case in CASES if "pp" not in PLANS[case[1]][1]])
def test_model_state_bytes_per_rank_match_the_cost_model(results, model, plan):
    """Each rank's parameters, gradients and AdamW states (executor/measure.py) against the plan's prediction
    within 2%: the sinks split over tp with the heads, the experts' biases over ep with their weights."""
    measured, _ = results[model, plan]
    for rank in measured["memory_per_rank_bytes"]:
        want = measured["predicted"]["memory_per_stage_bytes"][rank["pp_rank"]]
        for key in ("params", "grads", "optimizer"):
            assert abs(rank[key] - want[key]) <= 0.02 * want[key], (
                f"rank {rank['rank']} {key}: measured {rank[key]} B, predicted {want[key]} B")


@pytest.mark.distributed
def test_gpt_oss_20b_with_its_heads_split_builds_as_planned_at_24_ranks():
    """The plan `meshplan plan --model gpt-oss-20b --cluster h100-80g --gpus 24` recommends (dp 6 x tp 4 with sequence
    parallelism, ep 8, ZeRO-1): each tp rank holds the sinks of its 16 of the 64 heads, as the dry run expects
    (it expected every head's until 2026-11-28 and failed every such plan)."""
    from planner import api
    from planner.config import ParallelConfig
    from planner.plan import Plan
    from executor.dryrun import dry_run
    job = api.load_job("gpt-oss-20b", "h100-80g", gpus=24, global_batch=24, seq_len=4096)
    config = ParallelConfig(dp=6, tp=4, pp=1, zero=1, micro_batch=1, num_microbatches=4, recompute="none", ep=8,
                            sequence_parallel=True)
    plan = Plan.from_json(api.fixed_plan(job, config).to_json(), "gpt-oss-20b-tp4.json")
    reports, _ = dry_run(plan)
    assert all(r.problems == [] and r.over_plan() == [] for r in reports), [r.problems[:3] for r in reports]
