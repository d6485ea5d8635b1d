"""Every plan meshplan recommends runs: `meshplan plan` with nothing fixed (but the world, the batch
and the cpu-gloo profile) for three small models on 2, 4 and 8 processes, each recommended plan
trained for real for three steps; the losses equal one process's within 1e-4."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from executor_support import TINY_GPT, TINY_GQA, TINY_LLAMA, assert_losses, reference_run, spawn, write_plan

pytestmark = pytest.mark.distributed      # the recommended plans train on gloo processes

STEPS = 3
MODELS = {"gpt": TINY_GPT, "llama": TINY_LLAMA, "gqa": TINY_GQA}
WORLDS = (2, 4, 8)


def _run_plans(jobs: list[tuple[str, str]], out_dir: str) -> None:
    from executor.plan_file import load_plan
    from executor.train import RunOptions, run
    for name, plan_path in jobs:
        measured = run(load_plan(plan_path), RunOptions(steps=STEPS))
        if dist.get_rank() == 0:
            Path(f"{out_dir}/{name}.json").write_text(json.dumps(measured))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """{(model, world): (the plan's config, measured.json)}: every world's plans in one set of processes."""
    tmp = tmp_path_factory.mktemp("sweep")
    configs = {}
    for world in WORLDS:
        jobs = []
        for model, spec in MODELS.items():
            path = write_plan(tmp, spec, gpus=world, name=f"{model}-{world}", searched=True)
            configs[model, world] = json.loads(Path(path).read_text())["config"]
            jobs.append((f"{model}-{world}", path))
        spawn(_run_plans, world, jobs, str(tmp))
    return {key: (config, json.loads((tmp / f"{key[0]}-{key[1]}.json").read_text()))
            for key, config in configs.items()}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_the_recommended_plan_trains_like_one_process(sweep, model, world):
    config, measured = sweep[model, world]
    assert config["dp"] * config["tp"] * config["pp"] * config["cp"] == world
    losses, _ = reference_run(MODELS[model], steps=STEPS)
    assert_losses(measured["losses"], losses, against="single process")
