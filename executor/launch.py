"""`meshplan run`: check the plan against --model, launch torchrun, read measured.json back.

torchrun is torch's own launcher (``python -m torch.distributed.run``): standalone
rendezvous on one machine, or ``--nnodes/--node-rank/--rdzv-endpoint`` passed
through for several. Every rank runs ``python -m executor.train``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from planner.errors import UserError
from planner.model import load_model

from .plan_file import RunPlan

# Fields that describe the training run rather than the architecture: a plan for a
# shorter sequence runs the same model.
_RUN_FIELDS = ("name", "seq_len", "source")


def check_model(plan: RunPlan, model: str) -> RunPlan:
    """The architecture --model names must be the one the plan was made for."""
    if plan.spec is None:
        raise UserError("the plan is for a traced module; run it with executor.auto_parallelize inside your "
                        "own torchrun script", source=plan.source, field="model.spec")
    given = load_model(model)
    diffs = [f"{f.name} {getattr(given, f.name)!r} != {getattr(plan.spec, f.name)!r}" for f in fields(given)
             if f.name not in _RUN_FIELDS and getattr(given, f.name) != getattr(plan.spec, f.name)]
    if diffs:
        raise UserError(f"--model {model} is not the model this plan was made for: {'; '.join(diffs)}",
                        source=plan.source, field="model.spec")
    return plan


@dataclass(frozen=True, kw_only=True)
class Launch:
    """How to start the job's processes on this machine."""

    nproc: int                       # processes on this node
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port of the rendezvous (several nodes)

    def torchrun_argv(self) -> list[str]:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.nproc)]
        if self.nnodes == 1 and self.rdzv_endpoint is None:
            return argv + ["--standalone"]
        if self.rdzv_endpoint is None:
            raise UserError("several nodes need a rendezvous endpoint host:port", field="--rdzv-endpoint")
        return argv + ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", self.rdzv_endpoint]


def launch(launch: Launch, train_args: list[str]) -> int:
    """Run torchrun with ``executor.train`` and ``train_args``; its exit code."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)      # so every rank imports this executor
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = launch.torchrun_argv() + ["-m", "executor.train", *train_args]
    return subprocess.run(cmd, env=env).returncode
