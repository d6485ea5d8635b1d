"""The split-backward schedules (interleaved-zb, zbv, dualpipev: torch's ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV) are the same training: losses of three AdamW steps and the first
step's gradients equal a single-process run within 1e-4, alone, over 8 stages, composed with data
parallelism (ZeRO-0, 1 and 2; ZeRO-3 is refused: planner/runtimes.py ``zero_stages_with_split_backward``) and
with tensor parallelism (sequence parallelism is refused: ``sp_with_split_backward``).

zbv and dualpipev place stages in a V (rank r holds stages r and 2 pp - 1 - r): GPT's tied embedding and
head are then both on pipeline rank 0 and their gradients are summed there (executor/pipeline.py
``sync_tied_grads``). Plans are written by `meshplan plan`; each world size runs all its plans in one set
of gloo processes (process start-up dominates on 2 cores).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from executor_support import (assert_equal_single_process, run_plans, TINY_GPT, TINY_LLAMA, load_rank_grads, reference_run,
                              spawn, write_plan)

STEPS = 3
SCHEDULES = ("interleaved-zb", "zbv", "dualpipev")
# 8 stages (pp 4 x 2) need a block in each of the 6 middle ones: the embedding and the head end the outer two
MODELS = {"gpt": TINY_GPT, "llama": TINY_LLAMA,
          "gpt6": replace(TINY_GPT, name="tiny-gpt6", num_layers=6),
          "llama6": replace(TINY_LLAMA, name="tiny-llama6", num_layers=6)}

# name -> (world size, models, knobs of `meshplan plan`); micro-batches: 4 (pp 2), 4 per replica (pp 2 x dp 2),
# 8 (pp 4): dualpipev needs at least 2 pp, interleaved-zb a multiple of pp
LAYOUTS = {
    "pp2": (2, ("gpt", "llama"), {"pp": 2, "vpp": 2, "micro_batch": 2}),
    "pp4": (4, ("gpt6", "llama6"), {"pp": 4, "vpp": 2, "micro_batch": 1}),
    "pp2-dp2": (4, ("gpt", "llama"), {"pp": 2, "dp": 2, "vpp": 2, "micro_batch": 1}),
    # DTensor tensor parallelism inside each stage (without sequence parallelism: planner/runtimes.py
    # ``sp_with_split_backward``)
    "pp2-tp2": (4, ("gpt", "llama"), {"pp": 2, "tp": 2, "vpp": 2, "micro_batch": 2, "sequence_parallel": False}),
}
# the data-parallel wrapper each schedule runs under pp 2 x dp 2: replicate, ZeRO-1's sharded AdamW, FSDP2
DP_ZERO = {"interleaved-zb": 0, "zbv": 1, "dualpipev": 2}
# ZB-V with fewer micro-batches than its stages (2 on pp 2 x 2): torch computes its order for 2 pp - 1 of them and
# drops the passes of those past m (planner/pipeline_orders.py ``_zbv``), the regime the closed form prices apart
LAYOUTS["pp2-few"] = (2, ("gpt", "llama"), {"pp": 2, "vpp": 2, "micro_batch": 4})
CASES = [(model, layout, schedule) for layout, (_, models, _) in LAYOUTS.items() for model in models
         for schedule in SCHEDULES if layout != "pp2-few" or schedule == "zbv"]


def _knobs(layout: str, schedule: str) -> dict:
    _, _, knobs = LAYOUTS[layout]
    zero = {"zero": DP_ZERO[schedule]} if "dp" in knobs else {}
    return {**knobs, **zero, "schedule": schedule}


def _run_plans(jobs: list[tuple[str, str]], out_dir: str) -> None:
    run_plans(jobs, out_dir, STEPS)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero-bubble")
    by_world: dict[int, list[tuple[str, str]]] = {}
    for model, layout, schedule in CASES:
        world, spec, knobs = LAYOUTS[layout][0], MODELS[model], _knobs(layout, schedule)
        name = f"{model}-{layout}-{schedule}"
        path = write_plan(tmp, spec, gpus=world, name=name, **knobs)
        by_world.setdefault(world, []).append((name, path))
    for world, jobs in sorted(by_world.items()):
        spawn(_run_plans, world, jobs, str(tmp))
    out = {}
    for model, layout, schedule in CASES:
        name = f"{model}-{layout}-{schedule}"
        measured = json.loads((tmp / f"{name}.json").read_text())
        out[model, layout, schedule] = measured, load_rank_grads(str(tmp / f"{name}.grads"), LAYOUTS[layout][0],
                                                                 MODELS[model])
    return out


@pytest.fixture(scope="module")
def references():
    return {model: reference_run(spec, steps=STEPS) for model, spec in MODELS.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("model,layout,schedule", CASES)
def test_losses_and_gradients_equal_single_process(results, references, model, layout, schedule):
    assert_equal_single_process(results[model, layout, schedule], references[model], STEPS)


# -- where the stages go ------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule,pp,vpp", [("zbv", 2, 2), ("dualpipev", 4, 2), ("interleaved-zb", 4, 2),
                                             ("interleaved-1f1b", 2, 3), ("1f1b", 4, 1)])
def test_stage_to_rank_mapping_is_the_planners_and_torchs(schedule, pp, vpp):
    """The executor's stages of each rank are the planner's placement (planner.schedules.stage_of, as
    planner/placement.py places the layers) and the mapping torch's class uses (generate_stage_to_rank_mapping,
    style "v" for the V classes), each rank's in ascending order."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    from executor.pipeline import stage_indices
    from planner.schedules import SCHEDULES as RECORDS
    from planner.schedules import rank_chunk, stage_of
    where = RECORDS[schedule].placement
    torch_map = generate_stage_to_rank_mapping(pp, pp * vpp, style=where)
    for rank in range(pp):
        mine = stage_indices(pp * vpp, pp, rank, schedule)
        assert mine == [stage_of(where, rank, chunk, pp) for chunk in range(vpp)]
        assert mine == sorted(mine)
        assert all(rank_chunk(where, j, pp)[0] == rank == torch_map[j] for j in mine)
    assert sorted(j for r in range(pp) for j in stage_indices(pp * vpp, pp, r, schedule)) == list(range(pp * vpp))


def test_v_placement_puts_the_first_and_last_stage_on_rank_0():
    from executor.pipeline import stage_indices
    assert stage_indices(8, 4, 0, "zbv") == [0, 7]
    assert stage_indices(8, 4, 3, "dualpipev") == [3, 4]
    assert stage_indices(8, 4, 0, "interleaved-zb") == [0, 4]


# -- what is refused, and said so -----------------------------------------------------------------------------

def test_compiled_blocks_are_refused_with_a_split_backward_schedule(tmp_path):
    """torch refuses torch.compile'd stages in its split-backward classes; the executor says so before it
    builds anything, naming plan.json's field (``PipelineSchedule.compile_refusal``)."""
    from executor.plan_file import load_plan
    from executor.support import check_supported
    from planner.errors import UserError
    path = write_plan(tmp_path, TINY_LLAMA, gpus=2, pp=2, vpp=2, micro_batch=2, schedule="zbv")
    doc = json.loads(Path(path).read_text())
    doc["workload"]["compile"] = True
    Path(path).write_text(json.dumps(doc))
    plan = load_plan(path)
    with pytest.raises(UserError, match=r"workload\.compile.*torch\.compile'd stages"):
        check_supported(plan.config, plan.spec, "cpu", plan.source, plan.workload.fp8, plan.workload.compile)
    check_supported(plan.config, plan.spec, "cpu", plan.source, plan.workload.fp8, False)


def test_zero3_is_refused_with_a_split_backward_schedule(tmp_path):
    from executor.support import check_supported
    from planner.config import ParallelConfig
    from planner.errors import UserError
    config = ParallelConfig(dp=2, tp=1, pp=2, vpp=2, zero=3, schedule="dualpipev", num_microbatches=4)
    with pytest.raises(UserError, match=r"config\.zero.*ZeRO-3 with the dualpipev schedule"):
        check_supported(config, TINY_LLAMA, "cpu")
    check_supported(replace(config, zero=2), TINY_LLAMA, "cpu")


@pytest.mark.distributed
def test_dry_run_of_a_v_plan_builds_each_rank_as_planned(tmp_path):
    """Fake process group, meta device: every pipeline rank of a zbv plan (pp 4 x dp 2, ZeRO-2) builds its two
    stages of the V and torch's ZBV class, and holds the gradient and optimizer bytes the plan predicts for it."""
    from executor.dryrun import dry_run
    from executor.plan_file import load_plan
    path = write_plan(tmp_path, MODELS["llama6"], gpus=8, pp=4, dp=2, vpp=2, zero=2, micro_batch=1,
                      schedule="zbv")
    reports, _ = dry_run(load_plan(path), "cpu")
    assert {r.pp_rank for r in reports} == {0, 1, 2, 3}
    for r in reports:
        assert r.problems == [], r.problems[:5]
        for key, got in (("grads", r.grads_bytes), ("optimizer", r.optimizer_bytes)):
            assert abs(got - r.predicted[key]) <= 0.01 * r.predicted[key], (r.pp_rank, key, got, r.predicted[key])
