"""What the search returns and how it ranks: the SearchResult, the order of candidates, and the best
plan of each layout kept for the runners-up."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ParallelConfig
from ..estimate import Candidate
from ..recompute import policy_rank


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    best: Candidate | None                 # fastest that fits
    alternatives: tuple[Candidate, ...]    # the runners-up that fit, fastest first
    candidates: int                        # legal configurations covered (evaluated or pruned exactly)
    evaluated: int                         # configurations estimated in full (time and memory)
    memory_checked: int = 0                # configurations rejected on memory alone
    seconds: float
    least_memory: Candidate | None = None  # when nothing fits: what needs the least memory
    groups: int = 0                        # global choices the stage search looked at
    ilp_solves: int = 0                    # stage ILPs run (the others were bounded out)
    ilp_improved: int = 0                  # of which beat every balanced-stage candidate


def sort_key(c: Candidate) -> tuple:
    """Fastest first; ties go to less memory, then to the simpler config."""
    cfg = c.config
    return (round(c.estimate.step_time_s, 12), round(c.estimate.memory.total), cfg.tp, cfg.pp, cfg.cp, cfg.zero,
            policy_rank(cfg.recompute), cfg.vpp, cfg.sequence_parallel, cfg.optimizer_offload,
            cfg.micro_batch)


def layout_key(config: ParallelConfig) -> tuple[int, int, int, int]:
    return (config.dp, config.tp, config.pp, config.cp)


OPTIMALITY_GAP = 1e-3     # the search's answer is the cost model's optimum to within this fraction


def _complexity(c: Candidate) -> tuple[int, float]:
    """What a plan asks of its runtime beyond the plain one: optimizer offload, then the share of
    its layers it recomputes."""
    cfg = c.config
    if cfg.recompute_layers is not None:
        share = sum(p != "none" for p in cfg.recompute_layers) / max(1, len(cfg.recompute_layers))
    else:
        share = 0.0 if cfg.recompute == "none" else 1.0
    return int(cfg.optimizer_offload), share


def _better(new: Candidate, old: Candidate) -> bool:
    """Whether ``new`` should replace ``old`` (the same layout): faster, unless ``old`` is simpler and
    within the optimality gap of it; or simpler and within the gap of ``old``."""
    t_new, t_old = new.estimate.step_time_s, old.estimate.step_time_s
    if _complexity(new) < _complexity(old) and t_new <= t_old * (1 + OPTIMALITY_GAP):
        return True
    if _complexity(new) > _complexity(old) and t_new >= t_old * (1 - OPTIMALITY_GAP):
        return False
    return sort_key(new) < sort_key(old)


class TopK:
    """The best candidate of each distinct parallel layout (dp, tp, pp, cp), the k fastest
    layouts kept: the runners-up are other ways to split the job, not near-copies. Within a
    layout, a plan with more offload or recompute must be faster by more than the optimality gap
    to displace a simpler one (a 0.02% gain is not worth moving the optimizer to the host)."""

    def __init__(self, k: int):
        self.k, self.items = k, []

    def add(self, c: Candidate) -> None:
        key = layout_key(c.config)
        same = [x for x in self.items if layout_key(x.config) == key]
        if same and not _better(c, same[0]):
            return
        self.items = [x for x in self.items if layout_key(x.config) != key] + [c]
        self.items.sort(key=sort_key)
        del self.items[self.k:]

    @property
    def threshold(self) -> float:
        return self.items[-1].estimate.step_time_s if len(self.items) >= self.k else float("inf")
