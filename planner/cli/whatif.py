"""`meshplan whatif`: re-plan at each value of one swept quantity; a table, whatif.csv, whatif.json, plots."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .. import api
from ..whatif import SWEEPS, Point, differs, parse_sweep, write_outputs
from ..model import load_model
from ..trace.load import is_traced_source
from .common import add_debug, add_job_args, add_knob_args, job_inputs, knobs, positive_int, warn

EPILOG = """\
examples:
  meshplan whatif --model llama3-70b --cluster h100-80g --sweep gpus=64,128,256,512,1024 --out whatif/
  meshplan whatif --model llama3-8b --gpus 64 --sweep bandwidth=100,200,400 --out bw/
  meshplan whatif --model llama3-70b --gpus 256 --sweep gpu=a100-80g,h100-80g,h200 --out gpus/
  meshplan whatif --model llama3-8b --gpus 64 --sweep seq_len=2048,...,32768 --out seq/
"""


def add_parser(sub) -> None:
    p = sub.add_parser("whatif", help="sweep GPUs, bandwidth, GPU type, batch or sequence length; re-plan each point",
                       description="For each value of one swept quantity, search the best plan again and record "
                                   "throughput, MFU, memory, the strategy and the cost per million tokens.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(p)
    add_knob_args(p)
    p.add_argument("--sweep", required=True, metavar="KEY=V1,V2,...",
                   help=f"what to vary: {', '.join(f'{k} ({v[0]})' for k, v in SWEEPS.items())}; "
                        "'a,b,...,z' continues the pattern of a, b up to z")
    p.add_argument("--out", default="whatif", metavar="DIR",
                   help="folder for whatif.csv, whatif.json and the plots (default ./whatif)")
    p.add_argument("--top-k", type=positive_int, default=2, help="finalists per point for the simulated ranking")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    add_debug(p)


def run(args) -> int:
    key, values = parse_sweep(args.sweep)
    inputs = job_inputs(args)
    if not is_traced_source(inputs.model):      # said once for the sweep, not at every point
        api.priced_attention(load_model(inputs.model, seq_len=inputs.seq_len), inputs.framework, inputs.attention,
                             warn)
    progress = Progress(len(values), key, force=args.progress)
    points = api.whatif(inputs, key, values, knobs(args), top_k=args.top_k, progress=progress.update)
    title = f"{args.model} on {args.cluster}" if key != "gpu" else args.model
    written = write_outputs(points, key, Path(args.out), title)
    sys.stdout.write(format_points(points, key))
    sys.stdout.write(f"wrote {', '.join(str(p) for p in written)}\n")
    sys.stdout.flush()
    return 0


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


def format_points(points: list[Point], key: str) -> str:
    """The sweep as a table. Where the points differ in GPUs (a ``gpu=`` sweep without ``--gpus`` plans one node of
    each profile: 8 GPUs, or a rack of 72), in global batch or in sequence length besides the swept key, those get a
    column of their own, and throughput is also given per GPU, so that no row reads as faster for having more GPUs."""
    extra = [(name, attr) for name, attr in (("GPUs", "gpus"), ("batch", "global_batch"), ("seq", "seq_len"))
             if differs(points, attr, key)]
    head = "".join(f" {name:>6}" for name, _ in extra)
    lines = [f"{key:>12}{head} {'tokens/s':>12} {'per GPU':>8} {'MFU':>6} {'GiB':>6} {'$/Mtok':>7} {'kWh/Mtok':>8}"
             "  strategy"]
    for p in points:
        if p.not_run:
            lines.append(f"{p.value:>12} {'not run':>12}  {p.not_run}")
            continue
        if not p.fits:
            lines.append(f"{p.value:>12} {'no plan fits':>12}")
            continue
        price = f"{p.usd_per_million_tokens:.3f}" if p.usd_per_million_tokens is not None else "-"
        kwh = f"{p.kwh_per_million_tokens:.3f}" if p.kwh_per_million_tokens is not None else "-"
        cols = "".join(f" {getattr(p, attr):>6}" for _, attr in extra)
        lines.append(f"{p.value:>12}{cols} {p.tokens_per_s:>12,.0f} {p.tokens_per_s / p.gpus:>8,.0f} "
                     f"{100 * p.mfu:>5.1f}% {p.memory_gib:>6.1f} {price:>7} {kwh:>8}  {p.strategy}")
    return "\n".join(lines) + "\n"
