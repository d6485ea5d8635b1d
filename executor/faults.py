"""Fault injection: make one rank fail on purpose, to drill what a failure does to a job.

``MESHPLAN_FAULT=KIND:RANK:STEP`` (several separated by commas) in the environment of
``meshplan run`` makes global rank RANK fail at step STEP, in the job's first attempt only
(torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), so a restarted job runs clean:

  kill                 SIGKILL at the start of step STEP: a rank dies mid-training
  hang                 stop answering at the start of step STEP (sleep): a lost peer; the
                       others end with a timeout error after ``--timeout`` seconds
  kill-in-checkpoint   SIGKILL while the checkpoint after step STEP is written: after every
                       rank wrote its shards, before the completion marker

The robustness tests use it; it is also how to check a cluster's restart settings. Without
the variable nothing here runs.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from planner.errors import UserError, one_of

ENV = "MESHPLAN_FAULT"
KINDS = ("kill", "hang", "kill-in-checkpoint")


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    rank: int
    step: int


def parse(text: str) -> tuple[Fault, ...]:
    """'kill:1:6,hang:0:3' -> Faults; a UserError naming the variable otherwise."""
    faults = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, rest = part.partition(":")
        rank, _, step = rest.partition(":")
        if kind not in KINDS or not rank.isdigit() or not step.isdigit():
            raise UserError(f"{part!r} is not KIND:RANK:STEP with KIND {one_of(KINDS)} and RANK, STEP "
                            "non-negative integers", field=ENV)
        faults.append(Fault(kind=kind, rank=int(rank), step=int(step)))
    return tuple(faults)


def from_env() -> tuple[Fault, ...]:
    return parse(os.environ.get(ENV, ""))


def inject(kind: str, *, rank: int, step: int) -> None:
    """Fail here if the environment asks for ``kind`` on this rank at this step (first attempt only)."""
    if os.environ.get(ENV) is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if not any(f.kind == kind and f.rank == rank and f.step == step for f in from_env()):
        return
    sys.stderr.write(f"meshplan run: fault injection ({ENV}): {kind} on rank {rank} at step {step}\n")
    sys.stderr.flush()
    if kind == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
