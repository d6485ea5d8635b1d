"""Elastic runs end to end: `meshplan run --elastic 1:2`, two torchrun agents on localhost (two "nodes").

A node is lost by SIGKILLing its agent and every process under it (torchrun starts its workers in
sessions of their own, so the agent's process group alone would leave them running). To lose it
right after a checkpoint, that node's ranks stop answering at the start of the step after it
(MESHPLAN_FAULT=hang, only in the world the run starts in: executor/faults.py); the test waits for
the checkpoint and that line, then kills the node. The rendezvous's timeouts are shortened
(--rdzv-conf), and the agent at the endpoint hosts the rendezvous (is_host=1), so it is the one
that stays. Each run is compared with runs made apart from the code under test: a 2-process run of
another plan from a copy of the checkpoint (spawned while the node left waits out the rendezvous), and
the single-process reference (executor_support).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT
from executor_support import (TINY_GPT, assert_losses, free_port, reference_run, resumed_run, spawn,
                              write_plan)

pytestmark = pytest.mark.distributed      # torchrun agents, one of them killed

STEPS, EVERY = 8, 4
# the rendezvous takes a node whose last keep-alive is older than 1 s x 4 for lost (sooner resumes sooner, but an
# agent sends one every 1 to 2 s, later on a loaded machine: at 1 s x 2 a live node was once taken for lost); a
# round waits 2 s for more nodes once one is there (torch's defaults: 5 s x 3, 30 s)
RDZV = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=4,join_timeout=60"
# the agent that does not host the rendezvous starts first and waits for the store of the one that does, so that
# both are in the first round (the round closes at once with both, 2 s after the first without the other)
HEAD_START_S = 1.5


def agent(plan: str, cwd: Path, ckpt: Path, port: int, *, nproc: int, host: bool, fault: str | None = None,
          json_out: bool = True) -> subprocess.Popen:
    """One node: `meshplan run --elastic 1:2` in ``cwd``, its output in cwd/out and cwd/err."""
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MESHPLAN_FAULT", None)
    if fault:
        env["MESHPLAN_FAULT"] = fault
    argv = ["run", "--plan", plan, "--model", str(Path(plan).parent / "tiny-gpt.json"), "--steps", str(STEPS),
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY), "--elastic", "1:2", "--nproc", str(nproc),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", f"{RDZV},is_host={int(host)}", "--timeout", "60",
            *(["--json"] if json_out else [])]
    return subprocess.Popen([sys.executable, "-m", "planner.cli", *argv], cwd=cwd, env=env,
                            stdout=open(cwd / "out", "w"), stderr=open(cwd / "err", "w"), start_new_session=True)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if stat:
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found = [pid]
    for p in found:
        found += children.get(p, [])
    return found


def kill_node(proc: subprocess.Popen) -> None:
    """A node lost: its agent and its workers SIGKILLed."""
    for pid in descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_for(what: str, check, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert proc.poll() is None, f"the agent ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)


def paused_after_checkpoint(node: Path, ckpt: Path, step: int):
    """Whether ``node``'s ranks stopped at ``step`` (the fault's line) with the checkpoint of ``step`` complete."""
    return lambda: ("fault injection" in (node / "err").read_text()
                    and (ckpt / f"step-{step:08d}" / "COMPLETE.json").exists())


def finish(*procs: subprocess.Popen, timeout_s: float = 120) -> None:
    try:
        for proc in procs:
            proc.wait(timeout=timeout_s)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_node(proc)


def last_json(node: Path) -> dict:
    return json.loads((node / "out").read_text().strip().splitlines()[-1])


def _continue(plan_path: str, load: str, steps: int, out: str) -> None:
    import torch.distributed as dist
    from executor.plan_file import load_plan
    from executor.train import RunOptions, run
    measured = run(load_plan(plan_path), RunOptions(steps=steps, load_dir=load))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(measured))


def test_a_node_lost_after_a_checkpoint_leaves_a_job_replanned_for_the_processes_left(tmp_path):
    """4 processes (2 nodes x 2) under dp 4; the second node is lost after the checkpoint of step 4. The two
    processes left re-plan for 2 (dp 4 cannot hold: searched), reshard the checkpoint and finish; their
    losses are those of an undisturbed 2-process run of another plan from a copy of that checkpoint."""
    four = write_plan(tmp_path, TINY_GPT, gpus=4, name="four", dp=4, zero=3)
    other = write_plan(tmp_path, TINY_GPT, gpus=2, name="two-zero1", dp=2, zero=1)
    ckpt, port = tmp_path / "ckpt", free_port()
    second = agent(four, tmp_path / "second", ckpt, port, nproc=2, host=False,
                   fault=",".join(f"hang:{rank}:{EVERY}:4" for rank in range(4)))
    time.sleep(HEAD_START_S)
    first = agent(four, tmp_path / "first", ckpt, port, nproc=2, host=True)
    failed: list[BaseException] = []

    def undisturbed_run():       # while the node left waits out the rendezvous
        try:
            spawn(_continue, 2, other, str(tmp_path / "at-4"), STEPS - EVERY, str(tmp_path / "undisturbed.json"))
        except BaseException as e:
            failed.append(e)
    reference = threading.Thread(target=undisturbed_run)
    try:
        wait_for("pause after the checkpoint", paused_after_checkpoint(tmp_path / "second", ckpt, EVERY), first)
        shutil.copytree(ckpt / f"step-{EVERY:08d}", tmp_path / "at-4")
        kill_node(second)
        reference.start()
    finally:
        finish(first, second)
        if reference.is_alive():
            reference.join()
    assert not failed, failed
    err = (tmp_path / "first" / "err").read_text()
    assert first.returncode == 0, err[-3000:]
    summary = last_json(tmp_path / "first")
    # every step once, in order: 4 in the world of 4, then 4 in the world of 2 (none lost, none run twice)
    assert summary["world_sizes"] == [4] * EVERY + [2] * (STEPS - EVERY), summary["world_sizes"]
    assert summary["resumed_from"] == EVERY and summary["restart"] == 1
    [change] = summary["plan_changes"]
    assert change == json.loads((ckpt / "plan-changes.json").read_text())[0]
    assert (change["step"], change["from"]["world_size"], change["to"]["world_size"]) == (EVERY, 4, 2)
    assert change["from"]["plan"] == four and change["to"]["config"]["dp"] * change["to"]["config"]["cp"] == 2
    assert change["searched_instead"][0].startswith("--dp 4 searched instead")
    assert change["steps_redone"] == 0 and change["lost_s"] >= change["idle_s"] > 0
    assert change["to"]["step_time_s"] > 0 and change["from"]["step_time_s"] > 0
    assert "the world has 2 processes, the plan at step 4 was made for 4: continuing under" in err

    undisturbed = json.loads((tmp_path / "undisturbed.json").read_text())["losses"]
    assert_losses(summary["losses"][EVERY:], undisturbed, against="undisturbed 2-process")
    assert_losses(summary["losses"], reference_run(TINY_GPT, steps=STEPS)[0], against="single-process")


def test_a_node_that_joins_grows_the_job_to_4_processes_under_a_new_plan(tmp_path):
    """One node (2 processes, dp 2) trains alone; after the checkpoint of step 4 a second node joins: the
    job restarts as 4 processes, re-planned for 4, and finishes with the single-process reference's losses.
    `meshplan run` prints the change on both nodes."""
    two = write_plan(tmp_path, TINY_GPT, gpus=2, name="two", dp=2, zero=3)
    ckpt, port = tmp_path / "ckpt", free_port()
    first = agent(two, tmp_path / "first", ckpt, port, nproc=2, host=True, json_out=False,
                  fault=f"hang:0:{EVERY}:2,hang:1:{EVERY}:2")
    second = None
    try:
        wait_for("pause after the checkpoint", paused_after_checkpoint(tmp_path / "first", ckpt, EVERY), first)
        second = agent(two, tmp_path / "second", ckpt, port, nproc=2, host=False, json_out=False)
    finally:
        finish(first, *([second] if second else []))
    for node, proc in (("first", first), ("second", second)):
        assert proc.returncode == 0, (tmp_path / node / "err").read_text()[-3000:]
        out = (tmp_path / node / "out").read_text()
        assert re.search(r"^plan change at step 4: 2 -> 4 processes\n  before  dp 2 .*\n  after   .*\n"
                         r"  lost    [0-9.]+ s from the checkpoint of step 4", out, re.MULTILINE), out
    [change] = json.loads((ckpt / "plan-changes.json").read_text())
    new = Path(change["to"]["plan"])
    assert new.parent == ckpt / "plans" and json.loads(new.read_text())["fingerprints"]["world_size"] == 4
    assert change["to"]["config"] != change["from"]["config"]
    [measured] = [json.loads(p.read_text()) for p in tmp_path.glob("*/measured.json")]   # where rank 0 ran
    assert measured["world_sizes"] == [2] * EVERY + [4] * (STEPS - EVERY) and measured["world_size"] == 4
    assert_losses(measured["losses"], reference_run(TINY_GPT, steps=STEPS)[0], against="single-process")


SMALL = """\
base = "cpu-gloo"
name = "cpu-gloo-small"
description = "cpu-gloo with 4 MiB per process: the tiny GPT fits on 2 processes, not on 1"
[gpu]
memory_GiB = 0.004
[runtime]
reserved_GiB = 0.0
"""


def test_a_world_too_small_for_the_model_stops_with_one_line_and_keeps_the_checkpoint(tmp_path):
    """2 nodes x 1 process on a profile whose processes hold the tiny GPT only in pairs; one node is lost
    after the checkpoint of step 4. The job stops with exit code 3 and one line naming the fewest GPUs
    that fit; the checkpoint left loads and trains on as the single-process reference does."""
    cluster = tmp_path / "small.toml"
    cluster.write_text(SMALL)
    two = write_plan(tmp_path, TINY_GPT, gpus=2, name="two", cluster=str(cluster), precision="fp32", dp=2, zero=3,
                     optimizer_offload=False)
    ckpt, port = tmp_path / "ckpt", free_port()
    second = agent(two, tmp_path / "second", ckpt, port, nproc=1, host=False,
                   fault=f"hang:0:{EVERY}:2,hang:1:{EVERY}:2")
    time.sleep(HEAD_START_S)
    first = agent(two, tmp_path / "first", ckpt, port, nproc=1, host=True)
    try:
        wait_for("pause after the checkpoint", paused_after_checkpoint(tmp_path / "second", ckpt, EVERY), first)
        kill_node(second)
    finally:
        finish(first, second)
    err = (tmp_path / "first" / "err").read_text().strip().splitlines()
    assert first.returncode == 3, err[-20:]
    assert re.fullmatch(r"meshplan run: error: 1 process cannot hold tiny-gpt: its fixed knobs \(dp1 .*\) need "
                        r"[0-9.e-]+ GiB per GPU against [0-9.e-]+ GiB usable; it needs at least 2 GPUs of "
                        r"cpu-gloo-small; the checkpoint after step 4 is kept in \S+/step-00000004; run the same "
                        r"command again once there are enough", err[-1]), err[-1]
    printed = json.loads((tmp_path / "first" / "out").read_text())
    assert (printed["error"], printed["exit_code"]) == (err[-1].removeprefix("meshplan run: error: "), 3)
    assert not (ckpt / "plan-changes.json").exists()
    after_4 = resumed_run(str(ckpt / "step-00000004"), TINY_GPT, steps=STEPS - EVERY)
    assert_losses(after_4, reference_run(TINY_GPT, steps=STEPS)[0][EVERY:], against="single-process")
