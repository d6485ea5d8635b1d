"""`meshplan run`: check the plan against --model, launch torchrun, read measured.json back.

torchrun is torch's own launcher (``python -m torch.distributed.run``): standalone
rendezvous on one machine, or ``--nnodes/--node-rank/--rdzv-endpoint`` passed
through for several; ``--max-restarts N`` lets its elastic agent restart the
whole job (every rank, a new rendezvous round) when a rank dies, up to N times.
``--elastic MIN:MAX`` is torchrun's ``--nnodes MIN:MAX`` with the c10d rendezvous
at ``--rdzv-endpoint``: the job goes on with between MIN and MAX nodes, and
every rank re-plans for the world it finds (executor/elastic.py).
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
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from planner.errors import UserError
from planner.plan import Plan

from . import faults
from .checkpoint_dir import CHANGES, STOPPED, check_resumable, latest_complete, read_json
from .mesh import local_device_kind
from .support import DEFAULT_TIMEOUT_S, check_stages, check_supported


# What torch's c10d rendezvous reads of --rdzv-conf (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py
# ``create_handler``, c10d_rendezvous_backend.py ``_create_tcp_store``): seconds (join 600, last call 30, close 30,
# heartbeat 5, keep-alive interval 5, read 60 by default), keep-alives a node may miss before it counts as dead
# (3), and whether this node hosts the rendezvous's store (1 or 0; default: the node at the endpoint's address)
RDZV_CONF = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
             "keep_alive_max_attempt", "read_timeout", "is_host")


def parse_rdzv_conf(text: str) -> str:
    """'last_call_timeout=2,join_timeout=60' checked against ``RDZV_CONF``; the same text, or UserError."""
    pairs = [p.strip() for p in text.split(",") if p.strip()]
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in RDZV_CONF:
            raise UserError(f"{pair!r} is not KEY=VALUE with KEY one of {', '.join(RDZV_CONF)}", field="--rdzv-conf")
        allowed = ("0", "1") if key == "is_host" else None
        if (allowed and value not in allowed) or (not allowed and (not value.isdigit() or int(value) < 1)):
            raise UserError(f"{key}={value!r}: expected " + ("1 or 0" if allowed else "a positive integer"),
                            field="--rdzv-conf")
    return ",".join(pairs)


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel hands out for port 0 and outgoing connections (Linux's default 32768-60999)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port for a rendezvous on ``host`` that no process holds now, chosen below the kernel's
    ephemeral range. A port the kernel picked (bind to 0) can be handed again to any outgoing
    connection between its release here and the store's bind in a process that starts seconds later:
    gloo's pair connections of a concurrent job took it in a test run on 2 cores (EADDRINUSE, 70 tests
    errored). Below the range only another explicit choice can take it."""
    low, _ = _ephemeral_ports()
    for _ in range(64):
        port = random.randrange(20000, low) if low > 21000 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host} below the ephemeral range ({low})")


@dataclass(frozen=True, kw_only=True)
class Launch:
    """How to start the job's processes on this machine."""

    nproc: int                       # processes on this node
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port of the rendezvous (several nodes)
    max_restarts: int = 0             # times torchrun restarts the job after a rank fails
    elastic: tuple[int, int] | None = None    # (MIN, MAX) nodes: torchrun's --nnodes MIN:MAX (executor/elastic.py)
    rdzv_conf: str = ""               # torchrun's --rdzv-conf (``parse_rdzv_conf``)

    def torchrun_args(self) -> list[str]:
        """torchrun's options (``python -m torch.distributed.run OPTIONS -m executor.train ...``)."""
        args = ["--max-restarts", str(self.max_restarts), "--nproc-per-node", str(self.nproc)]
        conf = ["--rdzv-conf", self.rdzv_conf] if self.rdzv_conf else []
        if self.elastic is not None:        # check_request: with an endpoint
            return args + ["--nnodes", "{}:{}".format(*self.elastic), "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", self.rdzv_endpoint, *conf]
        if self.nnodes == 1 and self.rdzv_endpoint is None:
            return args + ["--standalone", *conf]       # c10d rendezvous on localhost, a free port
        if self.rdzv_endpoint is None:
            raise UserError("several nodes need a rendezvous endpoint host:port", field="--rdzv-endpoint")
        return args + ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", self.rdzv_endpoint, *conf]


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
    if request.launch.elastic is not None:
        if not request.checkpoint_dir:
            raise UserError("needs --checkpoint-dir DIR, on a file system every node sees: a changed world "
                            "continues from its latest checkpoint", field="--elastic")
        if request.launch.rdzv_endpoint is None:
            raise UserError("needs --rdzv-endpoint HOST:PORT, where the nodes' agents meet (the same on every "
                            "node; the node at HOST hosts the rendezvous and must stay)", field="--elastic")
        if request.launch.nnodes != 1 or request.launch.node_rank != 0:
            flag = "--nnodes" if request.launch.nnodes != 1 else "--node-rank"
            raise UserError("--elastic MIN:MAX says how many nodes, and the rendezvous numbers them; allowed: "
                            f"--elastic without {flag}", field=flag)
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


def run_plan(plan: Plan, plan_path: str, request: RunRequest, *,
             debug: bool = False) -> tuple[int, dict | None, list[dict]]:
    """Train ``plan`` (read from ``plan_path``) with torchrun: (the job's exit code, measured.json's document,
    None on a node without rank 0 or when the job failed, the changes of plan an elastic job made: entries
    of DIR/plan-changes.json, executor/elastic.py). The plan is checked against this executor (runtime
    table, stages) and the request before anything launches. An elastic job that stopped because no plan
    fits the world left raises its one line (UserError, exit code 3)."""
    check_supported(plan.config, plan.spec, local_device_kind(), plan.source, plan.workload.fp8, plan.workload.compile,
                    finetune=plan.workload.finetune)
    check_stages(plan.stages, plan.spec, plan.source)
    check_request(request)
    nproc, nnodes = request.launch.nproc, request.launch.nnodes
    elastic = request.launch.elastic is not None
    if nproc * nnodes != plan.world_size and not elastic:     # an elastic job re-plans for the world it finds
        raise UserError(f"{nnodes} node(s) x {nproc} processes = {nproc * nnodes}, but the plan needs "
                        f"{plan.world_size} (dp x tp x pp x cp)", field="--nproc")
    out = Path(request.out)
    out.unlink(missing_ok=True)
    train_args = ["--plan", plan_path, "--model", request.model, "--steps", str(request.steps),
                  "--seed", str(request.seed), "--out", str(out), "--timeout", repr(request.timeout_s),
                  *(["--elastic"] if elastic else [])]
    for flag, value in (("--save", request.save), ("--load", request.load), ("--checkpoint-dir", request.checkpoint_dir),
                        ("--checkpoint-every", request.checkpoint_every)):
        if value:
            train_args += [flag, str(value)]
    started = time.time()
    code = launch(request.launch, train_args, debug=debug)
    changes = [c for c in read_json(Path(request.checkpoint_dir) / CHANGES) or [] if c.get("time", 0) >= started
               ] if elastic else []
    stopped = read_json(Path(request.checkpoint_dir) / STOPPED) if elastic else None
    if code == 0 and isinstance(stopped, dict) and stopped.get("time", 0) >= started:
        error = UserError(str(stopped.get("message")))     # no plan fits the world left (executor/elastic.py)
        error.exit_code = int(stopped.get("exit_code", 3))
        raise error
    # rank 0 writes measured.json: on node 0, or on whichever node the rendezvous gave rank 0 in an elastic job
    if code != 0 or request.launch.node_rank != 0 or (elastic and not out.exists()):
        return code, None, changes
    return 0, json.loads(out.read_text()), changes
