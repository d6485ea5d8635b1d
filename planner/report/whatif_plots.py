"""Plots of a what-if sweep: throughput and MFU, memory, cost per million tokens, each
point labelled with the strategy the search chose there."""
from __future__ import annotations

from pathlib import Path

from .figures import pyplot, save


def save_sweep_plots(points, key: str, sweep: tuple[str, str], folder: Path, title: str, *,
                     per_gpu: bool = False) -> list[Path]:
    plt = pyplot()
    what, unit = sweep
    fitting = [p for p in points if p.fits]
    labels = [p.value for p in points]
    x = list(range(len(points)))
    xf = [i for i, p in enumerate(points) if p.fits]
    xlabel = f"{what}" + (f" ({unit})" if unit else "")
    priced = [p for p in fitting if p.usd_per_million_tokens is not None]
    panels = 3 if priced else 2
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.0 * panels), sharex=True)
    # per_gpu: the points differ in GPUs (planner.whatif.differs: a gpu= sweep plans one node of each profile, and
    # an NVL72 node is a rack of 72), so they are compared per GPU, and each tick says how many GPUs its point has
    if per_gpu:
        labels = [f"{p.value}\n{p.gpus} GPUs" if p.gpus else p.value for p in points]
    rate = [p.tokens_per_s / p.gpus if per_gpu else p.tokens_per_s for p in fitting]
    ax = axes[0]
    ax.plot(xf, rate, "o-", color="#4878d0",
            label="throughput per GPU (tokens/s)" if per_gpu else "throughput (tokens/s)")
    ax.set_ylabel("tokens per second per GPU" if per_gpu else "tokens per second")
    ax.set_ylim(0, max(rate or [1]) * 1.3)
    ax.set_xlim(-0.5, len(points) - 0.2)
    for i, p, r in zip(xf, fitting, rate):
        ax.annotate(p.layout, (i, r), textcoords="offset points", xytext=(0, 8), fontsize=7, ha="center")
    twin = ax.twinx()
    twin.plot(xf, [100 * p.mfu for p in fitting], "s--", color="#ee854a", label="MFU (%)")
    twin.set_ylabel("MFU (%)")
    twin.set_ylim(0, 100)
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper left", frameon=False)
    ax.set_title(f"What if the {what} changes: {title}")
    ax = axes[1]
    ax.bar(xf, [p.memory_gib for p in fitting], color="#6acc64", label="memory on the most loaded GPU")
    ax.scatter(x, [p.capacity_gib for p in points], marker="_", s=900, linewidths=2, color="black",
               label="device capacity")
    ax.set_ylabel("memory per GPU (GiB)")
    ax.set_ylim(0, max(p.capacity_gib for p in points) * 1.35)
    ax.legend(loc="upper left", frameon=False, ncols=2)
    if priced:
        ax = axes[2]
        xp = [i for i, p in enumerate(points) if p.fits and p.usd_per_million_tokens is not None]
        ax.plot(xp, [p.usd_per_million_tokens for p in priced], "o-", color="#d65f5f",
                label="cost per million tokens")
        ax.set_ylabel("US$ per million tokens")
        ax.set_ylim(0, max(p.usd_per_million_tokens for p in priced) * 1.25)
        ax.legend(loc="upper left", frameon=False)
    for i, p in enumerate(points):
        if not p.fits:
            axes[0].annotate("not run here" if p.not_run else "no plan fits", (i, 0), textcoords="offset points",
                             xytext=(0, 8), fontsize=7, ha="center", color="#aa0000")
    axes[-1].set_xticks(x)
    axes[-1].set_xticklabels(labels)
    axes[-1].set_xlabel(xlabel)
    fig.tight_layout()
    return save(fig, folder, "whatif")
