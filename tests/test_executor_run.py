"""`meshplan run`: the command a user types, end to end through torchrun, and its refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from planner.model import config_json
from executor_support import TINY_GPT, TINY_LLAMA, assert_losses, reference_run, write_plan

pytestmark = pytest.mark.distributed      # `meshplan run` launches torchrun


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """`meshplan run --json` of a 2-process ZeRO-3 plan, 3 steps."""
    tmp = tmp_path_factory.mktemp("run")
    plan = write_plan(tmp, TINY_GPT, gpus=2, dp=2, zero=3)
    config = tmp / "tiny-gpt.json"           # written by write_plan: the --model the plan was made for
    done = run_cli("run", "--plan", plan, "--model", str(config), "--steps", "3", "--json", cwd=tmp, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, json.loads(done.stdout.strip().splitlines()[-1])


def test_run_json_summary_has_losses_step_time_and_memory(gpt_run):
    tmp, summary = gpt_run
    assert len(summary["losses"]) == 3 and summary["step_time_s"] > 0
    ranks = summary["memory_per_rank_bytes"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["params"] > 0 and r["activations"] > 0 for r in ranks)
    want, _ = reference_run(TINY_GPT, steps=3)
    assert_losses(summary["losses"], want, against="single process")
    measured = json.loads((tmp / "measured.json").read_text())
    assert measured["losses"] == summary["losses"] and measured["world_size"] == 2
    assert measured["predicted"]["step_time_s"] > 0
    # the instrumented step's matrix products on each CPU rank, apart from the memory
    assert len(measured["gemm_per_rank"]) == 2 and all(g["flops"] > 0 and g["tflops"] > 0
                                                       for g in measured["gemm_per_rank"])
    assert all("gemm" not in r for r in measured["memory_per_rank_bytes"])


def test_run_prints_predicted_against_measured(tmp_path):
    plan = write_plan(tmp_path, TINY_LLAMA, gpus=2, tp=2)
    done = run_cli("run", "--plan", plan, "--model", str(tmp_path / "tiny-llama.json"), "--steps", "2",
                   "--out", "m.json", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    predicted = json.loads(Path(plan).read_text())["estimate"]["step_time_s"]
    measured = json.loads((tmp_path / "m.json").read_text())["step_time_s"]
    assert f"step time predicted {predicted:.4f} s, measured {measured:.4f} s" in done.stdout
    assert done.stdout.count("activations") == 2          # one row per rank


def test_run_refuses_a_model_the_plan_was_not_made_for(tmp_path):
    plan = write_plan(tmp_path, TINY_GPT, gpus=2, dp=2)
    other = tmp_path / "llama.json"
    other.write_text(json.dumps(config_json(TINY_LLAMA)))
    done = run_cli("run", "--plan", plan, "--model", str(other), "--steps", "1", cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    assert "model.spec: --model" in done.stderr and "mlp 'swiglu' != 'gelu'" in done.stderr


def test_run_refuses_a_process_count_that_does_not_fit_the_plan(tmp_path):
    plan = write_plan(tmp_path, TINY_GPT, gpus=2, dp=2)
    done = run_cli("run", "--plan", plan, "--model", str(tmp_path / "tiny-gpt.json"), "--steps", "1",
                   "--nproc", "3", cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and "--nproc" in done.stderr and "needs 2" in done.stderr
