"""Mixtures of experts in the executor (executor/moe.py): the reference modules against the planner's
layer graph, the routing, expert parallelism on gloo against one process (losses and the first
step's gradients within 1e-4), each rank's model-state bytes against their closed form, and a
Mixtral-8x7B plan with ep 8 built at 64 ranks on the fake process group.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from executor_support import assert_losses, reference_run, spawn
from moe_support import (GLOBAL_BATCH, TINY_DEEPSEEK, TINY_MIXTRAL, TINY_TWO_EXPERTS, assert_equals_single_process,
                         built_as_planned, trained_results, write_moe_plan)
from planner.errors import UserError

MODELS = {"mixtral": TINY_MIXTRAL, "deepseek": TINY_DEEPSEEK}
STEPS = 3
# Qwen2-MoE's sigmoid gate on the shared experts, a shared expert of its own width, and its router (softmax, the
# top-k weights not renormalised: its configs' norm_topk_prob false)
TINY_QWEN2_MOE = replace(TINY_DEEPSEEK, name="tiny-qwen2-moe", dense_layers=0, shared_ffn_hidden=48,
                         shared_expert_gate=True, router_scores="softmax", router_renormalize=False, router_groups=0,
                         router_groups_used=0, router_scale=1.0)
# Qwen3-MoE's block: Mixtral's routed experts and q and k normed per head (executor/models.py QKNorm)
TINY_QWEN3_MOE = replace(TINY_MIXTRAL, name="tiny-qwen3-moe", qk_norm=True)


# -- the modules, one process -----------------------------------------------------------------------

@pytest.mark.parametrize("spec", [TINY_MIXTRAL, TINY_DEEPSEEK, TINY_QWEN2_MOE, TINY_QWEN3_MOE], ids=lambda s: s.name)
def test_moe_models_have_the_planner_module_paths_and_parameter_count(spec):
    from executor.moe import MoE
    model = built_as_planned(spec)
    assert [i for i, block in enumerate(model.layers.values()) if isinstance(block.mlp, MoE)] == \
        [i for i in range(spec.num_layers) if spec.is_moe_block(i)]
    # one (E, out, in) weight per projection of the routed experts
    moe = model.layers[str(spec.num_layers - 1)].mlp
    assert moe.gate_proj.weight.shape == (spec.num_experts, spec.expert_ffn, spec.hidden)
    assert moe.down_proj.weight.shape == (spec.num_experts, spec.hidden, spec.expert_ffn)


def test_routing_is_a_renormalised_softmax_top_k():
    """Mixtral's router (HF transformers MixtralSparseMoeBlock): softmax, top-k, weights summing to 1."""
    from executor.moe import route
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 1.0]])
    weights, experts = route(logits, 2)
    assert experts.tolist() == [[3, 2], [0, 3]]
    e = torch.exp(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(weights[0], e / e.sum())
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


@pytest.mark.parametrize("groups,used", [(8, 4), (1, 1)], ids=["deepseek-v3-groups", "kimi-k2-no-groups"])
def test_sigmoid_group_limited_routing_is_transformers_deepseek_v3_router(groups, used):
    """DeepSeek-V3's router (and Kimi K2's, one group) as transformers' DeepseekV3TopkRouter routes, on the same
    weight: the same experts for every token and the same weights (sigmoid scores of the chosen, renormalised, times
    the scaling factor), its expert bias zero."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from executor.moe import route
    torch.manual_seed(3)
    h, experts, k, scale = 16, 32, 8, 2.5
    config = DeepseekV3Config(hidden_size=h, n_routed_experts=experts, num_experts_per_tok=k, n_group=groups,
                              topk_group=used, routed_scaling_factor=scale, norm_topk_prob=True)
    hf = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(experts, h))
    x = torch.randn(64, h)
    _, want_weights, want_experts = hf(x)
    weights, chosen = route(x @ hf.weight.T, k, scores="sigmoid", groups=groups if groups > 1 else 0,
                            groups_used=used if groups > 1 else 0, scale=scale)
    order, want_order = chosen.argsort(dim=-1), want_experts.argsort(dim=-1)
    assert torch.equal(chosen.gather(1, order), want_experts.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))
    # each token's experts lie in at most `used` of the groups
    assert max(len(set((row // (experts // groups)).tolist())) for row in chosen) <= used


def test_the_balancing_bias_chooses_the_experts_as_transformers_e_score_correction_bias_does():
    """DeepSeek-V3's bias (transformers' DeepseekV3TopkRouter.e_score_correction_bias) added to the scores that
    choose groups and experts, not to the weights."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from executor.moe import route
    torch.manual_seed(4)
    h, experts, k = 16, 32, 8
    hf = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=h, n_routed_experts=experts, num_experts_per_tok=k,
                                               n_group=8, topk_group=4, routed_scaling_factor=2.5))
    with torch.no_grad():
        hf.weight.copy_(torch.randn(experts, h))
        hf.e_score_correction_bias.copy_(torch.randn(experts) * 0.3)
    x = torch.randn(64, h)
    _, want_weights, want_experts = hf(x)
    weights, chosen = route(x @ hf.weight.T, k, scores="sigmoid", groups=8, groups_used=4, scale=2.5,
                            bias=hf.e_score_correction_bias)
    unbiased = route(x @ hf.weight.T, k, scores="sigmoid", groups=8, groups_used=4, scale=2.5)[1]
    assert not torch.equal(chosen.sort(dim=-1).values, unbiased.sort(dim=-1).values)     # the bias changed choices
    order, want_order = chosen.argsort(dim=-1), want_experts.argsort(dim=-1)
    assert torch.equal(chosen.gather(1, order), want_experts.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))


def test_the_balancing_bias_moves_toward_the_mean_load():
    """After a step, each expert's bias moves by the rate: up where it got fewer tokens than the mean, down where
    more, not where as many (DeepSeek-V3 Sec 2.1.2); the counts start again."""
    from executor.moe import MoE, update_expert_bias
    moe = MoE(replace(TINY_DEEPSEEK, num_experts=4, router_groups=2, router_groups_used=1, router_bias_rate=0.25))
    moe.tokens_per_expert.copy_(torch.tensor([3.0, 1.0, 2.0, 2.0]))
    update_expert_bias([moe])
    assert moe.expert_bias.tolist() == [-0.25, 0.25, 0.0, 0.0] and moe.tokens_per_expert.tolist() == [0.0] * 4


def _save_after(plan_path: str, steps: int, save: str) -> None:
    from executor.plan_file import load_plan
    from executor.train import RunOptions, run
    run(load_plan(plan_path), RunOptions(steps=steps, save_dir=save))


@pytest.mark.distributed
def test_the_balancing_bias_of_four_ranks_is_one_processs(tmp_path):
    """With the experts split over 2 ep ranks of 4 data-parallel ones, every rank counts its own tokens; summed
    over the 4 before each update, the biases after 3 steps (from the checkpoint) equal one process's, and they
    moved. (The losses alone would not show it: a few steps of bias move a tiny model's loss by about 1e-5.)"""
    from executor.checkpoint import load
    from executor.models import build_model, full_init
    from executor_support import adamw_steps, batch_loss
    spec = replace(TINY_DEEPSEEK, router_bias_rate=0.05)
    plan = write_moe_plan(tmp_path / "plan.json", spec, gpus=4, ep=2, zero=1)
    spawn(_save_after, 4, plan, 3, str(tmp_path / "ckpt"))
    saved = build_model(spec, "cpu")
    load(str(tmp_path / "ckpt"), [saved], [torch.optim.AdamW(saved.parameters())], tied=False)
    torch.manual_seed(0)
    reference = build_model(spec, "cpu")
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(full_init(name, p.shape, spec, 0))
    adamw_steps(reference, lambda step: batch_loss(reference, spec, step), steps=3)
    got, want = dict(saved.named_buffers()), dict(reference.named_buffers())
    biases = [name for name in want if name.endswith("expert_bias")]
    assert biases and any(want[name].abs().sum() > 0 for name in biases)
    for name in biases:
        torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{name}: {m}")


def test_qwen2_moe_routing_keeps_the_softmax_weights_of_its_top_k():
    """Qwen2-MoE with norm_topk_prob false (transformers' Qwen2MoeSparseMoeBlock): the softmax over every expert, its
    top-k weights as they are."""
    from executor.moe import route
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, experts = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)[0]
    assert experts.tolist() == [[3, 2]]
    torch.testing.assert_close(weights[0], probs[[3, 2]])


@pytest.mark.parametrize("spec", [TINY_DEEPSEEK, TINY_QWEN2_MOE], ids=lambda s: s.name)
def test_a_moe_block_is_the_weighted_sum_of_its_experts_per_token(spec):
    """The grouped, sorted computation equals the definition token by token: sum_k w_k E_k(x) + shared(x)
    (times sigmoid(gate(x)) with Qwen2-MoE's gate), each token's weights its router's (``route``, checked against
    transformers' above)."""
    import torch.nn.functional as F
    from executor.models import full_init
    from executor.moe import MoE, route
    torch.manual_seed(0)
    moe = MoE(spec)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(full_init(f"layers.1.mlp.{name}", p.shape, spec, 0) * 10)    # sharper routing
    x = torch.randn(2, 5, spec.hidden)
    got = moe(x)
    for t, token in enumerate(x.reshape(-1, spec.hidden)):
        weights, chosen = route(moe.router(token)[None], spec.experts_per_token, **moe.routing)
        want = moe.shared(token[None])[0] if moe.shared is not None else torch.zeros(spec.hidden)
        for w, e in zip(weights[0], chosen[0]):
            gate, up, down = (m.weight[e] for m in (moe.gate_proj, moe.up_proj, moe.down_proj))
            want = want + w * (down @ (F.silu(gate @ token) * (up @ token)))
        torch.testing.assert_close(got.reshape(-1, spec.hidden)[t], want, rtol=1e-5, atol=1e-6)


def test_the_grouped_gemm_and_the_loop_over_experts_agree():
    """The device path (one torch._grouped_mm, which torch 2.13 also runs on the CPU) and the CPU's loop
    give the same products and gradients, an expert without rows included."""
    from executor.moe import grouped_product
    torch.manual_seed(0)
    counts = [3, 0, 5, 2]
    x = torch.randn(sum(counts), 16, requires_grad=True)
    w = torch.randn(4, 24, 16, requires_grad=True)
    outs, grads = [], []
    for grouped in (True, False):
        y = grouped_product(x, w, counts, grouped)
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append((x.grad.clone(), w.grad.clone()))
        x.grad, w.grad = None, None
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_the_experts_backward_writes_their_stacked_gradient_a_constant_number_of_times(grouped, monkeypatch):
    """Under autocast with fp32 weights (ZeRO-0 on a GPU), the backward of 16 experts writes tensors of the
    whole stacked weight's shape a few times (the product's or the stack's, the cast's), not twice per expert: indexing
    the stack per expert (``w[e]``) made every expert's backward zero and add a gradient of the whole stack,
    which on an H200 took 38 ms of a 32-expert model's 0.2 s step. The input arrives in fp32, as the
    residual stream does, and the experts compute in bf16 (so the grouped GEMM runs where it can)."""
    import executor.moe as moe
    from torch.utils._python_dispatch import TorchDispatchMode
    experts, counts = 16, [3, 0, 5, 2, 1, 4, 0, 2, 3, 1, 2, 0, 6, 1, 2, 3]
    layer = moe.GroupedLinear(experts, 16, 24)                      # weight (16, 24, 16)
    torch.nn.init.normal_(layer.weight, std=0.1)
    x = torch.randn(sum(counts), 16, requires_grad=True)
    monkeypatch.setattr(moe, "_runs_grouped_mm", lambda t: grouped and t.dtype == torch.bfloat16)
    seen = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.is_view or func is torch.ops.aten.detach.default:
                return out                                          # no tensor of its own
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(layer.weight.shape):
                    seen.append(str(func))
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, counts)
    assert y.dtype == torch.bfloat16
    with Shapes():
        y.float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32
    assert len(seen) <= 3, seen                                     # was 2 per expert: 32 here


def test_without_expert_parallelism_the_grouped_path_reads_nothing_back_to_the_host(monkeypatch):
    """Where the experts run as one grouped GEMM and stay on this rank, a MoE block's forward and backward read
    no value back to the host (no ``.item()``, ``.tolist()`` or ``torch.bincount``, which on a GPU reads the
    largest index back): each such read waits for the GPU to finish everything queued, so the GPU would drain
    at every MoE layer (round 2's MoE rows on an H200 ran closer to the sum of host and kernel time than to the
    larger, docs/validation.md)."""
    import executor.moe as moe
    from executor.models import build_model
    from torch.utils._python_dispatch import TorchDispatchMode
    torch.manual_seed(0)
    model = build_model(TINY_MIXTRAL, device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, TINY_MIXTRAL.vocab_size, (2, 16))
    monkeypatch.setattr(moe, "_runs_grouped_mm", lambda x: x.dtype == torch.bfloat16)
    block = next(iter(moe.moe_blocks(model).values()))
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append("tolist") or tolist(self))

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.bincount.default):
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 16, TINY_MIXTRAL.hidden, requires_grad=True)
    with Reads(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    with Reads():
        y.float().sum().backward()
    assert reads == []
    assert x.grad is not None and block.gate_proj.weight.grad is not None


@pytest.mark.parametrize("spec", [TINY_MIXTRAL, TINY_DEEPSEEK], ids=lambda s: s.name)
def test_a_moe_model_trains_under_bf16_autocast_on_the_grouped_path(spec, monkeypatch):
    """As the executor runs a ZeRO-0 plan on a GPU: fp32 parameters under bf16 autocast, the experts
    as one torch._grouped_mm, which autocast does not cover (it failed on an H200 in round 2 of the
    GPU validation before the weights were cast). Forced here on the CPU, where torch 2.13 runs it:
    the output is bf16, as a dense block's under autocast, and equals the loop over experts."""
    import executor.moe as moe
    from executor.models import build_model
    torch.manual_seed(0)
    model = build_model(spec, device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, spec.vocab_size, (2, 16))
    outs = []
    for grouped in (True, False):
        monkeypatch.setattr(moe, "_runs_grouped_mm", lambda x, g=grouped: g and x.dtype == torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids)
        out.float().sum().backward()
        assert out.dtype == torch.bfloat16
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
        model.zero_grad(set_to_none=True)
        outs.append(out.detach().float())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


# -- what the executor refuses with experts (exit 2, naming the plan.json field) --------------------

@pytest.mark.parametrize("knobs,field", [
    ({"dp": 2, "tp": 2, "ep": 2}, "config.sequence_parallel"),  # beside tp each rank routes its share of the sequence
    ({"dp": 4, "tp": 2, "sequence_parallel": True}, "config.ep"),   # experts are not split over the tp ranks: ep > 1
    ({"dp": 2, "ep": 4}, "config.ep"),                          # ep divides dp x cp x tp
    ({"dp": 6, "ep": 3}, "config.ep"),                          # ep divides the experts
    ({"dp": 2, "ep": 2, "recompute": "op"}, "config.recompute"),
])
def test_the_executor_refuses_what_it_does_not_run_with_experts(knobs, field):
    from executor.support import check_supported
    from planner.config import ParallelConfig
    config = ParallelConfig(**{"tp": 1, "pp": 1, **knobs})
    with pytest.raises(UserError) as e:
        check_supported(config, TINY_MIXTRAL, "cpu", "plan.json")
    assert e.value.field == field and e.value.exit_code == 2


def test_ep_on_a_dense_model_is_refused():
    from executor.support import check_supported
    from executor_support import TINY_LLAMA
    from planner.config import ParallelConfig
    with pytest.raises(UserError) as e:
        check_supported(ParallelConfig(dp=2, tp=1, pp=1, ep=2), TINY_LLAMA, "cpu", "plan.json")
    assert e.value.field == "config.ep"


# -- expert parallelism on gloo against one process -------------------------------------------------

# name -> (world size, plan knobs); dp is world / (pp cp) unless given
PLANS = {
    "ep2": (2, {"ep": 2}),                                      # replicate (ZeRO-0), one rank per expert group
    "ep2-zero3": (2, {"ep": 2, "zero": 3}),                     # FSDP2 over efsdp = 1
    "ep2-zero3-full-recompute": (2, {"ep": 2, "zero": 3, "recompute": "full"}),   # the all-to-alls recomputed
    "dp4-ep2": (4, {"ep": 2}),                                  # experts replicated over efsdp = 2
    "dp4-ep2-zero1": (4, {"ep": 2, "zero": 1}),                 # AdamW states of the experts over efsdp = 2
    "dp4-ep2-zero2": (4, {"ep": 2, "zero": 2}),                 # experts sharded over efsdp = 2
    "dp4-ep2-zero3": (4, {"ep": 2, "zero": 3}),
    "ep4": (4, {"ep": 4}),
    "pp2-ep2-zero2": (4, {"ep": 2, "pp": 2, "zero": 2, "schedule": "1f1b", "micro_batch": 2}),
    "cp2-ep2-zero3": (4, {"ep": 2, "cp": 2, "dp": 2, "zero": 3}),     # experts folded over dp x cp
    # tensor parallelism as torchtitan runs it beside experts: each tp rank routes its share of the sequence, the
    # experts whole over ep ranks that include the tp ranks (dp x tp = efsdp x ep), the router replicated
    "tp2-ep2": (2, {"ep": 2, "tp": 2, "dp": 1, "sequence_parallel": True}),
    "dp2-tp2-ep4-zero3": (4, {"ep": 4, "tp": 2, "dp": 2, "zero": 3, "sequence_parallel": True}),
    "dp2-tp2-ep2-zero1": (4, {"ep": 2, "tp": 2, "dp": 2, "zero": 1, "sequence_parallel": True}),
    # the shared experts whole on each tp rank, as a plan.json edited to leave them so (the planner splits them as a
    # dense MLP, Qwen2-MoE's gate beside them row-parallel)
    "tp2-ep2-whole-shared": (2, {"ep": 2, "tp": 2, "dp": 1, "sequence_parallel": True, "whole_shared": True}),
    # without expert parallelism: the stack of all experts sharded over the data-parallel ranks (two experts over
    # four: along their rows, dim 1, as FSDP2 and ZeRO-1 do for split experts; along dim 0 two ranks held none)
    "dp4-zero3": (4, {"zero": 3}),
    "dp4-zero1": (4, {"zero": 1}),
}


# and with one expert per rank, fewer than the efsdp ranks: sharded along dim 1 (FSDP2 and ZeRO-1 alike)
ONE_EXPERT_PER_RANK = ["dp4-ep2-zero1", "dp4-ep2-zero3"]
# variations of a path both models take already run on one model (the file stays near a minute on 2 cores)
ONE_MODEL = {"ep2-zero3-full-recompute": "deepseek", "dp4-ep2": "deepseek", "dp4-ep2-zero2": "mixtral",
             "cp2-ep2-zero3": "deepseek", "dp2-tp2-ep4-zero3": "mixtral", "dp2-tp2-ep2-zero1": "deepseek"}
OTHERS = {"tp2-ep2-whole-shared"}      # Qwen2-MoE's alone (below; its states are not the plan's estimate's)
BOTH = [(model, plan) for plan in PLANS for model in MODELS
        if ONE_MODEL.get(plan, model) == model and plan not in OTHERS and plan not in ("dp4-zero3", "dp4-zero1")]
# and Qwen3-MoE's per-head q/k norms beside experts split over two ranks (and beside tp), Qwen2-MoE's gated shared
# expert beside tp
STACKS = [("two-experts", "dp4-zero3"), ("two-experts", "dp4-zero1")]
CASES = BOTH + [("two-experts", p) for p in ONE_EXPERT_PER_RANK] + STACKS + [
    ("qwen3-moe", "dp4-ep2-zero3"), ("qwen3-moe", "tp2-ep2"), ("qwen2-moe", "tp2-ep2"),
    ("qwen2-moe", "tp2-ep2-whole-shared")]
SPECS = {**MODELS, "two-experts": TINY_TWO_EXPERTS, "qwen3-moe": TINY_QWEN3_MOE, "qwen2-moe": TINY_QWEN2_MOE}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return trained_results(CASES, PLANS, SPECS, tmp_path_factory.mktemp("moe"), STEPS)


@pytest.fixture(scope="module")
def references():
    return {model: reference_run(spec, steps=STEPS) for model, spec in SPECS.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("model,plan", CASES)
def test_expert_parallel_losses_and_gradients_equal_single_process(results, references, model, plan):
    assert_equals_single_process(*results[model, plan], references[model])


@pytest.mark.distributed
def test_the_losses_move_and_the_routing_is_uneven(references):
    """The comparison means something: three steps change the loss, and experts get unequal numbers of
    tokens (uneven all-to-all splits)."""
    from executor.models import build_model, full_init
    for model, (losses, _) in references.items():
        assert len(set(round(x, 6) for x in losses)) == STEPS, (model, losses)
    spec = TINY_MIXTRAL
    model = build_model(spec, "cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full_init(name, p.shape, spec, 0))
    x = model.embed(torch.randint(0, spec.vocab_size, (GLOBAL_BATCH, spec.seq_len)))
    logits = model.layers["0"].mlp.router(model.layers["0"].mlp_norm(x))
    counts = torch.bincount(logits.topk(2).indices.flatten(), minlength=spec.num_experts)
    assert counts.min() < counts.max(), counts


def _closed_form(spec, knobs: dict, world: int) -> dict[str, int]:
    """fp32 parameter, gradient and AdamW bytes per rank (no pipeline): the routed experts' weights
    (3 h f per expert, E/ep experts per rank in each MoE block), sharded over efsdp = dp cp / ep, every
    other parameter over dp cp: the optimizer states from ZeRO-1, the gradients and parameters from
    ZeRO-2; AdamW keeps two fp32 moments per element and a 4-byte step count per tensor."""
    from executor.models import build_model
    ep, zero = knobs.get("ep", 1), knobs.get("zero", 0)
    ranks = world                                  # dp x cp (tp 1, pp 1)
    moe_blocks = sum(spec.is_moe_block(i) for i in range(spec.num_layers))
    experts = moe_blocks * spec.num_experts * 3 * spec.hidden * spec.expert_ffn
    dense = spec.num_params() - experts

    def local(sharded: bool) -> int:
        return dense // (ranks if sharded else 1) + experts // ep // (ranks // ep if sharded else 1)

    tensors = len(list(build_model(spec).parameters()))
    return {"params": 4 * local(zero >= 2), "grads": 4 * local(zero >= 2),
            "optimizer": 8 * local(zero >= 1) + 4 * tensors}


@pytest.mark.distributed
@pytest.mark.parametrize("model,plan", [(model, plan) for model, plan in BOTH
                                        if "pp" not in PLANS[plan][1] and "tp" not in PLANS[plan][1]])
def test_model_state_bytes_per_rank_are_the_closed_form(results, model, plan):
    """Each rank's parameters, gradients and optimizer states as executor/measure.py counts them equal
    the closed form exactly (the tiny models' tensors divide evenly: no padding)."""
    measured, _ = results[model, plan]
    world, knobs = PLANS[plan]
    want = _closed_form(MODELS[model], knobs, world)
    for rank in measured["memory_per_rank_bytes"]:
        got = {key: rank[key] for key in want}
        assert got == want, f"rank {rank['rank']}: measured {got}, closed form {want}"


# Under a pipeline the data-parallel wrappers defer the gradient sync to the last micro-batch
# (planner/runtimes.py pp_defers_sharded_dp_sync): their accumulators are measured at their peak,
# checked within 10% as tests/test_executor_plans.py does. executor/train.py samples them at the end
# of each forward, and under 1F1B with two micro-batches the first pipeline rank runs both forwards
# before its first backward: it never shows its FSDP accumulators (measured: the sharded gradients,
# 94,976 B against 140,800 B predicted for the DeepSeek-style model at ZeRO-2), so the first rank's
# gradients are not checked there.
DEFERRED_GRADS_TOLERANCE = 0.10


@pytest.mark.distributed
@pytest.mark.parametrize("model,plan", BOTH + STACKS)
def test_model_state_bytes_per_rank_match_the_cost_model(results, model, plan):
    """The same bytes against the plan's prediction for the rank's pipeline stage (planner/cost: the
    experts' states over efsdp), within 2% (AdamW's step counts are not predicted); ZeRO-2's gathered
    parameters counted with the parameters, as the cost model does. Without expert parallelism, two experts
    over four ranks: each rank a quarter of each expert (along dim 0 the first two ranks held half each)."""
    measured, _ = results[model, plan]
    _, knobs = PLANS[plan]
    zero, deferred = knobs.get("zero", 0), knobs.get("pp", 1) > 1
    for rank in measured["memory_per_rank_bytes"]:
        want = measured["predicted"]["memory_per_stage_bytes"][rank["pp_rank"]]
        got = {"params": rank["params"] + (rank["params_gathered"] if zero == 2 else 0),
               "grads": rank["grads"], "optimizer": rank["optimizer"]}
        for key, value in got.items():
            if deferred and zero >= 2 and key == "grads" and rank["pp_rank"] == 0:
                continue
            tolerance = DEFERRED_GRADS_TOLERANCE if deferred and key == "grads" else 0.02
            assert abs(value - want[key]) <= tolerance * want[key], (
                f"rank {rank['rank']} {key}: measured {value} B, predicted {want[key]} B")


# -- Mixtral 8x7B with ep 8 at 64 ranks, built on the fake process group ----------------------------

def _mixtral_plan(ep: int = 8, zero: int = 3, tp: int = 1):
    from planner import api
    from planner.cluster import load_cluster
    from planner.config import ParallelConfig, Workload
    from planner.layers import build_layer_graph
    from planner.model import ZOO
    from planner.plan import Plan
    spec = ZOO["mixtral-8x7b"]
    job = api.Job(model_source="mixtral-8x7b", spec=spec, graph=build_layer_graph(spec),
                  cluster=load_cluster("h100-80g", 64), workload=Workload(global_batch=64, seq_len=4096))
    config = ParallelConfig(dp=32 // tp, tp=tp, pp=2, zero=zero, micro_batch=1, num_microbatches=2 * tp,
                            schedule="1f1b", recompute="full", ep=ep, sequence_parallel=tp > 1)
    return Plan.from_json(api.fixed_plan(job, config).to_json(), "mixtral-8x7b-ep8.json")


@pytest.mark.distributed
def test_a_mixtral_8x7b_plan_with_ep_8_builds_at_64_ranks_as_planned():
    """pp 2 x dp 32 at ZeRO-3, ep 8: each rank holds one expert per block (E/ep = 8/8) of the blocks of
    its stage, FSDP-sharded over the efsdp = 32/8 = 4 ranks holding the same expert, along dim 1 (one
    local expert does not split four ways): a (1, 3584, 4096) shard of each gate and up weight; every
    placement and shard shape as executor/dryrun.py computes it from the plan."""
    from executor.dryrun import dry_run, expected_shards
    from executor.mesh import ParallelDims
    plan = _mixtral_plan()
    reports, seconds = dry_run(plan)
    assert seconds < 60
    assert {(r.pp_rank, r.coordinates["efsdp"], r.coordinates["ep"]) for r in reports} == \
        {(0, 0, 0), (1, 0, 0), (0, 3, 7), (1, 3, 7)}
    for r in reports:
        assert r.problems == [], r.problems[:5]
    dims = ParallelDims.from_config(plan.config, 64)
    h, f = 4096, 14336
    assert expected_shards("layers.3.mlp.gate_proj.weight", torch.Size([8, f, h]), plan, dims,
                           {"dp_cp": 31, "tp": 0, "efsdp": 3, "ep": 7}) == ({"ep": 0, "efsdp": 1}, (1, f // 4, h))
    assert expected_shards("layers.3.mlp.down_proj.weight", torch.Size([8, h, f]), plan, dims,
                           {"dp_cp": 0, "tp": 0, "efsdp": 0, "ep": 0}) == ({"ep": 0, "efsdp": 1}, (1, h // 4, f))
    # parameter bytes of a stage: its 16 blocks' experts / (ep x efsdp) and the rest / dp, fp32
    spec = plan.spec
    blocks = [int(path.split(".")[1]) for path in plan.stages[0] if path.startswith("layers.")]
    experts = len(blocks) * spec.num_experts * 3 * h * f
    first = next(r for r in reports if r.pp_rank == 0 and r.coordinates["dp_cp"] == 0)
    stage_params = sum(spec.block_params(i) for i in blocks) + spec.embedding_params()
    want = 4 * ((stage_params - experts) / 32 + experts / (8 * 4))
    assert abs(first.params_bytes - want) <= 1e-3 * want, (first.params_bytes, want)
    assert first.optimizer_bytes == pytest.approx(2 * want, rel=1e-3)


@pytest.mark.distributed
def test_zero1_shards_the_experts_adamw_states_over_their_efsdp_ranks_at_64_ranks():
    """ZeRO-1 with ep 8: each rank keeps its stage's parameters whole but for the experts (one of 8 per
    block), and owns a quarter of its local expert's AdamW rows (efsdp 4) and a 32nd of every other
    tensor's (executor/dryrun.py checks the rows each rank owns)."""
    from executor.dryrun import dry_run
    plan = _mixtral_plan(zero=1)
    reports, _ = dry_run(plan)
    assert all(r.problems == [] for r in reports), [r.problems[:3] for r in reports]
    spec, h, f = plan.spec, 4096, 14336
    blocks = [int(path.split(".")[1]) for path in plan.stages[0] if path.startswith("layers.")]
    experts = len(blocks) * spec.num_experts * 3 * h * f
    dense = sum(spec.block_params(i) for i in blocks) + spec.embedding_params() - experts
    first = next(r for r in reports if r.pp_rank == 0 and r.coordinates["dp_cp"] == 0)
    assert first.params_bytes == 4 * (dense + experts // 8)
    assert first.optimizer_bytes == pytest.approx(8 * (dense / 32 + experts / 32), rel=1e-3)


@pytest.mark.distributed
def test_with_tp_2_the_experts_fold_over_the_tensor_parallel_ranks_at_64_ranks():
    """pp 2 x dp 16 x tp 2 with sequence parallelism, ep 8, ZeRO-1: the expert region of a stage is its dp x tp = 32
    ranks, efsdp = 32 / 8 = 4; the two tp ranks of a pair hold different experts (ep ranks innermost, the tp ranks
    among them), each expert whole (not split over tp), and own a quarter of its AdamW rows."""
    from executor.dryrun import dry_run, expected_shards
    from executor.mesh import ParallelDims
    plan = _mixtral_plan(zero=1, tp=2)
    reports, _ = dry_run(plan)
    assert all(r.problems == [] for r in reports), [r.problems[:3] for r in reports]
    dims = ParallelDims.from_config(plan.config, 64)
    assert (dims.efsdp, dims.ep) == (4, 8)
    h, f = 4096, 14336
    for coords in ({"dp_cp": 0, "tp": 0, "efsdp": 0, "ep": 0}, {"dp_cp": 0, "tp": 1, "efsdp": 0, "ep": 1}):
        assert expected_shards("layers.3.mlp.gate_proj.weight", torch.Size([8, f, h]), plan, dims, coords) == \
            ({"ep": 0}, (1, f, h))
    assert {(r.coordinates["tp"], r.coordinates["ep"] % 2) for r in reports} == {(0, 0), (1, 1)}


@pytest.mark.distributed
def test_without_ep_a_mixtral_plan_replicates_its_experts_over_the_data_parallel_ranks():
    from executor.dryrun import dry_run
    reports, _ = dry_run(_mixtral_plan(ep=1))
    assert all(r.problems == [] for r in reports)
    assert all("ep" not in r.coordinates for r in reports)


@pytest.mark.distributed
def test_qwen3_30b_a3b_on_a_whole_nvl72_rack_builds_with_its_uneven_expert_shards_priced():
    """dp 72, ep 8, ZeRO-2 (the plan `meshplan plan --model qwen3-30b-a3b --cluster gb200-nvl72 --gpus 72` recommends):
    16 experts a rank over efsdp 9, whose 768 and 2048 output features do not split 9 ways either. FSDP2 refuses an
    uneven shard but along dim 0 (this plan failed to build when the stacks went along dim 1), so each rank holds
    ceil(16 / 9) = 2 of them; the first rank's gradients and AdamW states are the cost model's within 1%."""
    from planner import api
    from planner.config import ParallelConfig
    from planner.plan import Plan
    from executor.dryrun import dry_run
    job = api.load_job("qwen3-30b-a3b", "gb200-nvl72", gpus=72, global_batch=288, seq_len=4096)
    config = ParallelConfig(dp=72, tp=1, pp=1, zero=2, micro_batch=2, num_microbatches=2, recompute="none", ep=8)
    plan = Plan.from_json(api.fixed_plan(job, config).to_json(), "qwen3-30b-a3b-nvl72.json")
    reports, _ = dry_run(plan)
    assert all(r.problems == [] for r in reports), [r.problems[:3] for r in reports]
    first = next(r for r in reports if r.coordinates["dp_cp"] == 0)
    assert first.grads_bytes == pytest.approx(first.predicted["grads"], rel=0.01)
    assert first.optimizer_bytes == pytest.approx(first.predicted["optimizer"], rel=0.01)
    # the last efsdp rank's chunk of the 16 is empty, but FSDP2 allocates its shard and reduced gradient padded to the
    # first's; AdamW's moments follow the unpadded shard
    last = next(r for r in reports if r.coordinates["dp_cp"] == 71)
    assert (last.params_bytes, last.grads_bytes) == (first.params_bytes, first.grads_bytes)
    assert last.optimizer_bytes < first.optimizer_bytes / 10



# -- checkpoints: experts saved under one ep, loaded under another ---------------------------------

def _train(plan_path: str, steps: int, load: str | None, save: str | None, out: str) -> None:
    from executor.plan_file import load_plan
    from executor.train import RunOptions, run
    measured = run(load_plan(plan_path), RunOptions(steps=steps, load_dir=load, save_dir=save))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(measured))


@pytest.mark.distributed
@pytest.mark.parametrize("saved,resumed", [
    # the experts split over 2 ep ranks and their ZeRO-1 states over 2 efsdp ranks along the expert's rows (one expert
    # per rank: DTensors Shard(1) x Shard(0) on the (efsdp, ep) mesh), resumed with every expert on every rank (ep 1,
    # ZeRO-2 over dp 2, FSDP2's Shard(0))
    ({"gpus": 4, "ep": 2, "zero": 1}, {"gpus": 2, "zero": 2}),
    # without expert parallelism at ZeRO-3 over 4 ranks, the stack of two experts sharded along an expert's rows
    # (FSDP2's Shard(1): two experts do not split four ways), resumed under ZeRO-1 over 2 (AdamW rows along the experts)
    ({"gpus": 4, "zero": 3}, {"gpus": 2, "zero": 1}),
], ids=["ep2-zero1-to-zero2", "stack-rows-zero3-to-zero1"])
def test_an_expert_checkpoint_resumes_under_another_sharding(tmp_path, saved, resumed):
    """Save after 2 steps under one sharding of the experts, resume 2 steps under another: the 4 losses equal an
    uninterrupted single-process run within 1e-4."""
    spec = TINY_TWO_EXPERTS
    plan_a = write_moe_plan(tmp_path / "a.plan.json", spec, **saved)
    plan_b = write_moe_plan(tmp_path / "b.plan.json", spec, **resumed)
    ckpt = str(tmp_path / "ckpt")
    spawn(_train, saved["gpus"], plan_a, 2, None, ckpt, str(tmp_path / "a.json"))
    spawn(_train, resumed["gpus"], plan_b, 2, ckpt, None, str(tmp_path / "b.json"))
    first = json.loads((tmp_path / "a.json").read_text())
    second = json.loads((tmp_path / "b.json").read_text())
    assert second["first_step"] == 2
    uninterrupted, _ = reference_run(spec, steps=4)
    assert_losses(first["losses"] + second["losses"], uninterrupted)
