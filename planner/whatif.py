"""`meshplan whatif`: how the best plan changes when one thing changes.

    meshplan whatif --model llama3-70b --cluster h100-80g --sweep gpus=64,128,...,1024 --out whatif/

For every value of the swept quantity the best plan is searched again (the same search
as `meshplan plan`, finalists ranked by the simulation) and one row is kept: throughput,
MFU, memory, the chosen strategy, and the cost per million tokens where the cluster
profile has a price per GPU-hour. Writes whatif.csv, whatif.json and the plots.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
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
}


@dataclass(frozen=True, kw_only=True)
class Point:
    """The best plan at one value of the sweep."""

    value: str
    gpus: int
    global_batch: int
    seq_len: int
    fits: bool
    strategy: str = ""              # the chosen layout and knobs
    layout: str = ""                # the same, short: "dp32 tp4 pp8 cp1 ZeRO-1 mb1, 1f1b"
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    memory_gib: float = 0.0
    capacity_gib: float = 0.0
    usd_per_million_tokens: float | None = None
    search_s: float = 0.0


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
    if key != "gpu":
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


def _inputs(args, key: str, value: str):
    """(spec, graph, cluster, workload) for one value of the sweep."""
    from .commands import load_inputs

    point = argparse.Namespace(**vars(args))
    if key in ("gpus", "global_batch", "seq_len"):
        setattr(point, key, int(value))
    elif key == "gpu":
        point.cluster = value
    spec, graph, cluster, workload = load_inputs(point)
    if key == "bandwidth":
        if not cluster.nics_per_node:
            raise UserError(f"{cluster.name} has no inter-node network to sweep", field="--sweep")
        cluster = replace(cluster, nic=replace(cluster.nic, bytes_per_s=int(value) * 1e9 / 8))
    return spec, graph, cluster, workload


def evaluate_point(args, key: str, value: str) -> Point:
    from .commands import _knobs, describe_config
    from .report.document import cost_per_million_tokens, short_config
    from .search import search

    t0 = time.perf_counter()
    _, graph, cluster, workload = _inputs(args, key, value)
    result = search(graph, cluster, workload, _knobs(args), top_k=args.top_k)
    base = dict(value=value, gpus=cluster.num_gpus, global_batch=workload.global_batch, seq_len=workload.seq_len,
                capacity_gib=cluster.device.memory_bytes / GiB)
    if result.best is None:
        return Point(fits=False, search_s=time.perf_counter() - t0, **base)
    e = result.best.estimate
    price = (cost_per_million_tokens(cluster.gpu_hour_usd, cluster.num_gpus, e.tokens_per_s)
             if cluster.gpu_hour_usd else None)
    return Point(fits=True, strategy=describe_config(result.best.config), layout=short_config(result.best.config),
                 step_time_s=e.step_time_s,
                 tokens_per_s=e.tokens_per_s, mfu=e.mfu, memory_gib=e.memory.total / GiB,
                 usd_per_million_tokens=price, search_s=time.perf_counter() - t0, **base)


class Progress:
    """A one-line progress bar on stderr (when it is a terminal, or when asked for)."""

    def __init__(self, total: int, label: str, *, force: bool = False, stream=None):
        self.total, self.label, self.start = total, label, time.perf_counter()
        self.stream = stream or sys.stderr
        self.on = force or self.stream.isatty()

    def update(self, done: int, value: str) -> None:
        if not self.on:
            return
        width = 24
        filled = int(width * done / self.total)
        self.stream.write(f"\rwhatif {self.label}: [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                          f"({value}) {time.perf_counter() - self.start:.0f} s")
        if done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def run_sweep(args, key: str, values: list[str], progress: Progress | None = None) -> list[Point]:
    points = []
    for i, value in enumerate(values):
        if progress:
            progress.update(i, f"{key}={value}")
        points.append(evaluate_point(args, key, value))
    if progress:
        progress.update(len(values), "done")
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
    return [csv_path, json_path] + save_sweep_plots(points, key, SWEEPS[key], folder, title)


def format_points(points: list[Point], key: str) -> str:
    lines = [f"{key:>12} {'tokens/s':>12} {'MFU':>6} {'GiB':>6} {'$/Mtok':>7}  strategy"]
    for p in points:
        if not p.fits:
            lines.append(f"{p.value:>12} {'no plan fits':>12}")
            continue
        price = f"{p.usd_per_million_tokens:.3f}" if p.usd_per_million_tokens is not None else "-"
        lines.append(f"{p.value:>12} {p.tokens_per_s:>12,.0f} {100 * p.mfu:>5.1f}% {p.memory_gib:>6.1f} {price:>7}  "
                     f"{p.strategy}")
    return "\n".join(lines) + "\n"


def whatif_command(args) -> int:
    key, values = parse_sweep(args.sweep)
    if key == "gpus" and args.gpus:
        raise UserError("--gpus is what the sweep varies; leave it out", field="--gpus")
    progress = Progress(len(values), f"{key}", force=args.progress)
    points = run_sweep(args, key, values, progress)
    title = f"{args.model} on {args.cluster}" if key != "gpu" else args.model
    written = write_outputs(points, key, Path(args.out), title)
    sys.stdout.write(format_points(points, key))
    sys.stdout.write(f"wrote {', '.join(str(p) for p in written)}\n")
    sys.stdout.flush()
    return 0


def add_whatif_parser(sub, add_model_args, add_knob_args, positive_int) -> None:
    p = sub.add_parser("whatif", help="sweep GPUs, bandwidth, GPU type, batch or sequence length; re-plan each point",
                       description="For each value of one swept quantity, search the best plan again and record "
                                   "throughput, MFU, memory, the strategy and the cost per million tokens.",
                       epilog="examples:\n  meshplan whatif --model llama3-70b --cluster h100-80g "
                              "--sweep gpus=64,128,256,512,1024 --out whatif/\n"
                              "  meshplan whatif --model llama3-8b --gpus 64 --sweep bandwidth=100,200,400 --out bw/\n"
                              "  meshplan whatif --model llama3-70b --gpus 256 --sweep gpu=a100-80g,h100-80g,h200 "
                              "--out gpus/\n  meshplan whatif --model llama3-8b --gpus 64 "
                              "--sweep seq_len=2048,...,32768 --out seq/",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_knob_args(p)
    p.add_argument("--sweep", required=True, metavar="KEY=V1,V2,...",
                   help=f"what to vary: {', '.join(f'{k} ({v[0]})' for k, v in SWEEPS.items())}; "
                        "'a,b,...,z' continues the pattern of a, b up to z")
    p.add_argument("--out", default="whatif", metavar="DIR",
                   help="folder for whatif.csv, whatif.json and the plots (default ./whatif)")
    p.add_argument("--top-k", type=positive_int, default=2, help="finalists per point for the simulated ranking")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
