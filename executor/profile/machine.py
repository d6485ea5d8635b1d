"""``meshplan profile``: measure this machine, write the profile TOML (and NAME.ops.json with --ops).

The collectives are measured by ``python -m executor.profile.collectives`` in a fresh interpreter.
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
from pathlib import Path

from planner.config import PRECISIONS
from planner.errors import UserError

from .toml import render

# the folder that holds the executor package: the collective benchmark runs from there, so that its
# interpreter imports this copy of meshplan
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


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


def _ops(args, out: Path, command: str, device: str) -> Path:
    from planner.trace.load import trace_any
    from planner.trace.measured import ops_path_for, write_ops_profile

    from .ops import time_ops
    result, _ = trace_any(args.ops, args.example_input, keep_replays=True, device=device)
    import torch
    torch.set_num_threads(args.threads)
    entries, failed = time_ops(result, device=device)
    for line in failed:
        sys.stderr.write(f"meshplan profile: not timed (roofline kept): {line}\n")
    path = ops_path_for(out)
    write_ops_profile(path, command=command, device=device, dtype=result.capture.activation_dtype.replace("torch.", ""),
                      model=args.ops, seq_len=result.graph.seq_len, tokens=result.tokens, entries=entries)
    return path


def rederive(args) -> int:
    """``meshplan profile --from NAME.kernels.json``: the profile TOML again from stored measurements."""
    from planner.model import read_json
    data = read_json(Path(args.from_json))
    for key in ("command", "date", "host", "nproc", "device"):
        if key not in data:
            raise UserError("missing (written by `meshplan profile`)", source=args.from_json, field=key)
    out = Path(args.out or Path(args.from_json).name.replace(".kernels.json", ".toml"))
    if out.suffix != ".toml":
        raise UserError("must end in .toml", field="--out")
    text = render(data["device"], data.get("collectives"), name=args.name or f"measured-{data['host']}",
                  command=data["command"], host=data["host"], date=data["date"], nproc=data["nproc"])
    _check(text, out)
    out.write_text(text)
    sys.stdout.write(f"wrote {out} (derived from {args.from_json})\n")
    return 0


def profile_command(args) -> int:
    if getattr(args, "from_json", None):
        return rederive(args)
    import torch
    from .device import measure
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("no CUDA device is visible to torch", field="--device")
    nproc = args.nproc if args.nproc is not None else (torch.cuda.device_count() if device == "cuda" else 2)
    if nproc < 1:
        raise UserError(f"must be at least 1, got {nproc}", field="--nproc")
    if args.threads < 1:
        raise UserError(f"must be at least 1, got {args.threads}", field="--threads")
    host = socket.gethostname() or "localhost"
    out = Path(args.out or f"{host}.toml")
    if out.suffix != ".toml":
        raise UserError("must end in .toml", field="--out")
    command = _command(args, nproc, device, out)
    dtypes = ["fp32"] if device == "cpu" else list(PRECISIONS)
    m = measure(device, dtypes, threads=args.threads, quick=args.quick)
    backend = "nccl" if device == "cuda" and torch.cuda.device_count() >= nproc else "gloo"
    if device == "cuda" and backend == "gloo" and nproc > 1:
        sys.stderr.write(f"meshplan profile: warning: {torch.cuda.device_count()} GPU(s) for {nproc} processes: "
                         "collectives are measured with gloo between CPU processes, not over the GPUs\n")
    comm = measure_collectives(nproc, backend, quick=args.quick, threads=args.threads)
    date = datetime.date.today().isoformat()
    text = render(m, comm, name=args.name or f"measured-{host}", command=command, host=host, date=date, nproc=nproc)
    _check(text, out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as e:
        raise UserError(f"cannot write: {e.strerror}", source=str(out)) from None
    sys.stdout.write(f"wrote {out}\n")
    kernels = out.with_name(out.name[:-len(".toml")] + ".kernels.json")
    kernels.write_text(json.dumps({"command": command, "date": date, "host": host, "nproc": nproc, "device": m,
                                   "collectives": comm}, indent=0) + "\n")
    sys.stdout.write(f"wrote {kernels} (every raw measurement, the kernel sweeps included)\n")
    if args.ops:
        sys.stdout.write(f"wrote {_ops(args, out, command, device)}\n")
    if args.json:
        json.dump({"device": m, "collectives": comm}, sys.stdout)
        sys.stdout.write("\n")
    return 0


def _command(args, nproc: int, device: str, out: Path) -> str:
    """The command line that reproduces this measurement."""
    parts = ["meshplan", "profile", "--nproc", str(nproc), "--device", device, "--threads", str(args.threads),
             "--out", str(out)]
    if args.ops:
        parts += ["--ops", args.ops] + (["--example-input", args.example_input] if args.example_input else [])
    if args.quick:
        parts.append("--quick")
    return " ".join(shlex.quote(p) for p in parts)


def _check(text: str, out: Path) -> None:
    """What we write must be what --cluster reads."""
    import tomllib

    from planner.cluster import parse_cluster
    parse_cluster(tomllib.loads(text), str(out))
