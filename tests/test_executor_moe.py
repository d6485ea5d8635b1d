"""Mixtures of experts in the executor (executor/moe.py): the reference modules against the planner's
layer graph, the routing, expert parallelism on gloo against one process (losses and the first
step's gradients within 1e-4), each rank's model-state bytes against their closed form, and a
Mixtral-8x7B plan with ep 8 built at 64 ranks on the fake process group.

planner/runtimes.py lists mixtures of experts among what the executor does not build until the
planner's runtime table catches up; the tests lift that entry (``moe_built``), which is harmless once
it is gone.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_support import TINY_DEEPSEEK, TINY_MIXTRAL, moe_built
from planner.errors import UserError

MODELS = {"mixtral": TINY_MIXTRAL, "deepseek": TINY_DEEPSEEK}
STEPS = 3
# Qwen2-MoE's sigmoid gate on the shared experts, and a shared expert of its own width
TINY_QWEN2_MOE = replace(TINY_DEEPSEEK, name="tiny-qwen2-moe", dense_layers=0, shared_ffn_hidden=48,
                         shared_expert_gate=True)


@pytest.fixture(autouse=True)
def _moe_built():
    with moe_built():
        yield


# -- the modules, one process -----------------------------------------------------------------------

@pytest.mark.parametrize("spec", [TINY_MIXTRAL, TINY_DEEPSEEK, TINY_QWEN2_MOE], ids=lambda s: s.name)
def test_moe_models_have_the_planner_module_paths_and_parameter_count(spec):
    from executor.models import build_model
    from executor.moe import MoE
    from planner.layers import build_layer_graph
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    modules = dict(model.named_modules())
    with_params = [op.name for layer in build_layer_graph(spec).layers for op in layer.ops if op.params]
    assert [name for name in with_params if name not in modules] == []
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


@pytest.mark.parametrize("spec", [TINY_DEEPSEEK, TINY_QWEN2_MOE], ids=lambda s: s.name)
def test_a_moe_block_is_the_weighted_sum_of_its_experts_per_token(spec):
    """The grouped, sorted computation equals the definition token by token: sum_k w_k E_k(x) + shared(x)
    (times sigmoid(gate(x)) with Qwen2-MoE's gate)."""
    import torch.nn.functional as F
    from executor.models import full_init
    from executor.moe import MoE
    torch.manual_seed(0)
    moe = MoE(spec)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(full_init(f"layers.1.mlp.{name}", p.shape, spec, 0) * 10)    # sharper routing
    x = torch.randn(2, 5, spec.hidden)
    got = moe(x)
    for t, token in enumerate(x.reshape(-1, spec.hidden)):
        probs = F.softmax(moe.router(token), -1)
        top = probs.topk(spec.experts_per_token)
        want = moe.shared(token[None])[0] if moe.shared is not None else torch.zeros(spec.hidden)
        for w, e in zip(top.values / top.values.sum(), top.indices):
            gate, up, down = (m.weight[e] for m in (moe.gate_proj, moe.up_proj, moe.down_proj))
            want = want + w * (down @ (F.silu(gate @ token) * (up @ token)))
        torch.testing.assert_close(got.reshape(-1, spec.hidden)[t], want, rtol=1e-5, atol=1e-6)


# -- what the executor refuses with experts (exit 2, naming the plan.json field) --------------------

@pytest.mark.parametrize("knobs,field", [
    ({"dp": 2, "tp": 2, "ep": 2}, "config.tp"),                 # experts are not tensor-parallel
    ({"dp": 4, "tp": 2}, "config.tp"),                          # not even at ep 1
    ({"dp": 2, "ep": 4}, "config.ep"),                          # ep divides dp x cp
    ({"dp": 6, "ep": 3}, "config.ep"),                          # ep divides the experts
    ({"dp": 2, "ep": 2, "zero": 1}, "config.zero"),
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
