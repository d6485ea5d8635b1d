"""Shared by the mixture-of-experts executor tests: two tiny MoE models, plan.json files with expert
parallelism, and the runtime table's executor entry for experts lifted while the planner's lags."""
from __future__ import annotations

import json
from dataclasses import replace
from functools import partial

from planner.model import ModelSpec

SEQ = 16
GLOBAL_BATCH = 8

# Mixtral-style (Jiang et al. 2024): 8 routed experts, top 2, no shared expert, every block MoE
TINY_MIXTRAL = ModelSpec(name="tiny-mixtral", num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8,
                         ffn_hidden=64, vocab_size=64, seq_len=SEQ, max_positions=0, mlp="swiglu", norm="rmsnorm",
                         linear_bias=False, qkv_bias=False, tied_embeddings=False, dropout=False,
                         num_experts=8, experts_per_token=2)
# DeepSeek-style (DeepSeek-AI 2024, arXiv:2412.19437, Sec 2.1.2): the first block dense, then 8 routed
# experts of a narrower width (top 2) beside one shared expert, routed by sigmoid scores from the best 2 of 4
# expert groups, renormalised and scaled by 2.5
TINY_DEEPSEEK = ModelSpec(name="tiny-deepseek", num_layers=3, hidden=32, num_heads=4, num_kv_heads=4, head_dim=8,
                          ffn_hidden=96, vocab_size=64, seq_len=SEQ, max_positions=0, mlp="swiglu", norm="rmsnorm",
                          linear_bias=False, qkv_bias=False, tied_embeddings=False, dropout=False,
                          num_experts=8, experts_per_token=2, moe_ffn_hidden=32, shared_experts=1, dense_layers=1,
                          router_scores="sigmoid", router_groups=4, router_groups_used=2, router_scale=2.5)

# two experts, top 1: under ep 2 one expert per rank, fewer than its efsdp ranks at dp 4, so its states
# are sharded along the expert's rows (dim 1), not across experts
TINY_TWO_EXPERTS = replace(TINY_MIXTRAL, name="tiny-two-experts", num_experts=2, experts_per_token=1)


def built_as_planned(spec: ModelSpec):
    """The executor's reference model of ``spec`` (meta device), checked against the planner: exactly
    ModelSpec.num_params() parameters, and every op of the layer graph that has parameters a module of it."""
    from executor.models import build_model
    from planner.layers import build_layer_graph
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    modules = dict(model.named_modules())
    with_params = [op.name for layer in build_layer_graph(spec).layers for op in layer.ops if op.params]
    assert [name for name in with_params if name not in modules] == []
    return model


def moe_plan_doc(spec: ModelSpec, *, gpus: int, ep: int = 1, global_batch: int = GLOBAL_BATCH,
                 cluster: str = "cpu-gloo", whole_shared: bool = False, **knobs) -> dict:
    """plan.json of ``spec`` with fixed knobs (dp = gpus / (pp cp) unless given, tp 1, ZeRO-0, one
    micro-batch per replica unless given, no recompute), as the planner's own API makes it for them
    (``meshplan plan`` with every knob given); ``whole_shared``: its tp_plan leaving the shared experts whole on
    every tp rank (the planner splits them as a dense MLP: a plan.json edited so)."""
    from planner import api
    from planner.cluster import load_cluster
    from planner.config import ParallelConfig, Workload
    from planner.layers import build_layer_graph
    pp, cp = knobs.get("pp", 1), knobs.get("cp", 1)
    dp = knobs.pop("dp", gpus // (pp * cp))
    micro = knobs.pop("micro_batch", global_batch // dp)
    config = ParallelConfig(**{"dp": dp, "tp": 1, "pp": 1, "zero": 0, "micro_batch": micro, "ep": ep,
                               "num_microbatches": global_batch // (dp * micro), "recompute": "none", **knobs})
    job = api.Job(model_source=spec.name, spec=spec, graph=build_layer_graph(spec),
                  cluster=load_cluster(cluster, gpus),
                  workload=Workload(global_batch=global_batch, seq_len=spec.seq_len, precision="fp32"))
    doc = api.fixed_plan(job, config).to_json()
    if whole_shared:
        doc["tp_plan"] = {path: style for path, style in doc["tp_plan"].items() if ".mlp.shared." not in path}
    return doc


def write_moe_plan(path, spec: ModelSpec, **kwargs) -> str:
    path.write_text(json.dumps(moe_plan_doc(spec, **kwargs)))
    return str(path)


def train_cases(cases, plans: dict, specs: dict, out_dir, target) -> None:
    """Write each (model, plan) case's plan.json under ``out_dir`` (``plans[plan]`` is (world size, knobs)) and
    train them on gloo, one spawn per world size running ``target(jobs, out_dir)`` on each rank."""
    from pathlib import Path

    from executor_support import spawn
    by_world: dict[int, list[tuple[str, str]]] = {}
    for model, plan in cases:
        world, knobs = plans[plan]
        path = write_moe_plan(Path(out_dir) / f"{model}-{plan}.plan.json", specs[model], gpus=world, **knobs)
        by_world.setdefault(world, []).append((f"{model}-{plan}", path))
    for world, jobs in sorted(by_world.items()):
        spawn(target, world, jobs, str(out_dir))


def trained_results(cases, plans: dict, specs: dict, out_dir, steps: int) -> dict:
    """``train_cases`` with executor_support's ``run_plans`` for ``steps`` steps, then each case's (measured
    result, the first step's full gradients by parameter name), keyed by (model, plan)."""
    from pathlib import Path

    from executor_support import load_rank_grads
    train_cases(cases, plans, specs, out_dir, partial(_run_plans, steps=steps))
    out = Path(out_dir)
    return {(model, plan): (json.loads((out / f"{model}-{plan}.json").read_text()),
                            load_rank_grads(str(out / f"{model}-{plan}.grads"), plans[plan][0], specs[model]))
            for model, plan in cases}


def _run_plans(jobs, out_dir: str, *, steps: int) -> None:
    from executor_support import run_plans
    run_plans(jobs, out_dir, steps)


def assert_equals_single_process(measured: dict, grads: dict, reference) -> None:
    """A distributed run's losses (within 1e-4 relative) and first-step gradients (rtol 1e-4, with a floor of
    1e-5 of the largest) against ``reference``, the single-process (losses, gradients)."""
    import torch

    from executor_support import assert_losses
    ref_losses, ref_grads = reference
    assert_losses(measured["losses"], ref_losses, against="single process")
    assert set(grads) == set(ref_grads)
    floor = 1e-5 * max(g.abs().max().item() for g in ref_grads.values())
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=floor, msg=lambda m: f"{name}: {m}")
