"""How far a plan's numbers can be trusted: the error band of the validation that covers it.

Every estimate meshplan prints is checked against runs somewhere: published Megatron-LM
runs (benchmarks/fidelity.py), meshplan's own executor on one GPU (benchmarks/
gpu_validate.py), on this kind of CPU machine (benchmarks/closed_loop.py). Their errors
are summarised in profiles/validation/accuracy.toml (written by benchmarks/accuracy.py from the
committed results). ``accuracy`` picks the evidence that covers a plan (the device kind
and the runtime; the most specific first) and says what it does not cover.
"""
from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from importlib import resources

from .cluster import Cluster
from .config import Workload
from .runtimes import priced_as


@dataclass(frozen=True)
class Band:
    cases: int
    median_abs: float
    mean_abs: float
    max_abs: float

    def to_json(self) -> dict:
        return {"cases": self.cases, "median_abs": self.median_abs, "mean_abs": self.mean_abs,
                "max_abs": self.max_abs}

    @classmethod
    def from_json(cls, raw: dict | None) -> "Band | None":
        return cls(raw["cases"], raw["median_abs"], raw["mean_abs"], raw["max_abs"]) if raw else None


@dataclass(frozen=True)
class Accuracy:
    """The evidence behind one plan's numbers (``basis`` None: nothing covers it)."""

    basis: str | None               # the evidence's name in profiles/validation/accuracy.toml
    what: str                       # what was run, in words
    command: str                    # what reproduces it
    step_time: Band | None
    memory: Band | None
    caveats: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"basis": self.basis, "what": self.what, "command": self.command,
                "step_time": self.step_time.to_json() if self.step_time else None,
                "memory": self.memory.to_json() if self.memory else None, "caveats": list(self.caveats)}

    @classmethod
    def from_json(cls, raw: dict) -> "Accuracy":
        """What ``to_json`` wrote (a Plan carries it so: planner/plan.py)."""
        if not raw:
            return cls(basis=None, what="no validation recorded in this plan", command="", step_time=None,
                       memory=None)
        return cls(basis=raw.get("basis"), what=raw.get("what", ""), command=raw.get("command", ""),
                   step_time=Band.from_json(raw.get("step_time")), memory=Band.from_json(raw.get("memory")),
                   caveats=tuple(raw.get("caveats", ())))

    def line(self) -> str:
        """One line for the table and the report."""
        if self.basis is None:
            return f"not validated: {self.what}"
        parts = []
        for label, band in (("step time", self.step_time), ("memory", self.memory)):
            if band is None:
                parts.append(f"{label} not checked")
            else:
                parts.append(f"{label} off by {100 * band.median_abs:.1f}% median, {100 * band.mean_abs:.1f}% mean, "
                             f"{100 * band.max_abs:.0f}% worst")
        out = f"against {self.what} ({self.command}): " + ", ".join(parts)
        return out + "".join(f"; {c}" for c in self.caveats)


@functools.lru_cache(maxsize=1)
def _evidence() -> tuple[dict, ...]:
    text = resources.files("profiles").joinpath("validation", "accuracy.toml").read_text()
    return tuple(tomllib.loads(text).get("evidence", ()))


def _moe_caveats(entries, kind: str, workload: Workload) -> list[str]:
    """What the checked runs of mixtures of experts say of a plan that routes experts on this runtime."""
    for entry in entries:
        band = _band(entry, "step_time")
        if entry.get("moe") and entry["device_kind"] == kind and band \
                and priced_as(workload.framework) in entry["frameworks"]:
            return [f"this model routes experts: against {entry['what']} ({entry['command']}) the step time was off "
                    f"by {100 * band.median_abs:.0f}% median, {100 * band.max_abs:.0f}% worst, mostly predicted short: "
                    "the host time of Megatron's dropless dispatcher (a stop per MoE layer) is not priced"]
    return []


def _band(entry: dict, part: str) -> Band | None:
    b = entry.get(part)
    return Band(b["cases"], b["median_abs"], b["mean_abs"], b["max_abs"]) if b else None


def written_by(cluster: Cluster, command: str) -> bool:
    """Whether the cluster's profile was written by ``command`` (its top-level source, as
    executor/profile/toml.py writes it: "measured: `meshplan profile ...` on HOST (DATE)")."""
    return cluster.measured_by.startswith(f"measured: `{command}")


def accuracy(cluster: Cluster, workload: Workload, evidence: tuple[dict, ...] | None = None, *,
             moe: bool = False) -> Accuracy:
    """The band of the most specific evidence for this device kind and runtime, with what it
    leaves out (a single-device validation says nothing of this plan's communication). ``moe``: the plan routes
    experts, and where runs of mixtures of experts were checked for its runtime (evidence marked ``moe``) their
    error is said beside the band: not the band itself, which ranks the plans, as most of it is what every plan
    of such a model shares (the host's time of Megatron's dropless dispatcher, not priced)."""
    entries = _evidence() if evidence is None else evidence
    kind = cluster.device_kind
    for entry in entries:
        if entry.get("moe") or entry["device_kind"] != kind or priced_as(workload.framework) not in entry["frameworks"]:
            continue
        caveats = []
        if entry.get("gpu") and not any(g in cluster.device.name for g in entry["gpu"].split("/")):
            caveats.append(f"that validation ran on an {entry['gpu']}, this plan on {cluster.device.name}")
        if entry.get("profiled_by") and not written_by(cluster, entry["profiled_by"]):
            caveats.append(f"its predictions used a `{entry['profiled_by']}` of the machine they ran on; this plan's "
                           f"profile ({cluster.name}) was not written by `{entry['profiled_by']}`, so its error can be "
                           "larger")
        if entry.get("processes") and cluster.num_gpus != entry["processes"]:
            caveats.append(f"it ran {entry['processes']} processes, this plan {cluster.num_gpus}")
        if entry.get("single_device") and cluster.num_gpus > 1:
            caveats.append("it ran on one GPU: this plan's communication is not covered by it")
        if entry["name"] == "published" and priced_as(workload.framework) != "megatron":
            caveats.append(f"it ran Megatron-LM, not the {workload.framework} runtime")
        if moe:
            caveats += _moe_caveats(entries, kind, workload)
        return Accuracy(basis=entry["name"], what=entry["what"], command=entry["command"],
                        step_time=_band(entry, "step_time"), memory=_band(entry, "memory"), caveats=tuple(caveats))
    if kind == "cpu":
        why = ("no closed-loop results for CPU machines are recorded (python benchmarks/closed_loop.py measures "
               "them)")
    else:
        why = f"no validation covers the {workload.framework} runtime on {kind} devices"
    return Accuracy(basis=None, what=why, command="", step_time=None, memory=None)
