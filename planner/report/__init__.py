"""Strategy reports: `meshplan plan ... --report DIR` writes plan.json, report.md, a
self-contained report.html, the plots (PNG and SVG) and the exports.

    DIR/plan.json  report.md  report.html  plots/*.png|svg  exports/*  exports/NOTES.md
"""
from __future__ import annotations

from pathlib import Path

from ..cost.step import CostCache
from ..describe import schedule_words, short_config
from ..exports import exports, write_exports
from ..simulate import simulate
from . import document, figures, html, markdown
from .knobs import next_knobs


def write_report(plan, folder: str | Path, comparison=None, node_mtbf_h: float | None = None) -> list[Path]:
    """Write the whole report of ``plan`` into ``folder``; the paths written. With a
    ``comparison`` (planner/compare.py) whose recommended plan is ``plan``, a section sets
    the baseline against it. ``node_mtbf_h``: a node's mean time between failures, for the
    checkpoint interval (None: Llama 3's, planner/resilience.py)."""
    folder = Path(folder)
    plots = folder / "plots"
    folder.mkdir(parents=True, exist_ok=True)
    if plan.graph is None or plan.cluster is None:
        raise ValueError("a report needs the plan the search just made (a plan read from plan.json has no graph)")
    cache = CostCache(plan.graph, plan.cluster, plan.workload)
    config = plan.best.config
    timeline = simulate(plan.graph, plan.cluster, plan.workload, config, cache)
    written = [folder / "plan.json"]
    plan.write(written[0])
    name = f"{plan.model_name} on {plan.cluster.num_gpus} x {plan.cluster.name}"
    est = plan.best.estimate
    finalists = [plan.best, *plan.alternatives]
    labels = ["winner: " + short_config(config)] + [short_config(a.config) for a in plan.alternatives]
    for fig, stem in ((figures.memory_per_stage(est, f"Memory per GPU by pipeline stage: {name}"), "memory_per_stage"),
                      (figures.pipeline_timeline(timeline, f"One step ({schedule_words(config)}): {name}"),
                       "pipeline_timeline"),
                      (figures.step_breakdown(est, f"Where the step's time goes: {name}"), "step_breakdown"),
                      (figures.candidates(labels, [c.estimate for c in finalists], f"Top candidates: {name}"),
                       "candidates")):
        written += figures.save(fig, plots, stem)
    extra = ()
    if comparison is not None:
        from . import comparison as versus
        written += versus.write_figures(comparison, plots, name)
        extra = (versus.section(comparison),)
    ex = exports(plan)
    written += write_exports(plan, folder / "exports", ex)
    from ..resilience import LLAMA3_NODE_MTBF_H, LLAMA3_SOURCE, fewer_nodes
    fewer = [fewer_nodes(plan, lost) for lost in (1, 2) if lost <= plan.cluster.num_nodes]
    failures = document.resilience(plan, fewer,
                                   node_mtbf_h=node_mtbf_h or LLAMA3_NODE_MTBF_H,
                                   mtbf_source="as given, --node-mtbf" if node_mtbf_h else LLAMA3_SOURCE)
    doc = document.build(plan, timeline=timeline, knobs=next_knobs(plan, cache), exports=ex,
                         extra=extra, failures=failures)
    (folder / "report.md").write_text(markdown.render(doc))
    (folder / "report.html").write_text(html.render(doc, plots))
    return written + [folder / "report.md", folder / "report.html"]
