"""The report's plots, each a pure function from values to a matplotlib Figure.

matplotlib is imported here only, when a report is written (planning never needs it).
Every plot has labelled axes with units, a legend and a title; ``save`` writes PNG and SVG.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from ..cluster import GiB
from ..estimate import Estimate, StepTime
from ..explain import PARTS
from ..simulate import COMPUTE, DP, SEND_NEXT, SEND_PREV, Timeline

MEMORY_PARTS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer states"),
                ("activations", "activations"), ("other", "buffers and runtime"))
TIME_COLORS = {"compute": "#4878d0", "recompute": "#82c6e2", "tp_comm": "#ee854a", "cp_comm": "#d5bb67", "ep_comm": "#dc7ec0",
               "pp_comm": "#956cb4", "bubble": "#bbbbbb", "dp_comm": "#d65f5f", "optimizer": "#6acc64",
               "host_wait": "#797979"}
EVENT_COLORS = {"forward": "#4878d0", "recompute": "#82c6e2", "backward": "#ee854a", "weight": "#d5bb67",
                "optimizer": "#6acc64",
                "dp_comm": "#d65f5f", "embedding_allreduce": "#8c613c", "send": "#956cb4"}
EVENT_LABELS = {"forward": "forward", "recompute": "recompute", "backward": "backward", "weight": "weight gradient",
                "optimizer": "optimizer step",
                "dp_comm": "data-parallel collective", "embedding_allreduce": "tied-embedding all-reduce",
                "send": "pipeline send"}


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # deterministic SVG ids; text kept as text (searchable, small)
    plt.rcParams.update({"svg.hashsalt": "meshplan", "svg.fonttype": "none", "font.size": 9})
    return plt


def save(fig, folder: Path, name: str) -> list[Path]:
    """``name``.png and ``name``.svg in ``folder``; the figure is closed."""
    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{name}.png", folder / f"{name}.svg"]
    fig.savefig(paths[0], dpi=130, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    return paths


def memory_per_stage(est: Estimate, title: str):
    """Stacked bars of each pipeline stage's memory per GPU by category, against the capacity."""
    plt = pyplot()
    stages = est.memory_per_stage
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(stages) + 3), 3.6))
    x = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for key, label in MEMORY_PARTS:
        values = [getattr(m, key) / GiB for m in stages]
        ax.bar(x, values, bottom=bottom, label=label, width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(est.capacity_bytes / GiB, color="black", linestyle="--", linewidth=1,
               label=f"device capacity ({est.capacity_bytes / GiB:.0f} GiB)")
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("memory per GPU (GiB)")
    ax.set_xticks(x if len(x) <= 32 else x[::max(1, len(x) // 16)])
    ax.set_ylim(0, max(max(bottom), est.capacity_bytes / GiB) * 1.15)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig


def pipeline_timeline(timeline: Timeline, title: str):
    """Gantt chart of one step: per pipeline stage, its compute stream (forward, recompute,
    backward, optimizer) above its communication streams (sends, data-parallel collectives)."""
    plt = pyplot()
    p = timeline.pp
    fig, ax = plt.subplots(figsize=(10, max(2.4, 0.55 * p + 1.4)))
    lanes = {COMPUTE: (0.0, 0.55), SEND_NEXT: (0.58, 0.1), SEND_PREV: (0.58, 0.1), DP: (0.7, 0.16)}
    spans: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
    for e in timeline.events:
        spans.setdefault((e.device, e.stream, e.kind), []).append((e.start_s, e.end_s - e.start_s))
    seen = set()
    many = len(timeline.events) > 2000        # draw the bars as an image inside the SVG: a small file
    for (device, stream, kind), bars in sorted(spans.items()):
        offset, height = lanes[stream]
        label = EVENT_LABELS[kind] if kind not in seen else None
        seen.add(kind)
        ax.broken_barh(bars, (device + offset, height), facecolors=EVENT_COLORS[kind], edgecolor="white",
                       linewidth=0.2 if len(bars) < 400 else 0, label=label, rasterized=many)
    ax.set_ylim(p + 0.05, -0.15)
    ax.set_yticks([d + 0.28 for d in range(p)])
    ax.set_yticklabels([f"stage {d}" for d in range(p)])
    # with many micro-batches the whole step is a solid band: show the warm-up, where the
    # schedule's shape (and its bubble) is visible, and say how much of the step that is
    window = timeline.step_time_s * 1.01
    shown = ""
    if p > 1 and timeline.num_microbatches > 2 * p:
        starts = sorted(e.end_s for e in timeline.events
                        if e.stream == COMPUTE and e.kind == "backward" and e.microbatch == p + 1)
        if starts:
            window = min(window, starts[-1] * 1.05)
            shown = f" (first {window:.3g} s of {timeline.step_time_s:.3g} s: the warm-up)"
    ax.set_xlim(0, window)
    ax.set_xlabel("time within the step (s)" + shown)
    ax.set_ylabel("pipeline stage")
    ax.set_title(f"{title}\nper stage: compute (upper lane), pipeline sends and collectives (lower lanes)",
                 fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: list(EVENT_LABELS.values()).index(labels[i]))
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig


def step_breakdown(est: Estimate, title: str):
    """Where the step's time goes on the critical stage, part by part, in seconds and percent."""
    plt = pyplot()
    parts = [(f.name, getattr(est.time, f.name)) for f in fields(StepTime)]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [PARTS[n] for n, _ in parts]
    values = [v for _, v in parts]
    bars = ax.barh(names, values, color=[TIME_COLORS[n] for n, _ in parts], label=names)
    for bar, value in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {value:.3g} s ({100 * value / est.step_time_s:.1f}%)", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds per step (step {est.step_time_s:.3g} s)")
    ax.set_ylabel("part of the step")
    ax.set_xlim(0, max(values) * 1.45)
    ax.set_title(title)
    ax.legend(bars, names, loc="lower right", fontsize=7, frameon=False)
    return fig


def candidates(labels: list[str], estimates: list[Estimate], title: str):
    """The winner and the runners-up side by side: stacked step-time parts, throughput noted."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(labels) + 1.8))
    left = [0.0] * len(labels)
    for f in fields(StepTime):
        values = [getattr(e.time, f.name) for e in estimates]
        ax.barh(labels, values, left=left, color=TIME_COLORS[f.name], label=PARTS[f.name])
        left = [a + b for a, b in zip(left, values)]
    for i, e in enumerate(estimates):
        ax.text(left[i], i, f" {e.tokens_per_s:,.0f} tokens/s, {e.memory.total / GiB:.0f} GiB", va="center",
                fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_ylabel("candidate (winner first)")
    ax.set_xlim(0, max(left) * 1.45)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig
