"""Elastic runs (`meshplan run --elastic MIN:MAX`): when nodes leave or join, train on in the world that is there.

torchrun's elastic agent restarts every worker when the world changes (torch/distributed/elastic/agent/
server/api.py ``_invoke_run``): a node that dies makes its peers' collectives fail, so the agents left
restart their workers (one of --max-restarts) and meet in a new rendezvous round without it; a node that
joins waits in the rendezvous, and the running agents restart their workers for the larger world (not
counted as a restart). Every restarted worker starts with ``plan_for_world``:

1. the plan it continues is the plan of the latest complete checkpoint in --checkpoint-dir (the plan.json
   saved with it), else the one it was launched with;
2. if that plan splits the training over the live world, it trains it. Otherwise rank 0 takes the
   launched plan if its world is the live one, else plans the job again for the live world
   (planner/replan.py: the same model, cluster profile, global batch, sequence length and fixed knobs,
   those the world cannot hold searched instead; the search's answer), writes it to DIR/plans/, and
   every rank takes it;
3. the checkpoint is loaded into the new plan, resharded by DCP (executor/checkpoint.py), and training
   goes on at the next step. The global batch and the data of each step do not depend on the plan
   (executor/data.py), so the optimizer takes the same steps.

Each change is kept beside the checkpoints in DIR/plan-changes.json (``record``): the step, the plan
before and after (world, config, predicted step time, file), the knobs searched instead, and the time lost:
from the checkpoint resumed to the first step under the new plan (the steps done after that checkpoint
were lost with the old world and run again), of which how long no step ran, the re-plan and the load.
`meshplan run` prints the changes of its run.

When no plan fits the live world (or it cannot be planned), rank 0 writes DIR/stopped.json (why, in one
line, with the fewest GPUs the job fits on) and every rank ends with exit code 0, so the agent does not
restart the job for nothing; `meshplan run` prints the line and exits with its code (3: nothing fits). The
checkpoint stays as it was, and the same command resumes it once there are GPUs enough.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from planner.errors import NoFeasiblePlan, UserError
from planner.plan import Plan

from .checkpoint_dir import (CHANGES, PLAN, PLANS, PROGRESS, STOPPED, latest_complete, read_json, step_dir,
                             write_json)
from .mesh import from_rank0


class Stopped(Exception):
    """No plan fits the live world: the run stopped, and DIR/stopped.json says why."""


@dataclass(frozen=True, kw_only=True)
class Change:
    """A change of plan under way (``plan_for_world``), recorded once the checkpoint is loaded (``record``)."""

    before: dict                    # the plan the checkpoint was written under (``_summary``)
    after: dict                     # the plan for the live world
    searched_instead: tuple[str, ...]   # the fixed knobs the live world cannot hold, each with why
    replan_s: float                 # rank 0's re-plan (0 when it took a plan it had)
    checkpoint_time: float | None   # when the checkpoint resumed from was written (time.time(); None: none)
    progress: dict | None           # the old world's last step: {"step", "time", "world_size"} (progress.json)


def _summary(plan: Plan) -> dict:
    return {"world_size": plan.world_size, "plan": plan.source, "config": plan.config.to_json(),
            "step_time_s": plan.estimate.step_time_s}


def current_plan(launched: Plan, checkpoint_dir: str | Path) -> tuple[Plan, dict | None]:
    """(the plan the latest complete checkpoint was written under, else ``launched``; that checkpoint's marker)."""
    found = latest_complete(checkpoint_dir)
    if found is None:
        return launched, None
    folder, meta = found
    doc = read_json(folder / PLAN)
    if doc is None:                 # written before checkpoints kept their plan: the launched one's
        return launched, meta
    return Plan.from_json(doc, str(meta.get("plan") or folder / PLAN)), meta


def plan_for_world(launched: Plan, *, model: str, checkpoint_dir: str, world: int) -> tuple[Plan, Change | None]:
    """Collective: the plan this worker trains in a world of ``world`` processes (module docstring), and the
    change to record when it is not the plan the checkpoint was written under. Raises Stopped when no plan
    fits (rank 0 wrote DIR/stopped.json)."""
    answer = from_rank0(lambda: _decide(launched, model, Path(checkpoint_dir), world), what="re-plan the job")
    if "stopped" in answer:
        raise Stopped(answer["stopped"])
    plan = Plan.from_json(answer["plan"], answer["source"])
    change = answer.get("change")
    return plan, None if change is None else Change(**change)


def _decide(launched: Plan, model: str, root: Path, world: int) -> dict:
    """Rank 0's part of ``plan_for_world``: {"plan": document, "source": its file, "change": Change's fields}
    or {"stopped": the line}."""
    (root / STOPPED).unlink(missing_ok=True)         # an earlier stop's note: this attempt says anew
    plan, meta = current_plan(launched, root)
    answer = {"plan": plan.to_json(), "source": plan.source, "change": None}
    if plan.world_size == world:
        return answer
    t0, step = time.perf_counter(), meta["step"] if meta else 0
    searched_instead: tuple[str, ...] = ()
    if launched.world_size == world:
        new = launched
    else:
        from planner.replan import replan
        try:
            replanned = replan(launched, world, model=model)
        except UserError as e:
            return {"stopped": _stop(launched, model, root, world, meta, e)}
        new, searched_instead = replanned.plan, replanned.dropped
        path = root / PLANS / f"plan-step-{step:08d}-world-{world}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        new.write(path)
        new = Plan.from_json(new.to_json(), str(path))
    sys.stderr.write(f"meshplan run: the world has {world} processes, the plan at step {step} was made for "
                     f"{plan.world_size}: continuing under {new.source}\n")
    change = Change(before=_summary(plan), after=_summary(new), searched_instead=searched_instead,
                    replan_s=time.perf_counter() - t0, checkpoint_time=meta.get("time") if meta else None,
                    progress=read_json(root / PROGRESS))
    return {"plan": new.to_json(), "source": new.source, "change": asdict(change)}


def _stop(launched: Plan, model: str, root: Path, world: int, meta: dict | None, error: UserError) -> str:
    """Write DIR/stopped.json: why the job cannot go on in ``world`` processes, in one line; returns the line."""
    from planner.replan import fewest_gpus
    kept = (f"the checkpoint after step {meta['step']} is kept in {step_dir(root, meta['step'])}" if meta else
            "no checkpoint was written yet")
    if isinstance(error, NoFeasiblePlan):
        least = fewest_gpus(launched, above=world, model=model)
        fits = (f"it needs at least {least} GPUs of {launched.cluster_name}" if least else
                f"it fits on none of {world + 1} to {launched.world_size} GPUs of {launched.cluster_name}")
        why = f"{_processes(world)} cannot hold {launched.model_name}: {_first_sentence(str(error))}; {fits}"
        resume = "; run the same command again once there are enough" if least else ""
    else:
        why, resume = f"the job cannot be planned again for {_processes(world)}: {error}", ""
    line = f"{why}; {kept}{resume}"
    write_json(root / STOPPED, {"message": line, "exit_code": error.exit_code, "world_size": world,
                                "time": time.time()})
    return line


def _processes(n: int) -> str:
    return f"{n} process" + ("" if n == 1 else "es")


def _first_sentence(text: str) -> str:
    return text.splitlines()[0].split("; ")[0].rstrip(".") if text else text


def record(change: Change, root: str | Path, step: int) -> dict:
    """Rank 0: append the change, now that the checkpoint of ``step`` is loaded, to DIR/plan-changes.json."""
    now = time.time()
    progress = change.progress if change.progress and change.progress.get("step", -1) >= step else None
    entry = {
        "step": step, "time": now, "from": change.before, "to": change.after,
        "searched_instead": list(change.searched_instead),
        # from the checkpoint resumed to the first step under the new plan: the steps after the checkpoint ran again
        "lost_s": now - change.checkpoint_time if change.checkpoint_time is not None else None,
        "steps_redone": progress["step"] - step if progress else 0,
        "idle_s": now - progress["time"] if progress else None,     # no step ran: detection, restart, re-plan, load
        "replan_s": change.replan_s,
    }
    changes = read_json(Path(root) / CHANGES) or []
    write_json(Path(root) / CHANGES, [*changes, entry])
    return entry


def write_progress(root: str | Path, step: int, world: int) -> None:
    """Rank 0, after each step of an elastic run: the steps done, when and in which world (not synced to disk:
    a lost update only makes the time lost to a change look longer)."""
    write_json(Path(root) / PROGRESS, {"step": step, "time": time.time(), "world_size": world}, sync=False)
