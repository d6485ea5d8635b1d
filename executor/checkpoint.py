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
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from planner.errors import UserError

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _key(key: str, tied: bool) -> str:
    """The checkpoint key of a state-dict key (model FQN or flattened optimizer key)."""
    return key.replace("lm_head.weight", "embed.tokens.weight") if tied else key


def _states(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> list[tuple[dict, dict]]:
    return [(get_model_state_dict(m, options=OPTIONS), get_optimizer_state_dict(m, o, options=OPTIONS))
            for m, o in zip(parts, optimizers)]


def _merged(states: list[tuple[dict, dict]], tied: bool) -> dict:
    model, optim = {}, {}
    for msd, osd in states:
        model.update({_key(k, tied): v for k, v in msd.items()})
        optim.update({_key(k, tied): v for k, v in osd.items()})
    return {"model": model, "optimizer": optim}


def _check(optimizers: list[torch.optim.Optimizer]) -> None:
    if any(hasattr(o, "consolidate_state_dict") for o in optimizers):
        raise UserError("checkpoints of ZeRO-1 runs are not supported (ZeroRedundancyOptimizer has no "
                        "distributed state dict); use --zero 0, 2 or 3", field="config.zero")


def save(directory: str | Path, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
         tied: bool) -> None:
    """Every rank writes its shards; ``step`` is the number of steps done."""
    _check(optimizers)
    state = _merged(_states(parts, optimizers), tied)
    dcp.save({**state, "step": torch.tensor(step)}, checkpoint_id=str(directory))


def load(directory: str | Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], *,
         tied: bool) -> int:
    """Load into this rank's (already parallelised) parts; returns the number of steps done."""
    _check(optimizers)
    if not Path(directory).is_dir():
        raise UserError("no such checkpoint directory", source=str(directory))
    states = _states(parts, optimizers)
    state = {**_merged(states, tied), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(directory))
    for (msd, osd), m, o in zip(states, parts, optimizers):
        set_model_state_dict(m, {k: state["model"][_key(k, tied)] for k in msd}, options=OPTIONS)
        set_optimizer_state_dict(m, o, {k: state["optimizer"][_key(k, tied)] for k in osd}, options=OPTIONS)
    return int(state["step"])
