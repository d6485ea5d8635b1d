"""FP8 in meshplan's executor: torchao's float8 linears for the planned recipe, converting exactly the linears the
planner prices in FP8, before any other wrapping. FP8 GEMMs need a GPU with FP8 (SM89+): on this CPU torchao
emulates them in higher precision, which checks the conversion and that a step trains, not the speed."""
from __future__ import annotations

import copy

import pytest
import torch

from planner import api
from planner.cost.layer import fp8_converts
from planner.errors import UserError
from planner.layers import build_layer_graph
from planner.model import ModelSpec

pytest.importorskip("torchao", reason="torchao is installed with meshplan[fp8] (meshplan[all])")

# gate and up are 64 -> 1040: N > 1024 passes torchao's tensorwise auto filter; every other linear is below it
SPEC = ModelSpec(name="tiny-fp8", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden=1040,
                 vocab_size=128, seq_len=32, max_positions=0, mlp="swiglu", norm="rmsnorm", linear_bias=False,
                 qkv_bias=False, tied_embeddings=False, dropout=False)


def _model():
    from executor.models import build_model, materialize
    model = build_model(SPEC, device="meta")
    return model


def _priced(recipe: str) -> set[str]:
    return {op.name for layer in build_layer_graph(SPEC).layers for op in layer.ops
            if op.kind == "linear" and fp8_converts(op, recipe, "torch")}


@pytest.mark.parametrize("recipe, expected", [
    ("fp8-tensorwise", {f"layers.{i}.mlp.{n}" for i in range(2) for n in ("gate_proj", "up_proj")}),
    # no auto filter for rowwise_with_gw_hp: every block linear (dims multiples of 16), never the LM head
    ("fp8-rowwise-gw-hp", {f"layers.{i}.{n}" for i in range(2) for n in (
        "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}),
])
def test_the_executor_converts_the_linears_the_planner_prices_in_fp8(recipe, expected):
    from torchao.float8.float8_linear import Float8Linear

    from executor.models import build_model, materialize
    from executor.parallelize import apply_fp8
    model = build_model(SPEC, device="meta")
    chosen = apply_fp8(model, recipe, emulate=True)
    assert set(chosen) == _priced(recipe) == expected
    modules = dict(model.named_modules())
    assert all(isinstance(modules[p], Float8Linear) for p in chosen)
    assert not isinstance(modules["lm_head"], Float8Linear)
    # converted on the meta device as the executor does, then materialised: the same weights as the bf16 model
    materialize(model, seed=0, device=torch.device("cpu"))
    reference = build_model(SPEC, device="meta")
    materialize(reference, seed=0, device=torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    tokens = torch.randint(0, SPEC.vocab_size, (2, SPEC.seq_len), generator=torch.Generator().manual_seed(0))

    def step(m):
        logits = m(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.item(), [p.grad for p in m.parameters()]
    got, grads = step(model)
    want, ref_grads = step(reference)
    # e4m3 keeps 3 mantissa bits: the emulated FP8 loss is near, not equal, to the fp32 one
    assert got == pytest.approx(want, rel=2e-2) and got != want
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in grads]),
                                                torch.cat([g.flatten() for g in ref_grads]), dim=0)
    assert cos > 0.98


def test_fp8_plans_of_meshplans_runtime_are_refused_where_they_cannot_run():
    from executor.support import check_supported
    from planner.config import ParallelConfig
    config = ParallelConfig(dp=2, tp=1, pp=1, zero=3, micro_batch=1, num_microbatches=1)
    with pytest.raises(UserError, match="cpu"):
        check_supported(config, SPEC, "cpu", fp8="fp8-rowwise")
    check_supported(config, SPEC, "cuda", fp8="fp8-rowwise")
    # torchao's float8 linears are not tensor parallel here: the search keeps tp 1, and a fixed tp 2 is refused
    job = api.load_job("llama3-8b", cluster="h100-80g", gpus=8, precision="fp8-rowwise", compile=True)
    assert api.plan(job, top_k=1).best.config.tp == 1
    with pytest.raises(UserError, match="tp 2"):
        api.plan(job, api.Knobs(tp=2), top_k=1)
    with pytest.raises(UserError, match="tp 1"):
        check_supported(ParallelConfig(dp=1, tp=2, pp=1, zero=0), SPEC, "cuda", fp8="fp8-rowwise")
