"""The layout of a ``--checkpoint-dir`` (executor/checkpoint.py writes it): which checkpoint in it
is complete. Imports no torch, so `meshplan run` can check the folder before it launches.

    DIR/step-00000008/            complete: DCP shards and .metadata, rng-rank*.pt, plan.json (the plan
                                  that wrote it), COMPLETE.json
    DIR/.partial-step-00000012/   being written, or interrupted while written: never loaded

and, written by an elastic run (``--elastic``, executor/elastic.py):

    DIR/plan-changes.json         every change of plan: when, from which plan to which, the time it cost
    DIR/plans/                    the plans made for the worlds the run met
    DIR/progress.json             the steps done so far, and when (the time lost to a change is measured from it)
    DIR/stopped.json              why the run stopped (no plan fits the world left), for `meshplan run` to say
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from planner.errors import UserError


MARKER = "COMPLETE.json"
PLAN = "plan.json"
CHANGES = "plan-changes.json"
PLANS = "plans"
PROGRESS = "progress.json"
STOPPED = "stopped.json"
COMPLETE = re.compile(r"^step-(\d{8})$")
PARTIAL = re.compile(r"^\.partial-step-\d{8}$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def partial_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".partial-step-{step:08d}"


def read_json(path: str | Path):
    """The JSON document at ``path``; None where it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: str | Path, doc, *, sync: bool = True) -> None:
    """Write ``doc`` under a temporary name, flush (and with ``sync`` fsync) it, then rename it into place: a
    reader sees the old file or the new one, never a part."""
    path = Path(path)
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        json.dump(doc, f)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(part, path)


def _read_marker(folder: Path) -> dict | None:
    meta = read_json(folder / MARKER)
    return meta if isinstance(meta, dict) else None


def latest_complete(root: str | Path) -> tuple[Path, dict] | None:
    """(folder, marker) of the complete checkpoint with the most steps in ``root``; None if none.
    A folder counts only when its name is step-NNNNNNNN and its marker reads back with that step."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = []
    for folder in root.iterdir():
        match = COMPLETE.match(folder.name)
        if match and folder.is_dir():
            meta = _read_marker(folder)
            if meta is not None and meta.get("step") == int(match.group(1)):
                found.append((int(match.group(1)), folder, meta))
    if not found:
        return None
    _, folder, meta = max(found, key=lambda item: item[0])
    return folder, meta


def check_resumable(root: str | Path, meta: dict, *, steps: int, seed: int) -> None:
    """A run of ``steps`` steps with ``seed`` can continue the checkpoint ``meta`` describes."""
    losses = meta.get("losses")
    if not isinstance(losses, list) or len(losses) != meta["step"] or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in losses):
        raise UserError(f"losses: must be the {meta['step']} losses of the steps done, got {losses!r}",
                        source=str(step_dir(root, meta["step"]) / MARKER))
    if meta.get("seed") != seed:
        raise UserError(f"its checkpoint was written with --seed {meta.get('seed')}, this run has --seed {seed}; "
                        "allowed: the same seed, or another --checkpoint-dir", source=str(root), field="--seed")
    if meta["step"] > steps:
        raise UserError(f"holds a checkpoint after step {meta['step']}, beyond --steps {steps}; allowed: --steps "
                        f">= {meta['step']}, or another --checkpoint-dir", source=str(root), field="--steps")
