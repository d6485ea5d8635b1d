"""What FSDP2 gathers under torch's pipelining, counted on gloo: the calls the cost model prices
(planner/cost/step.py gathers_every_microbatch)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from executor_support import TINY_LLAMA, spawn, write_plan

MICROBATCHES = 4


def _count_gathers(plan_path: str, out_dir: str) -> None:
    """Trains 1 and then 2 steps, counting FSDP2's all-gathers on this rank (dist.all_gather_single, its only
    gather: torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py at torch 2.13)."""
    from executor.plan_file import load_plan
    from executor.train import RunOptions, run
    calls = {"n": 0}
    original = dist.all_gather_single

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)
    dist.all_gather_single = counted
    try:
        counts = []
        for steps in (1, 2):
            calls["n"] = 0
            run(load_plan(plan_path), RunOptions(steps=steps))
            counts.append(calls["n"])
    finally:
        dist.all_gather_single = original
    Path(f"{out_dir}/rank{dist.get_rank()}.json").write_text(json.dumps(counts))


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_under_the_pipeline_gathers_as_priced(tmp_path, zero):
    """pp 2 x dp 2, four micro-batches a step: torch's pipelining leaves FSDP's parameters gathered after each
    backward, so a unit (each block, and the stage's own module with the embedding or the norm and head:
    executor/parallelize.py apply_fsdp) gathers once a step at ZeRO-2 and, resharded after each forward, once more
    before each backward at ZeRO-3: 3 and 15 gathers a step on every rank, where a gather before every forward
    (and backward) would make 12 and 24. The second step less the first is one step (the first also has the
    pipeline's shape inference)."""
    plan = write_plan(tmp_path, TINY_LLAMA, gpus=4, pp=2, dp=2, zero=zero, micro_batch=1,
                      global_batch=2 * MICROBATCHES)
    stages = json.loads(Path(plan).read_text())["stages"]
    assert [1 + sum(name.startswith("layers.") for name in stage) for stage in stages] == [3, 3]    # units a stage
    spawn(_count_gathers, 4, plan, str(tmp_path))
    for rank in range(4):
        one, two = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert two - one == 3 * (1 if zero == 2 else 1 + MICROBATCHES), (rank, one, two)
