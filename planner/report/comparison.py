"""The report section "Your plan against the recommended one": the side-by-side table of
`meshplan compare`, both plans' step parts, both pipeline timelines and both memory bars
(the figures of figures.py, drawn for the baseline too)."""
from __future__ import annotations

from pathlib import Path

from ..baseline import FORMAT_NAMES
from ..compare import (Comparison, changes, comparison_rows, counterpart, file_edits, gain_line, switch_costs,
                       verdict_line, word)
from ..simulate import simulate
from . import figures
from ..describe import schedule_words, short_config
from .document import Figure, Section, Table


def write_figures(cmp: Comparison, plots: Path, name: str) -> list[Path]:
    """plots/comparison (both plans' step parts), and the baseline's own timeline and memory
    bars (the recommended plan's are the report's pipeline_timeline and memory_per_stage)."""
    mine, (label, other) = cmp.mine, counterpart(cmp)
    written = []
    if other is not None:
        fig = figures.candidates([f"{label}: {short_config(other.config)}", f"your plan: {short_config(mine.config)}"],
                                 [other.estimate, mine.estimate], f"Your plan against the {label} plan: {name}")
        written += figures.save(fig, plots, "comparison")
    if not cmp.already_best:
        timeline = simulate(cmp.graph, cmp.cluster, cmp.workload, mine.config)
        written += figures.save(figures.pipeline_timeline(
            timeline, f"One step of your plan ({schedule_words(mine.config)}): {name}"), plots,
            "baseline_pipeline_timeline")
        written += figures.save(figures.memory_per_stage(
            mine.estimate, f"Memory per GPU by pipeline stage, your plan: {name}"), plots, "baseline_memory_per_stage")
    return written


def section(cmp: Comparison) -> Section:
    b = cmp.baseline
    intro = (f"Your configuration, {b.source} ({FORMAT_NAMES[b.format]}), estimated as `meshplan plan` estimates a "
             f"fully fixed plan, against the best plan the search finds for the same job "
             f"({cmp.workload.framework} runtime, {cmp.workload.precision_name}, {cmp.workload.global_batch} sequences of "
             f"{cmp.workload.seq_len} tokens). Verdict: {verdict_line(cmp)}.")
    bullets = [f"Changes: {c.knob} {word(c.baseline)} -> {word(c.recommended)}"
               for c in changes(cmp.graph, cmp.mine.config, cmp.recommended.config)]
    if not cmp.already_best:
        bullets += [f"Gain: {gain_line(cmp)}."] + [f"Switch: {s}." for s in switch_costs(cmp)]
        edits = file_edits(cmp)
        bullets += [f"In your file: remove `{x}`" for x in edits["remove"]]
        bullets += [f"In your file: add `{x}`" for x in edits["add"]]
        bullets += [f"On the launch line: `{x}`" for x in edits["launch"]]
        bullets += [f"Your format cannot express: {n}" for n in edits["cannot_express"]]
    if b.ignored:
        bullets.append(f"Read but not modelled: {', '.join(b.ignored)}.")
    bullets += [f"Approximation: {n}." for n in b.notes]
    label, other = counterpart(cmp)
    shown = [Figure(name="comparison", caption=f"Step time by part: your plan and the {label} plan")] if other else []
    if not cmp.already_best:
        shown += [Figure(name="baseline_pipeline_timeline", caption="One step of your plan, per pipeline stage"),
                  Figure(name="pipeline_timeline", caption="One step of the recommended plan, per pipeline stage"),
                  Figure(name="baseline_memory_per_stage", caption="Memory per GPU of your plan, by stage"),
                  Figure(name="memory_per_stage", caption="Memory per GPU of the recommended plan, by stage")]
    return Section(title="Your plan against the recommended one", paragraphs=(intro,), bullets=tuple(bullets),
                   table=Table(header=("", "your plan", label, "difference"),
                               rows=tuple(comparison_rows(cmp.mine, other or cmp.mine))), figures=tuple(shown))
