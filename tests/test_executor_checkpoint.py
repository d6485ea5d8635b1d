"""Save after 4 steps under one plan, resume 4 steps under another (other degrees, ZeRO stage and
pipeline split): the 8 losses equal an uninterrupted single-process 8-step run within 1e-4."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from executor_support import TINY_GPT, TINY_LLAMA, assert_losses, reference_run, spawn, write_plan


def _train(plan_path: str, steps: int, load: str | None, save: str | None, out: str) -> None:
    from executor.plan_file import load_plan
    from executor.train import RunOptions, run
    measured = run(load_plan(plan_path), RunOptions(steps=steps, load_dir=load, save_dir=save))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(measured))


CASES = {
    # model: (first plan, second plan); each is (world size, knobs of `meshplan plan`)
    "llama": (TINY_LLAMA, (2, {"dp": 2, "zero": 3}), (2, {"tp": 2, "sequence_parallel": True})),
    # the tied head: two copies under a pipeline, one parameter without
    "gpt": (TINY_GPT, (2, {"pp": 2, "schedule": "gpipe", "micro_batch": 2}), (2, {"dp": 2, "zero": 2})),
    # ZeRO-1's sharded states (over the replicas, after TP) into FSDP's, and FSDP's into ZeRO-1's under a pipeline
    "llama-zero1-tp": (TINY_LLAMA, (4, {"dp": 2, "tp": 2, "zero": 1}), (2, {"dp": 2, "zero": 3})),
    "gpt-zero2-to-zero1-pp": (TINY_GPT, (2, {"dp": 2, "zero": 2}),
                              (4, {"pp": 2, "dp": 2, "zero": 1, "schedule": "gpipe", "micro_batch": 1})),
    # optimizer offload: FSDP2's host-memory shards and states into ZeRO-1's host-memory states
    "llama-zero3-offload-to-zero1-offload": (TINY_LLAMA, (2, {"dp": 2, "zero": 3, "optimizer_offload": True}),
                                             (2, {"dp": 2, "zero": 1, "optimizer_offload": True})),
}


@pytest.mark.distributed
@pytest.mark.parametrize("model", list(CASES))
def test_resume_under_another_plan_continues_the_same_training(tmp_path, model):
    spec, (world_a, knobs_a), (world_b, knobs_b) = CASES[model]
    plan_a = write_plan(tmp_path, spec, gpus=world_a, name="a", **knobs_a)
    plan_b = write_plan(tmp_path, spec, gpus=world_b, name="b", **knobs_b)
    ckpt = str(tmp_path / "ckpt")
    spawn(_train, world_a, plan_a, 4, None, ckpt, str(tmp_path / "a.json"))
    spawn(_train, world_b, plan_b, 4, ckpt, None, str(tmp_path / "b.json"))
    first = json.loads((tmp_path / "a.json").read_text())
    second = json.loads((tmp_path / "b.json").read_text())
    assert second["first_step"] == 4
    uninterrupted, _ = reference_run(spec, steps=8)
    assert_losses(first["losses"] + second["losses"], uninterrupted)


def test_resuming_from_a_missing_checkpoint_names_it(tmp_path):
    from executor.checkpoint import load
    from planner.errors import UserError
    with pytest.raises(UserError, match="no-such-dir: no such checkpoint directory"):
        load(str(tmp_path / "no-such-dir"), [], [], tied=False)
