"""plan.json as the executor reads it: ``planner.plan.Plan.from_json``, the one reader, checks every
field (errors name the file, the field, the value and what is allowed: ``UserError``, one line, exit
code 2). Only plain values cross: the model spec, the parallel config, the stage boundaries as module
paths, the TP style per module path, the recompute policy per layer, the fingerprints of the model
and world it was made for, and the estimate to compare against. No import of the search.
"""
from __future__ import annotations

import sys
from pathlib import Path

from planner.plan import Plan


def load_plan(path: str | Path) -> Plan:
    return Plan.read(path)


def installed_version() -> str | None:
    """The installed meshplan's version (package metadata), None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("meshplan")
    except PackageNotFoundError:
        return None


def warn_if_other_version(plan: Plan, prog: str = "meshplan run") -> None:
    """One line on stderr when another meshplan wrote the plan (the format is versioned by
    schema_version; the cost model and defaults behind the numbers may differ)."""
    mine = installed_version()
    if plan.meshplan_version and mine and plan.meshplan_version != mine:
        sys.stderr.write(f"{prog}: warning: {plan.source}: meshplan_version: written by meshplan "
                         f"{plan.meshplan_version}, this is meshplan {mine}; its estimate may differ from what "
                         "this version predicts (re-plan to compare)\n")
