"""``meshplan profile`` as values: measure this machine and write its cluster profile, or derive the
profile again from the raw measurements an earlier run kept.

    from executor.profile import profile_machine, rederive
    result = profile_machine(device="cpu", nproc=2, threads=1, quick=True, out="here.toml")
    rederive("profiles/measured/h100-sxm5.kernels.json", out="again.toml")

``profile_machine`` writes NAME.toml (what --cluster reads), NAME.kernels.json (every raw
measurement) and, with ``ops_model``, NAME.ops.json (each traced operator timed here); the
collectives are measured by ``python -m executor.profile.collectives`` in a fresh interpreter.
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from planner.config import PRECISIONS
from planner.errors import UserError

from .toml import render

# the folder that holds the executor package: the collective benchmark runs from there, so that its
# interpreter imports this copy of meshplan
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class MachineProfile:
    """What ``profile_machine`` measured and wrote."""
    path: Path                  # the cluster profile TOML (--cluster reads it)
    kernels_path: Path          # NAME.kernels.json beside it: every raw measurement (``rederive`` reads it)
    ops_path: Path | None       # NAME.ops.json beside it: the ops of ``ops_model`` timed here, if asked
    command: str                # the command line that reproduces the measurement
    device: dict                # one device's measurements (device.measure)
    collectives: dict | None    # the collective benchmark's (collectives.py), None for one process


def _quiet(line: str) -> None:
    pass


def measure_collectives(nproc: int, backend: str, *, quick: bool, threads: int) -> dict | None:
    """collectives.py's measurements over ``nproc`` local processes (None below two)."""
    if nproc < 2:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "comm.json"
        cmd = [sys.executable, "-m", "executor.profile.collectives", "--nproc", str(nproc), "--backend", backend,
               "--out", str(out), "--threads", str(threads)] + (["--quick"] if quick else [])
        try:
            # the ranks allocate as the executor's do (executor/launch.py HUGE_PAGES)
            env = {"THP_MEM_ALLOC_ENABLE": "1", **os.environ}
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=PACKAGE_ROOT)
        except subprocess.TimeoutExpired:
            raise UserError(f"{backend} collectives over {nproc} processes did not finish in 30 minutes",
                            field="--nproc") from None
        if proc.returncode != 0 or not out.is_file():
            lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
            # what a process printed before it died (a C++ exception's what(), a Python error) says more
            # than spawn's last line about the exit
            cause = [ln.strip() for ln in lines if "what():" in ln or ln.startswith(("RuntimeError", "terminate"))]
            raise UserError(f"the {backend} benchmark over {nproc} processes failed: {lines[-1]}"
                            + (f" ({cause[-1]})" if cause else ""), field="--nproc")
        return json.loads(out.read_text())


def rederive(kernels_json: str | Path, *, out: str | Path | None = None, name: str | None = None) -> Path:
    """The profile TOML again from the raw measurements in ``kernels_json`` (written by an earlier
    ``profile_machine``), after meshplan's derivations improved; written to ``out`` (default: NAME.toml
    here), that path."""
    from planner.model import read_json
    data = read_json(Path(kernels_json))
    for key in ("command", "date", "host", "nproc", "device"):
        if key not in data:
            raise UserError("missing (written by `meshplan profile`)", source=str(kernels_json), field=key)
    out = Path(out or Path(kernels_json).name.replace(".kernels.json", ".toml"))
    if out.suffix != ".toml":
        raise UserError("must end in .toml", field="--out")
    text = render(data["device"], data.get("collectives"), name=name or f"measured-{data['host']}",
                  command=data["command"], host=data["host"], date=data["date"], nproc=data["nproc"])
    _check(text, out)
    out.write_text(text)
    return out


def profile_machine(*, device: str | None = None, nproc: int | None = None, threads: int = 1, quick: bool = False,
                    out: str | Path | None = None, name: str | None = None, ops_model: str | None = None,
                    example_input: str | None = None,
                    progress: Callable[[str], None] = _quiet) -> MachineProfile:
    """Measure this machine's ``device`` ("cpu" or "cuda"; default cuda when present) with ``threads``
    CPU threads per process, the collectives over ``nproc`` local processes (default: the GPUs, or 2
    on a CPU), and write the profile to ``out`` (default ./<hostname>.toml) under ``name`` (default
    measured-<hostname>); with ``ops_model``, also time its traced ops here. ``quick``: fewer shapes
    and message sizes. ``progress`` is told each file as it is written ("wrote PATH ...")."""
    import torch

    from .device import measure
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("no CUDA device is visible to torch", field="--device")
    nproc = nproc if nproc is not None else (torch.cuda.device_count() if device == "cuda" else 2)
    if nproc < 1:
        raise UserError(f"must be at least 1, got {nproc}", field="--nproc")
    if threads < 1:
        raise UserError(f"must be at least 1, got {threads}", field="--threads")
    host = socket.gethostname() or "localhost"
    out = Path(out or f"{host}.toml")
    if out.suffix != ".toml":
        raise UserError("must end in .toml", field="--out")
    command = _command(nproc=nproc, device=device, threads=threads, out=out, quick=quick, ops_model=ops_model,
                       example_input=example_input)
    dtypes = ["fp32"] if device == "cpu" else list(PRECISIONS)
    m = measure(device, dtypes, threads=threads, quick=quick)
    backend = "nccl" if device == "cuda" and torch.cuda.device_count() >= nproc else "gloo"
    if device == "cuda" and backend == "gloo" and nproc > 1:
        sys.stderr.write(f"meshplan profile: warning: {torch.cuda.device_count()} GPU(s) for {nproc} processes: "
                         "collectives are measured with gloo between CPU processes, not over the GPUs\n")
    comm = measure_collectives(nproc, backend, quick=quick, threads=threads)
    date = datetime.date.today().isoformat()
    text = render(m, comm, name=name or f"measured-{host}", command=command, host=host, date=date, nproc=nproc)
    _check(text, out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as e:
        raise UserError(f"cannot write: {e.strerror}", source=str(out)) from None
    progress(f"wrote {out}")
    kernels = out.with_name(out.name[:-len(".toml")] + ".kernels.json")
    kernels.write_text(json.dumps({"command": command, "date": date, "host": host, "nproc": nproc, "device": m,
                                   "collectives": comm}, indent=0) + "\n")
    progress(f"wrote {kernels} (every raw measurement, the kernel sweeps included)")
    ops = None
    if ops_model:
        from .ops import profile_ops
        ops = profile_ops(ops_model, example_input=example_input, profile=out, command=command, device=device,
                          threads=threads)
        progress(f"wrote {ops}")
    return MachineProfile(path=out, kernels_path=kernels, ops_path=ops, command=command, device=m, collectives=comm)


def _command(*, nproc: int, device: str, threads: int, out: Path, quick: bool, ops_model: str | None,
             example_input: str | None) -> str:
    """The command line that reproduces this measurement."""
    parts = ["meshplan", "profile", "--nproc", str(nproc), "--device", device, "--threads", str(threads),
             "--out", str(out)]
    if ops_model:
        parts += ["--ops", ops_model] + (["--example-input", example_input] if example_input else [])
    if quick:
        parts.append("--quick")
    return " ".join(shlex.quote(p) for p in parts)


def _check(text: str, out: Path) -> None:
    """What we write must be what --cluster reads."""
    import tomllib

    from planner.cluster import parse_cluster
    parse_cluster(tomllib.loads(text), str(out))
