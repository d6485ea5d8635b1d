"""What a strategy report says, as plain values: sections of text, tables, figures and files.
``markdown.py`` and ``html.py`` render the same document, so the two never disagree."""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..accuracy import Accuracy
from ..describe import cost_per_million_tokens, describe_config, gib, runs, short_config
from ..estimate import StepTime
from ..energy import Energy
from ..placement import placement_of
from ..schedules import rank_chunk
from ..explain import PARTS, gain_sentences, headroom_words, ranking_sentence, schedule_sentence
from ..exports import DOCS, Export, recompute_per_stage
from ..recompute import DESCRIPTIONS, EVERY_K_DESCRIPTION, POLICIES, every_k
from ..simulate import Timeline
from .knobs import Knob


@dataclass(frozen=True, kw_only=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, kw_only=True)
class Figure:
    name: str                # file stem under plots/ (PNG and SVG)
    caption: str


@dataclass(frozen=True, kw_only=True)
class Section:
    title: str
    paragraphs: tuple[str, ...] = ()
    bullets: tuple[str, ...] = ()
    table: Table | None = None
    figures: tuple[Figure, ...] = ()
    files: tuple[tuple[str, str], ...] = ()     # (path relative to the report, content) shown verbatim


@dataclass(frozen=True, kw_only=True)
class Document:
    title: str
    sections: tuple[Section, ...]


def _summary(plan) -> Section:
    c, e, w, cl = plan.best.config, plan.best.estimate, plan.workload, plan.cluster
    closed = plan.closed_form_step_time_s
    rows = [("plan", describe_config(c)),
            ("step time (simulated)", f"{e.step_time_s:.3f} s"),
            ("step time (closed form)", f"{closed:.3f} s ({100 * (closed / e.step_time_s - 1):+.1f}%)"),
            ("throughput", f"{e.tokens_per_s:,.0f} tokens/s"),
            ("model FLOP/s per GPU", f"{e.model_tflops_per_gpu:.1f} TFLOP/s (MFU {100 * e.mfu:.1f}%)"),
            ("memory, most loaded GPU", f"{gib(e.memory.total)} of {gib(e.capacity_bytes)} GiB "
                                        f"(stage {e.peak_stage}; {headroom_words(w.memory_headroom, e)})")]
    if plan.energy:
        rows.append(("energy", Energy.from_json(plan.energy).line()))
    if cl.gpu_hour_usd:
        usd = cost_per_million_tokens(cl.gpu_hour_usd, cl.num_gpus, e.tokens_per_s)
        rows.append(("cost per million tokens",
                     f"${usd:.3f} at ${cl.gpu_hour_usd:.3f} per GPU-hour ({cl.price_source})"))
    intro = (f"{plan.model_name} ({plan.model_params / 1e9:.2f}B parameters) on {cl.num_gpus} x {cl.name} "
             f"({cl.device.name}{'; ' + cl.partial_nodes if cl.partial_nodes else ''}): {w.global_batch} sequences of {w.seq_len} tokens per step, {w.precision_name}, "
             f"{w.framework} runtime.")
    return Section(title="Summary", paragraphs=(intro,), table=Table(header=("", ""), rows=tuple(rows)))


def _time(plan, timeline: Timeline) -> Section:
    e = plan.best.estimate
    parts = [(PARTS[f.name], getattr(e.time, f.name)) for f in fields(StepTime)]
    rows = tuple((name, f"{s:.3f}", f"{100 * s / e.step_time_s:.1f}%") for name, s in parts)
    how = (f"every stage runs its {timeline.schedule} schedule over {timeline.num_microbatches} micro-batches"
           if timeline.pp > 1 else f"{timeline.num_microbatches} micro-batches run forward then backward, one "
                                   "after another (no pipeline)")
    text = (f"The step is simulated event by event (planner/simulate.py): {how}; sends and data-parallel "
            f"collectives run on their own streams. The parts are those of stage {timeline.critical_device}, "
            "the one that finishes last; they add up to the step.")
    return Section(title="Where the time goes", paragraphs=(text,),
                   table=Table(header=("part", "seconds", "share"), rows=rows),
                   figures=(Figure(name="step_breakdown", caption="Step time by part (critical stage)"),
                            Figure(name="pipeline_timeline", caption="One step, per pipeline stage")))


def _memory(plan) -> Section:
    e = plan.best.estimate
    rows = tuple((str(i), *(gib(getattr(m, k)) for k in ("params", "grads", "optimizer", "activations", "other")),
                  gib(m.total)) for i, m in enumerate(e.memory_per_stage))
    return Section(title="Where the memory goes",
                   paragraphs=(f"GiB per GPU on each pipeline stage, against {gib(e.capacity_bytes)} GiB.",),
                   table=Table(header=("stage", "params", "grads", "optimizer", "activations", "other", "total"),
                               rows=rows),
                   figures=(Figure(name="memory_per_stage", caption="Memory per GPU by stage and category"),))


def _why(plan, knobs: list[Knob]) -> Section:
    e = plan.best.estimate
    bullets = [f"What limits it: {plan.limits}.",
               f"How far to trust these numbers: checked {Accuracy.from_json(plan.accuracy).line()}."]
    ranking = ranking_sentence(plan.choice, e, plan.alternatives)
    if ranking:
        bullets.append(f"How it was chosen: {ranking}.")
    bullets += [f"Per-stage choice (closed form): {sentence}." for sentence in gain_sentences(plan.gains)]
    schedules = schedule_sentence(plan.gains)
    if schedules:
        bullets.append(f"Schedule (closed form): {schedules}.")
    fitting = [k for k in knobs if k.fits and k.gain_pct > 0.05]
    if fitting:
        bullets.append(f"Next knob to turn: {fitting[0].describe(e.capacity_bytes)}.")
    else:
        bullets.append("Next knob to turn: no one-step change that fits is faster; the search's optimum is local too.")
    rows = tuple((short_config(a.config), f"{a.estimate.step_time_s:.3f}", a.lost_on)
                 for a in plan.alternatives)
    knob_lines = tuple(k.describe(e.capacity_bytes) for k in knobs[:6])
    return Section(title="Why this plan", bullets=tuple(bullets) + tuple(f"What if: {k}" for k in knob_lines),
                   table=Table(header=("runner-up", "step s", "what it lost on"), rows=rows) if rows else None,
                   figures=(Figure(name="candidates", caption="The winner and the runners-up"),))


def _stages(plan) -> Section:
    c = plan.best.config
    stages = plan.stages
    rows = []
    for j, (modules, rec) in enumerate(zip(stages, recompute_per_stage(plan))):
        span = f"{modules[0]} ... {modules[-1]}" if len(modules) > 2 else ", ".join(modules)
        rows.append((str(j), str(rank_chunk(placement_of(c), j, c.pp)[0]), str(len(modules)), span,
                     ", ".join(f"{p} {n}" for p, n in rec.items() if n and p != "none") or "none"))
    text = f"{len(stages)} virtual stage(s) on {c.pp} rank(s); layers per stage {runs([len(s) for s in stages])}."
    used = {p for rec in recompute_per_stage(plan) for p, n in rec.items() if n and p != "none"}
    if used:    # what each recompute policy in the table does, in one line (planner/recompute.py)
        text += " Recompute: " + "; ".join(f"{p}: {DESCRIPTIONS[p]}" for p in POLICIES if p in used) + "."
    if every_k(c.recompute):
        text += f" The blocks follow the pattern {c.recompute}: {EVERY_K_DESCRIPTION}."
    return Section(title="Stages and recompute", paragraphs=(text,),
                   table=Table(header=("stage", "rank", "layers", "modules", "recompute"), rows=tuple(rows)))


def resilience(plan, fewer: list, *, node_mtbf_h: float, mtbf_source: str) -> Section:
    """When nodes fail: the step with ``fewer`` nodes (planner/resilience.py ``FewerNodes``, as an elastic run
    re-plans), and the checkpoint interval that loses least work at a node's mean time between failures."""
    from ..resilience import CHECKPOINT_WRITE_S, daly_interval_s, job_mtbf_s, lost_share, young_interval_s
    e, nodes = plan.best.estimate, plan.cluster.num_nodes
    rows = [(str(nodes), str(plan.world_size), short_config(plan.best.config), f"{e.step_time_s:.3f}", "")]
    for f in fewer:
        if f.plan is None:
            rows.append((str(nodes - f.lost), str(max(f.gpus, 0)), f.why_not, "-", "-"))
            continue
        step = f.plan.best.estimate.step_time_s
        rows.append((str(nodes - f.lost), str(f.gpus), short_config(f.plan.best.config), f"{step:.3f}",
                     f"{100 * (step / e.step_time_s - 1):+.1f}%"))
    fewer_text = (f"With `meshplan run --elastic` a job that loses nodes is planned again for the GPUs left (the same "
                  "job and fixed knobs, the search's answer: planner/replan.py) and resumes from its last checkpoint. "
                  f"The step with one and two of its {nodes} node(s) of {plan.gpus_per_node} GPUs fewer:")
    mtbf_s = job_mtbf_s(node_mtbf_h, nodes)
    intervals = []
    for write_s in CHECKPOINT_WRITE_S:
        tau = daly_interval_s(write_s, mtbf_s)
        intervals.append((f"{write_s:g} s", f"{tau / 60:,.1f} min", f"{max(1, round(tau / e.step_time_s)):,}",
                          f"{young_interval_s(write_s, mtbf_s) / 60:,.1f} min",
                          f"{100 * lost_share(tau, write_s, mtbf_s):.1f}%"))
    interval_text = (f"A node fails every {node_mtbf_h:,.0f} hours on average ({mtbf_source}), so this job's {nodes} "
                     f"node(s) see a failure every {mtbf_s / 3600:,.1f} hours. The checkpoint interval that loses "
                     "least work for a checkpoint that takes the first column's time to write: Daly 2006 (\"A higher "
                     "order estimate of the optimum checkpoint interval for restart dumps\", FGCS 22(3)), Young 1974 "
                     "(\"A first order approximation to the optimum checkpoint interval\", CACM 17(9)) to first "
                     "order; the steps are `meshplan run --checkpoint-every`'s, and the time lost is to first order "
                     "the writes plus half an interval redone per failure (planner/resilience.py).")
    return Section(title="When nodes fail", paragraphs=(fewer_text,),
                   table=Table(header=("nodes", "GPUs", "plan", "step s", "against now"), rows=tuple(rows)),
                   bullets=(interval_text,) + tuple(
                       f"checkpoint written in {w}: every {t} ({n} steps; Young: {y}), {lost} of the time lost"
                       for w, t, n, y, lost in intervals))


def _exports(exports: tuple[Export, ...]) -> Section:
    bullets = []
    for ex in exports:
        what = "; ".join(ex.notes) if ex.notes else "everything in the plan is expressed"
        bullets.append(f"exports/{ex.filename} ({DOCS[ex.framework]}): {what}")
    return Section(title="Exports", paragraphs=("The plan for other frameworks, using only the keys and flags their "
                                                "documentation names; what one cannot express is said, not dropped.",),
                   bullets=tuple(bullets), files=tuple((f"exports/{ex.filename}", ex.text) for ex in exports))


def build(plan, *, timeline: Timeline, knobs: list[Knob], exports: tuple[Export, ...],
          extra: tuple[Section, ...] = (), failures: Section | None = None) -> Document:
    """The report's sections; ``extra`` ones (a comparison with the user's own plan) follow the summary,
    ``failures`` (``resilience``) the stages."""
    s = plan.search
    search = f"Searched {s.line()}; the finalists were ranked by their simulated step."
    sections = (_summary(plan), *extra, _time(plan, timeline), _memory(plan), _why(plan, knobs),
                _stages(plan), *([failures] if failures else []), _exports(exports),
                Section(title="Search", paragraphs=(search,)))
    return Document(title=f"meshplan report: {plan.model_name} on {plan.cluster.num_gpus} x {plan.cluster.name}",
                    sections=sections)
