"""What-if: how the best plan changes when one thing changes (`meshplan whatif`, ``planner.api.whatif``).

    meshplan whatif --model llama3-70b --cluster h100-80g --sweep gpus=64,128,...,1024 --out whatif/

For every value of the swept quantity the best plan is searched again (the same search
as `meshplan plan`, finalists ranked by the simulation) and one row is kept: throughput,
MFU, memory, the chosen strategy, and the cost per million tokens where the cluster
profile has a price per GPU-hour. Writes whatif.csv, whatif.json and the plots.
"""
from __future__ import annotations

import csv
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .cluster import GiB
from .errors import UserError, one_of

SWEEPS = {   # key -> (what it changes, unit)
    "gpus": ("number of GPUs", ""),
    "bandwidth": ("inter-node bandwidth per NIC", "Gb/s"),
    "gpu": ("GPU type (cluster profile)", ""),
    "global_batch": ("global batch", "sequences"),
    "seq_len": ("sequence length", "tokens"),
    "precision": ("precision or FP8 recipe", ""),
}
_NAMED = ("gpu", "precision")      # sweeps over names, not numbers


@dataclass(frozen=True, kw_only=True)
class Point:
    """The best plan at one value of the sweep."""

    value: str
    gpus: int | None                # None, global_batch and seq_len too: a point not run (``not_run``) where
    global_batch: int | None        # they were left out and follow from GPUs it cannot have
    seq_len: int | None
    fits: bool
    not_run: str = ""               # why this point has no plan at all: its GPU or runtime does not run the
                                    # precision, or its nodes the GPUs do not fill (the other points still run)
    strategy: str = ""              # the chosen layout and knobs
    layout: str = ""                # the same, short: "dp32 tp4 pp8 cp1 ZeRO-1 mb1, 1f1b"
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    memory_gib: float = 0.0
    capacity_gib: float = 0.0
    usd_per_million_tokens: float | None = None
    kwh_per_million_tokens: float | None = None    # planner/energy.py (None: the profile has no [power])
    search_s: float = 0.0


def differs(points: list[Point], attr: str, key: str) -> bool:
    """Whether the planned points differ in ``attr`` (gpus, global_batch, seq_len) besides the swept ``key``: a
    ``gpu=`` sweep without --gpus plans one node of each profile, 8 GPUs or a rack of 72, with the batch that
    follows. The table gives such an attribute a column and the plot then compares the points per GPU."""
    return attr != key and len({getattr(p, attr) for p in points if p.fits and not p.not_run}) > 1


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """'gpus=64,128,...,1024' -> ('gpus', ['64', ..., '1024']). A '...' continues the
    pattern of the two values before it (a ratio when the second is a multiple of the
    first, else a step) up to the value after it."""
    if "=" not in text:
        raise UserError(f"expected KEY=V1,V2,... with KEY one of {one_of(SWEEPS)}, got {text!r}", field="--sweep")
    key, _, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if key not in SWEEPS:
        raise UserError(f"unknown sweep {key!r}; allowed: {one_of(SWEEPS)}", field="--sweep")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if "..." in items:
        items = _expand(items)
    if not items:
        raise UserError("no values to sweep", field="--sweep")
    if key == "precision":
        from .precision import PRECISION_CHOICES
        for v in items:
            if v not in PRECISION_CHOICES:
                raise UserError(f"precision value {v!r} is not allowed; allowed: {one_of(PRECISION_CHOICES)}",
                                field="--sweep")
    if key == "gpu":
        from pathlib import Path
        from .cluster import builtin_profiles
        known = builtin_profiles()
        for v in items:
            if v not in known and not Path(v).is_file():
                raise UserError(f"gpu value {v!r} is neither a built-in cluster nor a profile TOML; known: "
                                f"{one_of(sorted(known))}", field="--sweep")
    if key not in _NAMED:
        for v in items:
            if not v.isdigit() or int(v) <= 0:
                raise UserError(f"{key} values must be positive integers, got {v!r}", field="--sweep")
    return key, items


def _expand(items: list[str]) -> list[str]:
    i = items.index("...")
    if i < 2 or i != len(items) - 2 or not all(v.isdigit() for v in items[:i] + items[i + 1:]):
        raise UserError("'...' needs two integers before it and the last value after it, e.g. gpus=64,128,...,1024",
                        field="--sweep")
    a, b, end = int(items[i - 2]), int(items[i - 1]), int(items[i + 1])
    out = [int(v) for v in items[:i]]
    ratio = b // a if b > a and b % a == 0 else None
    step = b - a
    if step <= 0:
        raise UserError(f"'...' needs increasing values, got {a}, {b}", field="--sweep")
    while True:
        nxt = out[-1] * ratio if ratio else out[-1] + step
        if nxt > end:
            break
        out.append(nxt)
    if out[-1] != end:
        raise UserError(f"the pattern {a}, {b}, ... does not reach {end}", field="--sweep")
    return [str(v) for v in out]


def point_inputs(inputs, key: str, value: str):
    """The JobInputs of one value of the sweep (the bandwidth is applied to the loaded cluster)."""
    if key in ("gpus", "global_batch", "seq_len"):
        return replace(inputs, **{key: int(value)})
    if key == "gpu":
        return replace(inputs, cluster=value)
    if key == "precision":
        return replace(inputs, precision=value)
    return inputs


def evaluate_point(inputs, key: str, value: str, knobs, top_k: int = 2) -> Point:
    """The best plan at one value of the sweep: the same search as `meshplan plan`, finalists ranked by
    the simulation; one row. A sweep shows the model's optimum at each value (``prefer="fastest"``): the
    near-tie rule of `meshplan plan` would let the curve wander within the model's error band, hiding the
    trend the sweep is for; the memory headroom applies as in `meshplan plan`."""
    from .describe import cost_per_million_tokens, describe_config, short_config
    from .energy import energy
    from .search import search

    t0 = time.perf_counter()
    try:
        job = point_inputs(inputs, key, value).load()
    except UserError as e:
        # a GPU without that precision's tensor-core rate, a runtime that does not run the recipe there, or nodes the
        # GPUs do not fill (128 GPUs on NVL72 racks of 72) is an answer about this point, not an error of the sweep's
        if not ((key in _NAMED and e.field == "--precision") or (key == "gpu" and e.field == "--gpus")):
            raise
        return _not_run(inputs, key, value, e.detail, time.perf_counter() - t0)
    cluster, workload = job.cluster, job.workload
    if key == "bandwidth":
        if not cluster.nics_per_node:
            raise UserError(f"{cluster.name} has no inter-node network to sweep", field="--sweep")
        cluster = replace(cluster, nic=replace(cluster.nic, bytes_per_s=int(value) * 1e9 / 8))
    result = search(job.graph, cluster, workload, knobs, top_k=top_k, prefer="fastest")
    base = dict(value=value, gpus=cluster.num_gpus, global_batch=workload.global_batch, seq_len=workload.seq_len,
                capacity_gib=cluster.device.memory_bytes / GiB)
    if result.best is None:
        return Point(fits=False, search_s=time.perf_counter() - t0, **base)
    e = result.best.estimate
    price = (cost_per_million_tokens(cluster.gpu_hour_usd, cluster.num_gpus, e.tokens_per_s)
             if cluster.gpu_hour_usd else None)
    used = energy(e, cluster, workload)
    return Point(fits=True, strategy=describe_config(result.best.config), layout=short_config(result.best.config),
                 step_time_s=e.step_time_s,
                 tokens_per_s=e.tokens_per_s, mfu=e.mfu, memory_gib=e.memory.total / GiB,
                 usd_per_million_tokens=price, kwh_per_million_tokens=used.kwh_per_million_tokens if used else None,
                 search_s=time.perf_counter() - t0, **base)


def _not_run(inputs, key: str, value: str, why: str, seconds: float) -> Point:
    """The row of a point its GPU or runtime cannot run: the job as the other points report it where it loads at
    the GPU's default precision (its GPUs, batch and sequence), else the GPUs, batch and sequence given (None where
    left out: they follow from the GPUs), with the device's capacity."""
    from .cluster import load_cluster
    inputs = point_inputs(inputs, key, value)
    try:
        ref = replace(inputs, precision=None).load()
        gpus, batch, seq, memory = (ref.cluster.num_gpus, ref.workload.global_batch, ref.workload.seq_len,
                                    ref.cluster.device.memory_bytes)
    except UserError:
        gpus, batch, seq = inputs.gpus, inputs.global_batch, inputs.seq_len
        memory = load_cluster(inputs.cluster).device.memory_bytes
    return Point(fits=False, not_run=why, value=value, gpus=gpus, global_batch=batch, seq_len=seq,
                 capacity_gib=memory / GiB, search_s=seconds)


def sweep(inputs, key: str, values: list[str], knobs, *, top_k: int = 2, progress=None) -> list[Point]:
    """``evaluate_point`` at every value, in order (``planner.api.whatif``); ``progress(done, label)`` is told
    before each point and once at the end."""
    if key not in SWEEPS:
        raise UserError(f"unknown sweep {key!r}; allowed: {one_of(SWEEPS)}", field="--sweep")
    if key == "gpus" and inputs.gpus:
        raise UserError("--gpus is what the sweep varies; leave it out", field="--gpus")
    points = []
    for i, value in enumerate(values):
        if progress:
            progress(i, f"{key}={value}")
        points.append(evaluate_point(inputs, key, value, knobs, top_k))
    if progress:
        progress(len(values), "done")
    return points


def write_outputs(points: list[Point], key: str, folder: Path, title: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [asdict(p) for p in points]
    csv_path = folder / "whatif.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[key] + [k for k in rows[0] if k != "value"])
        writer.writeheader()
        for r in rows:
            writer.writerow({key: r.pop("value"), **r})
    json_path = folder / "whatif.json"
    json_path.write_text(json.dumps({"sweep": key, "points": [asdict(p) for p in points]}, indent=2) + "\n")
    from .report.whatif_plots import save_sweep_plots
    return [csv_path, json_path] + save_sweep_plots(points, key, SWEEPS[key], folder, title,
                                                    per_gpu=differs(points, "gpus", key))
