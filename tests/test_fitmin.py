"""`meshplan plan --fit-min`: the fewest GPUs of a profile that fit the job (planner/fitmin.py)."""
import json
from dataclasses import dataclass

import pytest

from planner import api
from planner.errors import NoFeasiblePlan, UserError
from planner.fitmin import counts, fit_min


def test_counts_are_one_nodes_powers_of_two_then_the_node():
    assert counts(8) == [1, 2, 4, 8]
    assert counts(4) == [1, 2, 4]
    assert counts(6) == [1, 2, 4, 6]
    assert counts(1) == [1]


@dataclass
class _Fits:
    fits: bool = True


@dataclass
class _Best:
    estimate: _Fits


@dataclass
class _Plan:
    best: _Best
    world_size: int


def _stub(least: int, refuse=()):
    """A planner whose job fits from ``least`` GPUs on; counts in ``refuse`` cannot run (the degrees)."""
    def plan_one(inputs, knobs):
        if inputs.gpus in refuse:
            raise UserError("does not divide", field="--dp/--tp/--pp/--cp")
        if inputs.gpus < least:
            raise NoFeasiblePlan("no")
        return _Plan(best=_Best(estimate=_Fits()), world_size=inputs.gpus)
    return plan_one


def test_doubling_then_every_node_count_in_between():
    # 8 GPUs a node (a100-80g); the job fits from 3 nodes: 1, 2, 4, 8 GPUs, then 2 and 4 nodes, then 3 nodes
    found = fit_min(api.JobInputs(model="llama3-8b", cluster="a100-80g", global_batch=64), api.Knobs(),
                    plan_one=_stub(24))
    assert found.gpus == 24
    assert [n for n, _ in found.tried] == [1, 2, 4, 8, 16, 32, 24]
    # from 5 nodes: 8 nodes first, then 5 (the first between 4 and 8 that fits)
    found = fit_min(api.JobInputs(model="llama3-8b", cluster="a100-80g", global_batch=64), api.Knobs(),
                    plan_one=_stub(40))
    assert found.gpus == 40 and [n for n, _ in found.tried] == [1, 2, 4, 8, 16, 32, 64, 40]


def test_a_count_the_degrees_refuse_does_not_fit_and_the_search_goes_on():
    found = fit_min(api.JobInputs(model="llama3-8b", cluster="a100-80g", global_batch=64), api.Knobs(),
                    plan_one=_stub(2, refuse=(2,)))
    assert found.gpus == 4
    assert found.tried[1][0] == 2 and found.tried[1][1].startswith("cannot run")


def test_nothing_fits_up_to_the_limit():
    found = fit_min(api.JobInputs(model="llama3-8b", cluster="a100-80g", global_batch=64), api.Knobs(), limit=32,
                    plan_one=_stub(10**6))
    assert found.plan is None and [n for n, _ in found.tried] == [1, 2, 4, 8, 16, 32]


def test_llama2_70b_full_fine_tuning_without_offload_needs_two_a100_nodes():
    """Without optimizer offload Llama-2 70B's 16 bytes per parameter of model states (1,028 GiB) do not fit on one
    node's 640 GiB of HBM, and fit on two: 16 x (1 GiB of runtime reserve + 79 GiB / 1.18 of memory headroom) =
    1,087 GiB usable, the rest of it for activations under recompute. The planner agrees on both sides of the answer
    (with the 0.21 headroom before 2026-11-29 it took three nodes: 1,061 GiB usable on two)."""
    inputs = api.JobInputs(model="llama2-70b", cluster="a100-80g", global_batch=64, seq_len=4096)
    found = fit_min(inputs, api.Knobs(optimizer_offload=False))
    assert found.gpus == 16
    with pytest.raises(NoFeasiblePlan):
        api.plan(api.JobInputs(model="llama2-70b", cluster="a100-80g", gpus=8, global_batch=64,
                               seq_len=4096).load(), api.Knobs(optimizer_offload=False), top_k=1)


def test_cli_fit_min_answers_each_training_mode(cli):
    """Without --finetune: every mode the runtime runs on the cluster's GPUs (torch on CUDA: full, lora, qlora);
    frozen weights need fewer GPUs, 4-bit ones fewer still."""
    done = cli("plan", "--model", "llama2-70b", "--cluster", "a100-80g", "--global-batch", "64", "--seq-len", "4096",
               "--fit-min", "--optimizer-offload", "off", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert list(doc) == ["full", "lora", "qlora"]
    full = doc["full"]
    assert full["gpus"] == 16 and full["gpus_per_node"] == 8 and full["memory_bytes"] <= full["capacity_bytes"]
    assert [t["gpus"] for t in full["tried"]][-1] == 16
    assert doc["lora"]["gpus"] < full["gpus"]
    assert doc["qlora"]["gpus"] <= doc["lora"]["gpus"]


def test_cli_fit_min_refuses_gpus(cli):
    done = cli("plan", "--model", "llama2-70b", "--cluster", "a100-80g", "--gpus", "8", "--fit-min")
    assert done.returncode == 2 and "--gpus" in done.stderr and "Traceback" not in done.stderr
