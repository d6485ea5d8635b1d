"""Fault injection: make one rank fail on purpose, to drill what a failure does to a job.

``MESHPLAN_FAULT=KIND:RANK:STEP[:WORLD]`` (several separated by commas) in the environment of
``meshplan run`` makes global rank RANK fail at step STEP, in the job's first attempt only
(torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), so a restarted job runs clean; with WORLD, only
while the job has WORLD processes (an elastic run's world changes without a restart when nodes join):

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
    world: int | None = None        # only in a world of this many processes (None: any)


def parse(text: str) -> tuple[Fault, ...]:
    """'kill:1:6,hang:0:3:4' -> Faults; a UserError naming the variable otherwise."""
    faults = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, *numbers = part.split(":")
        if kind not in KINDS or len(numbers) not in (2, 3) or not all(n.isdigit() for n in numbers):
            raise UserError(f"{part!r} is not KIND:RANK:STEP with KIND {one_of(KINDS)} and RANK, STEP non-negative "
                            "integers, or KIND:RANK:STEP:WORLD (only in a world of WORLD processes)", field=ENV)
        faults.append(Fault(kind=kind, rank=int(numbers[0]), step=int(numbers[1]),
                            world=int(numbers[2]) if len(numbers) == 3 else None))
    return tuple(faults)


def from_env() -> tuple[Fault, ...]:
    return parse(os.environ.get(ENV, ""))


def inject(kind: str, *, rank: int, step: int, world: int | None = None) -> None:
    """Fail here if the environment asks for ``kind`` on this rank at this step (in a world of ``world``
    processes), in the first attempt only."""
    if os.environ.get(ENV) is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if not any(f.kind == kind and f.rank == rank and f.step == step and f.world in (None, world)
               for f in from_env()):
        return
    sys.stderr.write(f"meshplan run: fault injection ({ENV}): {kind} on rank {rank} at step {step}\n")
    sys.stderr.flush()
    if kind == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
