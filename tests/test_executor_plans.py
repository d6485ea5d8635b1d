"""Every parallelism is the same training: losses of three AdamW steps and the first step's
gradients equal a single-process run of the same model on the same data.

The plans are written by the planner's own CLI (`meshplan plan ... --out`); each world size
runs all its plans in one set of gloo processes (process start-up dominates on 2 cores).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from executor_support import (TINY_GPT, TINY_LLAMA, load_rank_grads, reference_run, spawn, write_plan)

STEPS = 3
MODELS = {"gpt": TINY_GPT, "llama": TINY_LLAMA}

# name -> (world size, knobs of `meshplan plan`); micro_batch 2 gives the pipelines 2 or 4 micro-batches
PLANS = {
    "dp2": (2, {"dp": 2}),
    "zero1": (2, {"dp": 2, "zero": 1}),
    "zero2": (2, {"dp": 2, "zero": 2}),
    "zero3": (2, {"dp": 2, "zero": 3}),
    "tp2": (2, {"tp": 2}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2-gpipe": (2, {"pp": 2, "schedule": "gpipe", "micro_batch": 2}),
    "pp2-1f1b": (2, {"pp": 2, "schedule": "1f1b", "micro_batch": 2}),
    "pp2-interleaved": (2, {"pp": 2, "vpp": 2, "schedule": "interleaved-1f1b", "micro_batch": 2}),
    "dp2-tp2": (4, {"dp": 2, "tp": 2}),
    "dp2-tp2-zero3-sp": (4, {"dp": 2, "tp": 2, "zero": 3, "sequence_parallel": True}),
    "pp2-dp2-tp2": (8, {"pp": 2, "dp": 2, "tp": 2, "schedule": "1f1b", "micro_batch": 1, "zero": 2}),
}


def _cluster(spec, knobs) -> str:
    # `meshplan plan` divides by zero estimating a tied embedding's all-reduce across pipeline
    # stages on cpu-gloo (a profile with no network); the config, stages and TP plan it writes do
    # not depend on the cluster, so GPT pipeline plans are written for a100-80g (reported to planner/).
    return "a100-80g" if spec.tied_embeddings and knobs.get("pp", 1) > 1 else "cpu-gloo"


def _run_plans(jobs: list[tuple[str, str]], out_dir: str) -> None:
    from executor.plan_file import load_plan
    from executor.train import RunOptions, run
    for name, plan_path in jobs:
        measured = run(load_plan(plan_path), RunOptions(steps=STEPS, grads_path=f"{out_dir}/{name}.grads"))
        if dist.get_rank() == 0:
            Path(f"{out_dir}/{name}.json").write_text(json.dumps(measured))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run every plan once, grouped by world size; {(model, plan): (measured, gradients)}."""
    tmp = tmp_path_factory.mktemp("equivalence")
    by_world: dict[int, list[tuple[str, str]]] = {}
    for model, spec in MODELS.items():
        for plan, (world, knobs) in PLANS.items():
            path = write_plan(tmp, spec, gpus=world, name=f"{model}-{plan}", cluster=_cluster(spec, knobs), **knobs)
            by_world.setdefault(world, []).append((f"{model}-{plan}", path))
    for world, jobs in sorted(by_world.items()):
        spawn(_run_plans, world, jobs, str(tmp))
    out = {}
    for model, spec in MODELS.items():
        for plan, (world, _) in PLANS.items():
            measured = json.loads((tmp / f"{model}-{plan}.json").read_text())
            out[model, plan] = measured, load_rank_grads(str(tmp / f"{model}-{plan}.grads"), world, spec)
    return out


@pytest.fixture(scope="module")
def references():
    return {model: reference_run(spec, steps=STEPS) for model, spec in MODELS.items()}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("model", list(MODELS))
def test_losses_and_gradients_equal_single_process(results, references, model, plan):
    measured, grads = results[model, plan]
    ref_losses, ref_grads = references[model]
    assert len(measured["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(measured["losses"], ref_losses)):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: loss {got} vs single process {want}"
    assert set(grads) == set(ref_grads)
    # relative to each tensor (rtol), with an absolute floor at 1e-5 of the largest gradient:
    # some gradients are zero analytically (a key bias shifts every score of a query equally,
    # which softmax ignores) and are float noise in both runs
    floor = 1e-5 * max(g.abs().max().item() for g in ref_grads.values())
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=floor, msg=lambda m: f"{name}: {m}")


def test_losses_move(references):
    """The comparison above means something: three steps change the loss."""
    for model, (losses, _) in references.items():
        assert len(set(round(x, 6) for x in losses)) == STEPS, (model, losses)
