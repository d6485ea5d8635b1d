"""Failing ranks, end to end through `meshplan run` and torchrun, 2 processes.

Failures are made with MESHPLAN_FAULT (executor/faults.py): a rank SIGKILLs itself, or stops
answering, at a given step of the job's first attempt. Every run trains TINY_GPT on 2 processes
(ZeRO-3; the restart test under every ZeRO stage and under the planner's own choice); the
uninterrupted run they are compared with is the single-process reference (the same training
without any parallelism or failure, executor_support.reference_run).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT
from executor_support import TINY_GPT, assert_losses, reference_run, write_plan

pytestmark = pytest.mark.distributed      # torchrun jobs whose ranks are killed

STEPS, EVERY = 12, 4


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("failures")
    return write_plan(tmp, TINY_GPT, gpus=2, dp=2, zero=3), str(tmp / "tiny-gpt.json")


# the restart test for meshplan's own ZeRO-1 optimizer and FSDP2's ZeRO-3 over 2 replicas (every stage's checkpoint
# is resumed under other plans in tests/test_executor_checkpoint.py)
RESTART_PLANS = {"zero1": {"dp": 2, "zero": 1}, "zero3": {"dp": 2, "zero": 3},
                 # ZB-V puts the first and the last stage on rank 0: the tied embedding's two copies, one checkpoint key
                 "zbv": {"pp": 2, "vpp": 2, "schedule": "zbv", "micro_batch": 8}}


@pytest.fixture(scope="module", params=list(RESTART_PLANS))
def restart_plan(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart")
    return write_plan(tmp, TINY_GPT, gpus=2, **RESTART_PLANS[request.param]), str(tmp / "tiny-gpt.json")


@pytest.fixture(scope="module")
def uninterrupted():
    return reference_run(TINY_GPT, steps=STEPS)[0]


def start(argv: list[str], *, cwd: Path, fault: str | None, **kwargs) -> subprocess.Popen:
    """`meshplan ARGV` in its own process group (so a test that fails can end torchrun and the ranks)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MESHPLAN_FAULT", None)
    if fault:
        env["MESHPLAN_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "planner.cli", *argv], cwd=cwd, env=env, text=True,
                            start_new_session=True, **kwargs)


def end(proc: subprocess.Popen) -> None:
    """Kill what is left of the process group this test started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def meshplan_run(plan, *args: str, cwd: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    plan_path, model = plan
    argv = ["run", "--plan", plan_path, "--model", model, "--steps", str(STEPS), "--json", *args]
    proc = start(argv, cwd=cwd, fault=fault, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        end(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_a_killed_rank_restarts_the_job_which_resumes_from_the_last_checkpoint(tmp_path, restart_plan,
                                                                               uninterrupted):
    """Rank 1 is SIGKILLed at the start of step 6; checkpoints after steps 4 and 8: torchrun restarts
    both ranks, they resume from step 4, and the 12 losses of the run are the uninterrupted ones."""
    done = meshplan_run(restart_plan, "--checkpoint-dir", "ckpt", "--checkpoint-every", str(EVERY), "--max-restarts", "1",
                        "--timeout", "30", cwd=tmp_path, fault="kill:1:6")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kill on rank 1 at step 6" in done.stderr
    assert "resuming from ckpt/step-00000004 (step 4 of 12)" in done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["restart"] == 1 and summary["resumed_from"] == 4
    assert_losses(summary["losses"], uninterrupted)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000012"]   # older ones dropped


def test_an_interrupted_checkpoint_is_never_loaded(tmp_path, plan, uninterrupted):
    """Rank 0 is SIGKILLed while the checkpoint after step 8 is written (every rank's shards are on
    disk, the completion marker is not); no restarts allowed, so the job fails. Starting it again by
    hand resumes from the complete checkpoint of step 4 and ends with the uninterrupted losses."""
    args = ("--checkpoint-dir", "ckpt", "--checkpoint-every", str(EVERY), "--timeout", "20")
    failed = meshplan_run(plan, *args, cwd=tmp_path, fault="kill-in-checkpoint:0:8")
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-1].startswith("meshplan run: rank 0 was killed by SIGKILL")
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [".partial-step-00000008", "step-00000004"]
    partial = ckpt / ".partial-step-00000008"
    assert (partial / ".metadata").exists() and not (partial / "COMPLETE.json").exists()

    again = meshplan_run(plan, *args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from ckpt/step-00000004 (step 4 of 12)" in again.stderr
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["resumed_from"] == 4 and summary["restart"] == 0
    assert_losses(summary["losses"], uninterrupted)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000012"]


def test_a_lost_peer_ends_the_job_with_a_clear_error_within_the_timeout(tmp_path, plan):
    """Rank 1 stops answering at step 2 (it sleeps); rank 0 waits in a collective. With --timeout 3
    the job ends with one line naming the timeout, 3 s (plus the teardown) after rank 1 went silent."""
    plan_path, model = plan
    proc = start(["run", "--plan", plan_path, "--model", model, "--steps", "6", "--timeout", "3"], cwd=tmp_path,
                 fault="hang:1:2", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in proc.stderr))
    reader.start()
    try:
        code = proc.wait(timeout=120)
    finally:
        end(proc)
        reader.join()
    when = {key: next((t for t, line in lines if key in line), None) for key in ("hang on rank 1", "no answer")}
    assert code == 1, "".join(line for _, line in lines)[-3000:]
    assert when["hang on rank 1"] is not None and when["no answer"] is not None, lines
    waited = when["no answer"] - when["hang on rank 1"]
    assert 3.0 <= waited + 0.2 and waited < 3.0 + 10.0, waited
    message = next(line for _, line in lines if "no answer" in line)
    assert re.match(r"meshplan run: error: rank 0: a collective got no answer within --timeout 3 s: a peer "
                    r"process stopped answering", message), message
    assert lines[-1][1].startswith("meshplan run: rank 0 exited with code 1; the job stopped")
