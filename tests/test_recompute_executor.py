"""Every recompute policy as the executor runs it (executor/recompute.py): the same training as no
recompute, and the bytes it keeps for backward, per layer and in total, against the cost model.

Kept bytes are measured by liveness (executor/held_bytes.py): the storages a forward creates that are
still alive after it, whatever holds them (autograd's saved tensors, selective checkpointing's cache, a
checkpoint's input), each counted once; what offload moved to the host is counted apart. Predictions
are planner/cost/layer.py's for the same shapes on the cpu-gloo profile (fp32, flash attention).

Known and measured: without recompute the executor keeps the attention output twice (the kernel keeps
its output for its backward, the output projection its contiguous copy), which the layer graph counts
once: "none" (and what "offload" moves) measures about 6% above the prediction on these models.
"""
from __future__ import annotations

import pytest
import torch

from executor.data import global_batch
from executor.held_bytes import block_held_bytes, model_held_bytes
from executor.models import build_model, sdpa
from executor_support import SEQ, TINY_GPT, TINY_LLAMA, assert_losses, reference_run
from planner.cluster import load_cluster
from planner.cost.layer import POLICY_INDEX, Context, layer_cost
from planner.layers import build_layer_graph
from planner.recompute import POLICIES, every_k_layers

STEPS = 3
MODELS = {"gpt": TINY_GPT, "llama": TINY_LLAMA}
PLANS = [*POLICIES[1:], "every-2"]          # "none" is the reference
MICRO_BATCH = 2


def per_layer(spec, plan: str) -> dict[str, str]:
    """plan.json's recompute_per_layer for every block under ``plan`` (a policy, or every-K)."""
    graph = build_layer_graph(spec)
    if plan.startswith("every-"):
        policies = every_k_layers(graph, int(plan.split("-")[1]))
    else:
        policies = [plan if layer.is_block else "none" for layer in graph.layers]
    return {layer.name: p for layer, p in zip(graph.layers, policies)}


@pytest.fixture(scope="module")
def references():
    return {model: reference_run(spec, steps=STEPS) for model, spec in MODELS.items()}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("model", list(MODELS))
def test_every_policy_trains_like_no_recompute(references, model, plan):
    losses, grads = reference_run(MODELS[model], steps=STEPS, recompute_per_layer=per_layer(MODELS[model], plan))
    ref_losses, ref_grads = references[model]
    assert_losses(losses, ref_losses, against="no recompute")
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


# -- what each policy keeps, measured against the cost model --------------------------------------

def predicted(spec, index: int, policy: str) -> tuple[float, float]:
    """(device bytes, host bytes) the cost model keeps for layer ``index`` of ``spec`` at MICRO_BATCH x SEQ."""
    ctx = Context(micro_batch=MICRO_BATCH, seq_len=SEQ, tp=1, cp=1, sequence_parallel=False, precision="fp32",
                  attention="flash", framework="torch", tp_comm_overlap=False)
    cost = layer_cost(build_layer_graph(spec).layers[index], ctx, load_cluster("cpu-gloo"))
    return cost.act_bytes[POLICY_INDEX[policy]], cost.host_bytes[POLICY_INDEX[policy]]


def close(measured: float, want: float) -> bool:
    """Within 10% of the prediction; a prediction of nothing must measure nothing."""
    return measured == 0 if want == 0 else abs(measured - want) <= 0.10 * want


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", list(MODELS))
def test_kept_bytes_per_block_match_the_cost_model(model, policy):
    spec = MODELS[model]
    torch.manual_seed(0)
    blocks = build_model(spec, "cpu").layers
    x = torch.randn(MICRO_BATCH, SEQ, spec.hidden)                                   # (B, S, h)
    for index, block in blocks.items():
        device, host = block_held_bytes(block, policy, x, attention_core=sdpa)
        want_device, want_host = predicted(spec, 1 + int(index), policy)
        assert close(device, want_device), (f"layers.{index} {policy}: kept {device} B on the device, "
                                            f"predicted {want_device:.0f}")
        assert close(host, want_host), f"layers.{index} {policy}: moved {host} B to the host, predicted {want_host:.0f}"


def test_policies_keep_what_they_should_relative_to_each_other():
    """The measurement can tell the policies apart: full keeps only the input, op less than none,
    offload nothing on the device and none's bytes on the host."""
    spec = TINY_LLAMA
    x = torch.randn(MICRO_BATCH, SEQ, spec.hidden)
    kept = {}
    for policy in POLICIES:
        torch.manual_seed(0)
        kept[policy] = block_held_bytes(build_model(spec, "cpu").layers["0"], policy, x, attention_core=sdpa)
    assert kept["full"] == (x.numel() * 4, 0)
    assert kept["full"][0] < kept["op"][0] < kept["none"][0]
    assert kept["offload"] == (0, kept["none"][0])


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("model", list(MODELS))
def test_kept_bytes_of_the_whole_model_match_the_cost_model(model, plan):
    """Embedding, blocks under the plan's policies, final norm, head and loss: the total."""
    spec = MODELS[model]
    policies = per_layer(spec, plan)
    torch.manual_seed(0)
    tokens = global_batch(0, seed=0, batch=MICRO_BATCH, seq_len=SEQ, vocab_size=spec.vocab_size)
    device, host = model_held_bytes(build_model(spec, "cpu"), policies, tokens[:, :-1], tokens[:, 1:],
                                    attention_core=sdpa)
    layers = build_layer_graph(spec).layers
    want = [predicted(spec, i, policies[layer.name]) for i, layer in enumerate(layers)]
    assert close(device, sum(d for d, _ in want)), (device, sum(d for d, _ in want))
    assert close(host, sum(h for _, h in want)), (host, sum(h for _, h in want))
