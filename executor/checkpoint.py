"""Save and resume training with torch.distributed.checkpoint (DCP), across plans.

State is keyed by the whole model's parameter paths (pipeline stages keep them),
the optimizer's state flattened per parameter path
(``StateDictOptions(flatten_optimizer_state_dict=True)``), so a checkpoint
written under one plan (degrees, ZeRO stage, stage split) loads under another:
DCP reshards every tensor to the loading rank's layout. The step index is saved
too: the synthetic data of step s is a function of (seed, s), so a resumed run
sees the batches an uninterrupted one would.

A tied LM head (GPT) is one parameter without a pipeline and two equal copies
with one (first and last stage): both are stored under the embedding's path.

Periodic checkpoints for restarts (``meshplan run --checkpoint-dir DIR``) are
written atomically (``save_atomic``): into ``DIR/.partial-step-NNNNNNNN``, then
each rank's RNG state, then, once every rank has written, the completion marker
``COMPLETE.json`` (step, seed, the losses of every step so far), and last a
rename to ``DIR/step-NNNNNNNN``. Only a ``step-*`` folder whose marker reads back
is ever loaded (``latest_complete``), so a checkpoint interrupted while being
written is never loaded, and the previous complete one is deleted only after
the new one is complete. DIR must be visible to every rank (one machine, or a
shared file system).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from planner.errors import UserError

from .checkpoint_dir import COMPLETE, MARKER, PARTIAL, latest_complete, partial_dir, step_dir, write_json
from .zero1 import ShardedAdamW

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _key(key: str, tied: bool) -> str:
    """The checkpoint key of a state-dict key (model FQN or flattened optimizer key)."""
    return key.replace("lm_head.weight", "embed.tokens.weight") if tied else key


def _optimizer_state(model: nn.Module, optimizer) -> dict:
    """The flattened optimizer state: torch's for its optimizers, ZeRO-1's own (the same keys)."""
    if isinstance(optimizer, ShardedAdamW):
        return optimizer.flat_state_dict()
    return get_optimizer_state_dict(model, optimizer, options=OPTIONS)


def _set_optimizer_state(model: nn.Module, optimizer, state: dict) -> None:
    if isinstance(optimizer, ShardedAdamW):
        optimizer.load_flat_state_dict(state)
    else:
        set_optimizer_state_dict(model, optimizer, state, options=OPTIONS)


def _states(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> list[tuple[dict, dict]]:
    return [(get_model_state_dict(m, options=OPTIONS), _optimizer_state(m, o)) for m, o in zip(parts, optimizers)]


def _merged(states: list[tuple[dict, dict]], tied: bool) -> dict:
    model, optim = {}, {}
    for msd, osd in states:
        model.update({_key(k, tied): v for k, v in msd.items()})
        optim.update({_key(k, tied): v for k, v in osd.items()})
    return {"model": model, "optimizer": optim}


def save(directory: str | Path, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
         tied: bool) -> None:
    """Every rank writes its shards; ``step`` is the number of steps done."""
    state = _merged(_states(parts, optimizers), tied)
    dcp.save({**state, "step": torch.tensor(step)}, checkpoint_id=str(directory))


def load(directory: str | Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
         tied: bool) -> int:
    """Load into this rank's (already parallelised) parts; returns the number of steps done."""
    if not Path(directory).is_dir():
        raise UserError("no such checkpoint directory", source=str(directory))
    states = _states(parts, optimizers)
    state = {**_merged(states, tied), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(directory))
    # a key two parts of this rank share (a tied embedding's two copies, both stages on one rank in a V): DCP
    # loaded it into one part's tensors, which may be that part's live optimizer state; the other part gets
    # its own copy, or both optimizers would step one moment tensor twice
    owners: dict[str, int] = {}
    for msd, osd in states:
        for k in list(msd) + list(osd):
            owners[_key(k, tied)] = owners.get(_key(k, tied), 0) + 1

    def own(k: str, section: str, holder: bool):
        value = state[section][_key(k, tied)]
        shared = owners[_key(k, tied)] > 1 and not holder
        return value.detach().clone() if shared and isinstance(value, torch.Tensor) else value

    for i, ((msd, osd), m, o) in enumerate(zip(states, parts, optimizers)):
        holder = i == len(states) - 1           # the part whose tensors the merged state holds (``_merged``: the last)
        set_model_state_dict(m, {k: own(k, "model", holder) for k in msd}, options=OPTIONS)
        _set_optimizer_state(m, o, {k: own(k, "optimizer", holder) for k in osd})
    return int(state["step"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(folder: Path, meta: dict) -> None:
    """Write, flush and fsync the marker under a temporary name, then rename it into place."""
    write_json(folder / MARKER, meta)
    _fsync(folder)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(path: Path) -> None:
    """Restore this rank's RNG from ``path``: tensors only (``weights_only``), no object is ever
    unpickled from a checkpoint folder."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:      # UnpicklingError: the file holds more than tensors
        raise UserError(f"not an RNG state written by meshplan run (refused to unpickle: "
                        f"{str(e).splitlines()[0][:160]})", source=str(path)) from None
    if not isinstance(state, dict) or not isinstance(state.get("cpu"), torch.Tensor):
        raise UserError("not an RNG state written by meshplan run (expected {'cpu': tensor})", source=str(path))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_atomic(root: str | Path, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
                tied: bool, meta: dict, files: dict[str, dict] | None = None, before_marker=None) -> Path:
    """Collective: the checkpoint after ``step`` steps, complete or not there at all (see the module
    docstring). ``meta`` goes into the marker, ``files`` ({name: JSON document}) beside it, written by
    rank 0 (the plan: executor/train.py); ``before_marker`` runs on every rank once all shards are
    written (fault injection). Returns the complete folder."""
    root, rank = Path(root), dist.get_rank()
    partial, final = partial_dir(root, step), step_dir(root, step)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    save(partial, step, parts, optimizers, tied=tied)          # DCP: every rank its shards, rank 0 .metadata
    torch.save(_rng_state(), partial / f"rng-rank{rank}.pt")
    dist.barrier()                                             # every rank's files are written
    if before_marker is not None:
        before_marker()
    if rank == 0:
        for name, doc in (files or {}).items():
            write_json(partial / name, doc)
        _write_marker(partial, {**meta, "step": step, "world_size": dist.get_world_size()})
        if final.exists():                                     # an unfinished copy: complete ones are older
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync(root)
        for folder in root.iterdir():                          # the new one is complete: drop the older ones
            match = COMPLETE.match(folder.name)
            if match and int(match.group(1)) < step:
                shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    return final


def resume(root: str | Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
           tied: bool) -> tuple[int, dict | None]:
    """Collective: load the latest complete checkpoint in ``root`` into this rank's parts; returns
    (steps done, its marker), or (0, None) when there is none. Rank 0 removes interrupted
    (partial) checkpoints first and decides which one every rank loads."""
    root = Path(root)
    choice: list = [None]
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for folder in root.iterdir():
            if PARTIAL.match(folder.name):
                shutil.rmtree(folder, ignore_errors=True)
        found = latest_complete(root)
        choice = [(str(found[0]), found[1]) if found else None]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return 0, None
    folder, meta = Path(choice[0][0]), choice[0][1]
    step = load(folder, parts, optimizers, tied=tied)
    rng = folder / f"rng-rank{dist.get_rank()}.pt"
    if meta.get("world_size") == dist.get_world_size() and rng.exists():
        set_rng_state(rng)
    return step, meta
