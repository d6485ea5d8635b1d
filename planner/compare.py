"""Your plan beside the best one: the comparison `meshplan compare` prints.

The baseline (planner/baseline/) is estimated the way `meshplan plan` estimates a fully
fixed plan (planner.api.estimate: knobs checked, step simulated); the recommended plan
is the search's best for the same workload, or the baseline itself when nothing the
search finds is faster. Plain values in, plain values out: the text and JSON views are
in planner/cli/compare.py, the report section in report/comparison.py.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, fields

from . import exports
from .baseline import Baseline
from .cluster import GiB, Cluster
from .describe import describe_config, describe_recompute, runs
from .energy import energy, energy_words
from .config import ParallelConfig, Workload
from .placement import balanced_stage_layers, layer_policies
from .estimate import Candidate, StepTime
from .explain import PARTS
from .layers import LayerGraph
from .model import ModelSpec
from .plan import Plan
from .search.result import OPTIMALITY_GAP, SearchResult

SECONDS_PER_DAY = 86_400
CHINCHILLA_TOKENS_PER_PARAM = 20     # compute-optimal tokens per parameter (Hoffmann et al. 2022, Table 3)
RESHARD_TOOLS = {   # how each runtime moves a checkpoint to another layout
    "megatron": "Megatron-LM's torch_dist checkpoints (megatron.core.dist_checkpointing) reshard when loaded; the "
                "legacy format needs tools/checkpoint/convert.py",
    "deepspeed": "DeepSpeed's universal checkpoint (deepspeed/checkpoint/ds_to_universal.py) loads into another "
                 "tensor/pipeline/data-parallel layout",
    "torchtitan": "torch.distributed.checkpoint (DCP) reshards when loaded",
    "plan.json": "meshplan run --save/--load (torch.distributed.checkpoint) reshards when loaded",
}
RESHARD_TOOLS["torchtitan-python"] = RESHARD_TOOLS["torchtitan"]     # the same runtime, its current file form


@dataclass(frozen=True, kw_only=True)
class Change:
    knob: str          # a knob as plan.json's config names it, or "layers per stage"
    baseline: object
    recommended: object


@dataclass(frozen=True, kw_only=True)
class Comparison:
    baseline: Baseline                 # what was read
    spec: ModelSpec
    model_source: str                  # what --model was (or the model the file describes)
    graph: LayerGraph
    cluster: Cluster
    workload: Workload
    mine: Candidate                    # the baseline, estimated
    best: Candidate | None             # the search's best (None: nothing the search tried fits)
    search: SearchResult | None        # the search that found it (its runners-up go into a report)
    token_budget: float                # tokens the gain in days and cost is priced for

    @property
    def already_best(self) -> bool:
        """The baseline fits and the search finds nothing faster (beyond the search's own gap)."""
        return self.mine.estimate.fits and (
            self.best is None or self.mine.estimate.step_time_s <= self.best.estimate.step_time_s * (1 + OPTIMALITY_GAP))

    @property
    def recommended(self) -> Candidate:
        return self.mine if self.already_best else self.best

    @property
    def speedup(self) -> float:
        """How many times faster a step of the recommended plan is."""
        return self.mine.estimate.step_time_s / self.recommended.estimate.step_time_s

    @property
    def verdict(self) -> str:
        if not self.mine.estimate.fits:
            return "does_not_fit"
        return "already_best" if self.already_best else "faster"


def effective_knobs(graph: LayerGraph, c: ParallelConfig) -> dict[str, object]:
    """What a config runs, the defaults spelled out: the schedule only with a pipeline, the
    stage split and the recompute policy of every block."""
    blocks = [p for p, layer in zip(layer_policies(graph, c), graph.layers) if layer.is_block]
    return {"dp": c.dp, "tp": c.tp, "pp": c.pp, "cp": c.cp, "zero": c.zero, "micro_batch": c.micro_batch,
            "num_microbatches": c.num_microbatches, "schedule": c.schedule if c.pp > 1 else "no pipeline",
            "vpp": c.vpp, "sequence_parallel": c.sequence_parallel, "optimizer_offload": c.optimizer_offload,
            "param_offload": c.param_offload, "nvme_offload": c.nvme_offload,
            "stage_layers": list(c.stage_layers or balanced_stage_layers(graph, c.pp * c.vpp)) if c.pp > 1 else None,
            "recompute": blocks}


def changes(graph: LayerGraph, mine: ParallelConfig, other: ParallelConfig) -> list[Change]:
    """Every knob whose effective value differs, in the order of plan.json's config; the stage split
    only when the number of stages stays (otherwise it cannot but change)."""
    a, b = effective_knobs(graph, mine), effective_knobs(graph, other)
    out = []
    for knob in a:
        if a[knob] == b[knob]:
            continue
        if knob == "recompute":
            out.append(Change(knob=knob, baseline=describe_recompute(mine), recommended=describe_recompute(other)))
        elif knob == "stage_layers":
            if mine.pp * mine.vpp == other.pp * other.vpp:
                out.append(Change(knob="layers per stage", baseline=runs(a[knob]), recommended=runs(b[knob])))
        else:
            out.append(Change(knob=knob, baseline=a[knob], recommended=b[knob]))
    return out


def gain(cmp: Comparison) -> dict:
    """Step time saved, and the days, dollars and energy of the token budget on each plan (dollars
    when the cluster profile has a [pricing] table, energy when it has a [power] table: planner/energy.py)."""
    mine, rec = cmp.mine.estimate, cmp.recommended.estimate
    days = {name: cmp.token_budget / e.tokens_per_s / SECONDS_PER_DAY for name, e in (("baseline", mine),
                                                                                        ("recommended", rec))}
    out = {"step_time_saved_s": mine.step_time_s - rec.step_time_s, "token_budget": cmp.token_budget,
           "days": days, "days_saved": days["baseline"] - days["recommended"], "usd": None, "usd_saved": None}
    price = cmp.cluster.gpu_hour_usd
    if price:
        usd = {k: d * 24 * cmp.cluster.num_gpus * price for k, d in days.items()}
        out.update(usd=usd, usd_saved=usd["baseline"] - usd["recommended"], gpu_hour_usd=price,
                   price_source=cmp.cluster.price_source)
    found = {name: energy(e, cmp.cluster, cmp.workload) for name, e in (("baseline", mine), ("recommended", rec))}
    out["kwh"], out["kwh_saved"] = None, None
    if all(found.values()):
        kwh = {name: e.run_kwh(cmp.token_budget) for name, e in found.items()}
        out.update(kwh=kwh, kwh_saved=kwh["baseline"] - kwh["recommended"], energy_source=found["baseline"].source)
    return out


def checkpoint_bytes_per_param(framework: str, precision: str) -> float:
    """Bytes per parameter of a full training checkpoint: Adam's two fp32 moments (8), the
    fp32 weights or master weights (4), and the 16-bit working weights Megatron-LM and
    DeepSpeed also save (2) (Rajbhandari et al. 2020, Sec 3.1: 2 + K, K = 12)."""
    return 14.0 if precision != "fp32" and framework in ("megatron", "deepspeed") else 12.0


def switch_costs(cmp: Comparison) -> list[str]:
    """What moving from the baseline to the recommended plan costs, beyond a restart."""
    if cmp.already_best:
        return []
    a, b = cmp.mine.config, cmp.recommended.config
    ka, kb = effective_knobs(cmp.graph, a), effective_knobs(cmp.graph, b)
    size = cmp.graph.num_params * checkpoint_bytes_per_param(cmp.workload.framework, cmp.workload.precision)
    out = []
    moved = [f"{k} {ka[k]} -> {kb[k]}" for k in ("tp", "pp", "vpp") if ka[k] != kb[k]]
    if ka["stage_layers"] != kb["stage_layers"] and a.pp * a.vpp == b.pp * b.vpp:
        moved.append("another stage split")
    if moved:
        out.append(f"checkpoint reshard: the weights and optimizer states move to a new model-parallel layout "
                   f"({', '.join(moved)}): {_bytes(size)} to read and rewrite "
                   f"({checkpoint_bytes_per_param(cmp.workload.framework, cmp.workload.precision):.0f} bytes per "
                   f"parameter); {RESHARD_TOOLS[cmp.baseline.format]}")
    elif _state_sharding(a) != _state_sharding(b):
        out.append(f"optimizer-state reshard: ZeRO-{a.zero} over {_state_sharding(a)[1]} ranks -> ZeRO-{b.zero} over "
                   f"{_state_sharding(b)[1]}; the same {_bytes(size)} checkpoint, partitioned anew when loaded; "
                   f"{RESHARD_TOOLS[cmp.baseline.format]}")
    else:
        out.append("no checkpoint change: the weights and optimizer states keep their layout; only the launch "
                   "settings change")
    out.append(f"the same global batch ({cmp.workload.global_batch} sequences of {cmp.workload.seq_len} tokens): the "
               "optimizer takes the same steps; only the order of floating-point reductions differs")
    return out


def _bytes(n: float) -> str:
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / 1e9:.1f} GB"


def _state_sharding(c: ParallelConfig) -> tuple[int, int]:
    """(ZeRO stage, ranks the optimizer states are split over)."""
    return (c.zero, c.dp * c.cp if c.zero else 1)


def does_not_fit_by(e) -> str:
    """How much more memory a plan that does not fit needs, on its fullest stage, against the usable memory
    (the device's less the headroom) and, where it is within the device, saying so."""
    if e.memory.total > e.capacity_bytes:
        over = e.memory.total - e.capacity_bytes
        return (f"stage {e.peak_stage} needs {e.memory.total / GiB:.1f} GiB per GPU, {over / GiB:.1f} GiB "
                f"({100 * over / e.capacity_bytes:.0f}%) more than the {e.capacity_bytes / GiB:.1f} GiB it has")
    over = e.memory.total - e.usable_bytes
    return (f"stage {e.peak_stage} needs {e.memory.total / GiB:.1f} GiB per GPU, within the device's "
            f"{e.capacity_bytes / GiB:.1f} GiB but {over / GiB:.1f} GiB more than the {e.usable_bytes / GiB:.1f} "
            "usable with the memory headroom (--memory-headroom)")


# -- views shared by the table (planner/cli/compare.py) and the report (report/comparison.py) -------

def counterpart(cmp: Comparison) -> tuple[str, Candidate | None]:
    """The plan the baseline is set beside, and its name: the recommended one, or the
    search's best when the baseline is already the best."""
    return ("the search's best", cmp.best) if cmp.already_best else ("recommended", cmp.recommended)


def comparison_rows(a: Candidate, b: Candidate) -> list[tuple[str, str, str, str]]:
    """(what, plan a, plan b, difference) for the knobs, the step and its parts, throughput,
    MFU and memory: the side-by-side view the table and the report share."""
    ca, cb, ea, eb = a.config, b.config, a.estimate, b.estimate

    def knob(name: str, x, y) -> tuple[str, str, str, str]:
        return (name, str(x), str(y), "changes" if x != y else "")

    def seconds(name: str, x: float, y: float) -> tuple[str, str, str, str]:
        """A relative change where the baseline's part is at least a millisecond, else absolute."""
        change = "" if abs(y - x) < 5e-4 else f"{100 * (y / x - 1):+.1f}%" if x >= 1e-3 else f"{y - x:+.3f} s"
        return (name, f"{x:.3f}", f"{y:.3f}", change)

    def schedule(c) -> str:
        return "no pipeline" if c.pp == 1 else c.schedule + (f" (vpp {c.vpp})" if c.vpp > 1 else "")

    out = [knob("layout (dp x tp x pp x cp)", f"{ca.dp} x {ca.tp} x {ca.pp} x {ca.cp}",
                f"{cb.dp} x {cb.tp} x {cb.pp} x {cb.cp}"),
           knob("ZeRO stage", ca.zero, cb.zero),
           knob("micro-batch x micro-batches", f"{ca.micro_batch} x {ca.num_microbatches}",
                f"{cb.micro_batch} x {cb.num_microbatches}"),
           knob("schedule", schedule(ca), schedule(cb)),
           knob("recompute", describe_recompute(ca), describe_recompute(cb)),
           knob("sequence parallel", "on" if ca.sequence_parallel else "off", "on" if cb.sequence_parallel else "off"),
           knob("optimizer offload", "on" if ca.optimizer_offload else "off",
                "on" if cb.optimizer_offload else "off"),
           *([knob("parameter offload", "on" if ca.param_offload else "off", "on" if cb.param_offload else "off")]
             if ca.param_offload or cb.param_offload else []),
           *([knob("offload to NVMe", "on" if ca.nvme_offload else "off", "on" if cb.nvme_offload else "off")]
             if ca.nvme_offload or cb.nvme_offload else []),
           seconds("step time (s)", ea.step_time_s, eb.step_time_s)]
    out += [seconds(f"  {PARTS[f.name]}", getattr(ea.time, f.name), getattr(eb.time, f.name)) for f in fields(StepTime)]
    faster = eb.tokens_per_s / ea.tokens_per_s - 1
    out += [("tokens/s", f"{ea.tokens_per_s:,.0f}", f"{eb.tokens_per_s:,.0f}",
             f"{100 * faster:+.1f}%" if abs(faster) >= 5e-4 else ""),
            ("MFU", f"{100 * ea.mfu:.1f}%", f"{100 * eb.mfu:.1f}%", ""),
            ("memory per GPU (GiB)", _memory(ea), _memory(eb), "" if ea.fits else "your plan does not fit")]
    return out


def word(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _memory(e) -> str:
    return f"{e.memory.total / GiB:.1f} of {e.capacity_bytes / GiB:.1f} (stage {e.peak_stage})"


def verdict_line(cmp: Comparison) -> str:
    head = "" if cmp.mine.estimate.fits else f"your plan does not fit: {does_not_fit_by(cmp.mine.estimate)}; "
    if cmp.already_best:
        found = ("" if cmp.best is None else "; the search finds the same plan" if cmp.best.config == cmp.mine.config
                 else f"; the search's best ({describe_config(cmp.best.config)}) takes "
                      f"{cmp.best.estimate.step_time_s:.3f} s")
        return head + f"your plan is already the best meshplan finds{found}"
    saved = cmp.mine.estimate.step_time_s - cmp.best.estimate.step_time_s
    if saved < 0:           # a plan that does not fit can be faster than any that does: say what fitting costs
        return head + (f"the recommended plan fits, at {-saved:.3f} s more per step than yours would take if it "
                       f"fitted ({1 / cmp.speedup:.2f}x its step time)")
    return head + f"the recommended plan is {cmp.speedup:.2f}x as fast: {saved:.3f} s less per step"


def gain_line(cmp: Comparison) -> str:
    g = gain(cmp)
    days = (f"{g['days_saved']:.1f} days saved" if g["days_saved"] >= 0 else
            f"{-g['days_saved']:.1f} days more: your plan does not fit" if not cmp.mine.estimate.fits else
            f"{-g['days_saved']:.1f} days more")
    text = (f"{g['token_budget']:.3g} tokens take {g['days']['baseline']:.1f} days on your plan, "
            f"{g['days']['recommended']:.1f} on the recommended one ({days})")
    if g["usd"]:
        usd = (f"${g['usd_saved']:,.0f} saved" if g["usd_saved"] >= 0 else f"${-g['usd_saved']:,.0f} more")
        text += (f"; at ${g['gpu_hour_usd']:.3f} per GPU-hour: ${g['usd']['baseline']:,.0f} against "
                 f"${g['usd']['recommended']:,.0f} ({usd})")
    if g["kwh"]:
        saved = (f"{energy_words(g['kwh_saved'])} saved" if g["kwh_saved"] >= 0 else
                 f"{energy_words(-g['kwh_saved'])} more")
        text += (f"; energy {energy_words(g['kwh']['baseline'])} against {energy_words(g['kwh']['recommended'])} "
                 f"({saved})")
    return text


EXPORTERS = {"megatron": exports.megatron, "deepspeed": exports.deepspeed, "torchtitan": exports.torchtitan,
             "torchtitan-python": exports.torchtitan_python}


def plan_of(cmp: Comparison, recommended: bool = True) -> Plan:
    """The Plan of the recommended candidate (with the search's runners-up) or of the baseline."""
    from .search import default_solver
    from .search.finish import finish
    if recommended and not cmp.already_best:
        result = cmp.search
    else:
        result = SearchResult(best=cmp.mine, alternatives=(), candidates=1, evaluated=1, seconds=0.0)
    return finish(result, model_name=cmp.spec.name, model_source=cmp.model_source, spec=cmp.spec, graph=cmp.graph,
                  cluster=cmp.cluster, workload=cmp.workload, solver=default_solver())


def file_edits(cmp: Comparison) -> dict:
    """The recommended plan in the baseline's own format: the settings to remove and to add
    (as meshplan's export writes them), and what that format cannot express of it."""
    if cmp.already_best:
        return {"remove": [], "add": [], "launch": [], "cannot_express": []}
    if cmp.baseline.format == "plan.json":
        before, after = (_flat({"config": c.config.to_json()}) for c in (cmp.mine, cmp.recommended))
        notes = ()
    else:
        export = EXPORTERS[cmp.baseline.format]
        old, new = export(plan_of(cmp, recommended=False)), export(plan_of(cmp))
        before, after = _settings(cmp.baseline.format, old.text), _settings(cmp.baseline.format, new.text)
        notes = [n for n in new.notes if n not in old.notes]
    a, b = cmp.mine.config, cmp.recommended.config
    # Megatron-DeepSpeed's degrees are launch flags, not JSON keys
    launch = [f"{flag} {getattr(a, k)} -> {getattr(b, k)}" for k, flag in (("tp", "--tensor-model-parallel-size"),
                                                                         ("pp", "--pipeline-model-parallel-size"))
              if cmp.baseline.format == "deepspeed" and getattr(a, k) != getattr(b, k)]
    return {"remove": [x for x in before if x not in after], "add": [x for x in after if x not in before],
            "launch": launch, "cannot_express": list(notes)}


def _settings(fmt: str, text: str) -> list[str]:
    """One line per setting: Megatron's flag lines, a JSON's dotted keys, a TOML's section.key."""
    if fmt == "deepspeed":
        return _flat(json.loads(text))
    if fmt == "torchtitan":
        doc = tomllib.loads(text)
        doc.pop("job", None)
        return _flat(doc)
    if fmt == "torchtitan-python":
        from .baseline.torchtitan_py import settings
        return settings(text)
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _flat(doc: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in doc.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key} = {json.dumps(value)}")
    return out
