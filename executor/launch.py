"""`meshplan run`: check the plan against --model, launch torchrun, read measured.json back.

torchrun is torch's own launcher (``python -m torch.distributed.run``): standalone
rendezvous on one machine, or ``--nnodes/--node-rank/--rdzv-endpoint`` passed
through for several; ``--max-restarts N`` lets its elastic agent restart the
whole job (every rank, a new rendezvous round) when a rank dies, up to N times.
Every rank runs ``python -m executor.train``. ``executor/torchrun.py`` runs
torchrun's own launcher and turns a failed job into one line.

Only code from paths the user names runs: the launched interpreters get
``PYTHONSAFEPATH=1`` (no current directory or script folder on ``sys.path``) and
``PYTHONPATH`` starting with this checkout, so a ``torch.py`` or ``executor/``
lying in the working directory is never imported instead.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from planner.errors import UserError
from planner.plan import Plan

from . import faults
from .checkpoint_dir import check_resumable, latest_complete
from .mesh import local_device_kind
from .support import DEFAULT_TIMEOUT_S, check_stages, check_supported


@dataclass(frozen=True, kw_only=True)
class Launch:
    """How to start the job's processes on this machine."""

    nproc: int                       # processes on this node
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port of the rendezvous (several nodes)
    max_restarts: int = 0             # times torchrun restarts the job after a rank fails

    def torchrun_args(self) -> list[str]:
        """torchrun's options (``python -m torch.distributed.run OPTIONS -m executor.train ...``)."""
        args = ["--max-restarts", str(self.max_restarts), "--nproc-per-node", str(self.nproc)]
        if self.nnodes == 1 and self.rdzv_endpoint is None:
            return args + ["--standalone"]       # c10d rendezvous on localhost, a free port
        if self.rdzv_endpoint is None:
            raise UserError("several nodes need a rendezvous endpoint host:port", field="--rdzv-endpoint")
        return args + ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", self.rdzv_endpoint]


# torch's CPU allocator (c10 alloc_cpu) has no cache: glibc maps every allocation of 32 MiB or more
# anew (mallopt(3): the mmap threshold adapts up to DEFAULT_MMAP_THRESHOLD_MAX, 32 MiB on 64-bit) and
# unmaps it on free, so each step faults its large CPU tensors in again, 4 KiB at a time (the logits
# and their gradients; FSDP2's flat all-gather and reduce-scatter buffers). THP_MEM_ALLOC_ENABLE=1
# (read by c10 when the process starts) aligns allocations of 2 MiB or more to 2 MiB and madvises
# them MADV_HUGEPAGE: 512 times fewer faults. Measured on the 2-core VM: a fresh 64 MiB
# clone took 16,385 minor faults and 31 ms, with it 544 faults and 15.6 ms (a copy into a reused
# buffer: 10.6 ms); tests/test_launch_env.py checks the fault counts. GPU ranks keep their large
# tensors in device memory: their host allocations are few, and aligned alike.
HUGE_PAGES = ("THP_MEM_ALLOC_ENABLE", "1")


def launch_env() -> dict[str, str]:
    """The environment of the launched processes: this checkout first on the path, nothing from the
    working directory, one thread per process unless the user set OMP_NUM_THREADS, large CPU tensors
    on huge pages unless the user set THP_MEM_ALLOC_ENABLE."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)      # so every rank imports this executor
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PYTHONSAFEPATH"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")                  # what torchrun sets (and announces) otherwise
    env.setdefault(*HUGE_PAGES)
    # A restarted job must not share the rendezvous TCPStore of the failed attempt: process groups
    # would read the dead ranks' addresses from it (pytorch/pytorch#135712, "TORCH_DISABLE_SHARE_RDZV_
    # TCP_STORE=0 is not compatible with torchelastic restarts"); rank 0 hosts a fresh store per attempt.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def launch(launch: Launch, train_args: list[str], *, debug: bool = False) -> int:
    """Run torchrun with ``executor.train`` and ``train_args``; the exit code of the job (that of
    the first rank that failed, 0 when all succeeded)."""
    cmd = [sys.executable, "-m", "executor.torchrun", *(["--debug"] if debug else []), *launch.torchrun_args(),
           "-m", "executor.train", *train_args]
    return subprocess.run(cmd, env=launch_env()).returncode


@dataclass(frozen=True, kw_only=True)
class RunRequest:
    """What `meshplan run` asks for besides the plan: the steps and data, checkpoints, failures, the launch."""

    model: str                          # the model the plan is for: a zoo name or config.json
    steps: int                          # optimizer steps (a restartable run's total)
    seed: int = 0                       # data and initialisation seed
    save: str | None = None             # save a checkpoint after the last step
    load: str | None = None             # resume from a checkpoint (any plan's)
    checkpoint_dir: str | None = None   # restartable run: resume from and checkpoint into this folder
    checkpoint_every: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    out: str = "measured.json"
    launch: Launch


def check_request(request: RunRequest) -> None:
    """Flags that cannot work together, before anything is launched (UserError naming the flag)."""
    if request.checkpoint_every is not None and not request.checkpoint_dir:
        raise UserError("needs --checkpoint-dir DIR (where the checkpoints go)", field="--checkpoint-every")
    if request.checkpoint_dir:
        for flag, value in (("--load", request.load), ("--save", request.save)):
            if value:
                raise UserError(f"{flag} and --checkpoint-dir both say where checkpoints are; allowed: one of "
                                "them (--checkpoint-dir resumes from and saves into DIR)", field=flag)
        folder = Path(request.checkpoint_dir)
        if folder.exists() and not folder.is_dir():
            raise UserError("exists and is not a folder; allowed: a folder, or a path to create",
                            source=request.checkpoint_dir, field="--checkpoint-dir")
        found = latest_complete(folder)
        if found is not None:
            check_resumable(folder, found[1], steps=request.steps, seed=request.seed)
    faults.from_env()       # a malformed MESHPLAN_FAULT fails here, not in every rank


def run_plan(plan: Plan, plan_path: str, request: RunRequest, *, debug: bool = False) -> tuple[int, dict | None]:
    """Train ``plan`` (read from ``plan_path``) with torchrun: (the job's exit code, measured.json's document,
    None on a node other than node 0 or when the job failed). The plan is checked against this executor
    (runtime table, stages) and the request before anything launches."""
    check_supported(plan.config, plan.spec, local_device_kind(), plan.source, plan.workload.fp8, plan.workload.compile,
                    finetune=plan.workload.finetune)
    check_stages(plan.stages, plan.spec, plan.source)
    check_request(request)
    nproc, nnodes = request.launch.nproc, request.launch.nnodes
    if nproc * nnodes != plan.world_size:
        raise UserError(f"{nnodes} node(s) x {nproc} processes = {nproc * nnodes}, but the plan needs "
                        f"{plan.world_size} (dp x tp x pp x cp)", field="--nproc")
    out = Path(request.out)
    out.unlink(missing_ok=True)
    train_args = ["--plan", plan_path, "--model", request.model, "--steps", str(request.steps),
                  "--seed", str(request.seed), "--out", str(out), "--timeout", repr(request.timeout_s)]
    for flag, value in (("--save", request.save), ("--load", request.load), ("--checkpoint-dir", request.checkpoint_dir),
                        ("--checkpoint-every", request.checkpoint_every)):
        if value:
            train_args += [flag, str(value)]
    code = launch(request.launch, train_args, debug=debug)
    if code != 0 or request.launch.node_rank != 0:        # rank 0 (on node 0) writes measured.json
        return code, None
    return 0, json.loads(out.read_text())
