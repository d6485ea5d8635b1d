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
    ilp_unproven: int = 0                  # of which stopped at their time limit: the best found, not proven best
    choice: "Choice | None" = None         # how ``best`` was chosen among the near-ties (``choose``)


def sort_key(c: Candidate) -> tuple:
    """Fastest first; ties go to less memory, then to the simpler config."""
    cfg = c.config
    return (round(c.estimate.step_time_s, 12), round(c.estimate.memory.total), cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.zero,
            policy_rank(cfg.recompute), cfg.vpp, cfg.sequence_parallel, cfg.optimizer_offload,
            cfg.micro_batch)


def layout_key(config: ParallelConfig) -> tuple[int, int, int, int, int]:
    return (config.dp, config.tp, config.pp, config.cp, config.ep)


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
    """The best candidate of each distinct parallel layout (dp, tp, pp, cp, ep), the k fastest
    layouts kept: the runners-up are other ways to split the job, not near-copies. Within a
    layout, a plan with more offload or recompute must be faster by more than the optimality gap
    to displace a simpler one (a 0.02% gain is not worth moving the optimizer to the host)."""

    def __init__(self, k: int, cap: float = float("inf"), played=None):
        """``cap``: a step time no plan worth keeping reaches (a bound from outside the search: another precision's
        plan to beat); what is slower is pruned as if k faster ones were held. ``played``: (candidate, bar) -> what
        the candidate is ranked as, where not its closed form, or None where that cannot come under the bar
        (planner/simulate.py ``played_candidate``)."""
        self.k, self.items, self.cap, self.played = k, [], cap, played

    def add(self, c: Candidate) -> None:
        if self.played is not None:
            c = self.played(c, self._bar())
            if c is None:
                return
        if c.estimate.step_time_s >= self.cap:
            return
        key = layout_key(c.config)
        same = [x for x in self.items if layout_key(x.config) == key]
        if same and not _better(c, same[0]):
            return
        self.items = [x for x in self.items if layout_key(x.config) != key] + [c]
        self.items.sort(key=sort_key)
        del self.items[self.k:]

    def _bar(self) -> float:
        """A step time from which a candidate is turned away whatever its layout: at the cap, or beyond the k-th
        kept by more than the gap within which a simpler plan displaces one of its layout (``_better``)."""
        if len(self.items) < self.k:
            return self.cap
        return min(self.cap, self.items[-1].estimate.step_time_s * (1 + 2 * OPTIMALITY_GAP))

    @property
    def threshold(self) -> float:
        return min(self.cap, self.items[-1].estimate.step_time_s if len(self.items) >= self.k else float("inf"))


def error_bands(cluster, workload) -> tuple[float, float]:
    """(step time, memory): the median errors of the validation that covers the plan
    (planner/accuracy.py); 0 where none does."""
    from ..accuracy import accuracy
    checked = accuracy(cluster, workload)
    return (checked.step_time.median_abs if checked.step_time else 0.0,
            checked.memory.median_abs if checked.memory else 0.0)


def mechanisms(config: ParallelConfig) -> tuple[str, ...]:
    """What the cost model must get right for a plan beyond plain data parallelism: each mechanism its
    step time or memory rests on (fewer: less for the model's error to hide in)."""
    out = []
    if config.pp > 1:
        out.append("pipeline bubble and sends")
    if config.vpp > 1:
        out.append("interleaved stages")
    if config.tp > 1:
        out.append("TP collectives")
    if config.sequence_parallel:
        out.append("sequence parallelism")
    if config.cp > 1:
        out.append("CP exchange")
    if config.ep > 1:
        out.append("expert all-to-all")
    if config.zero == 3:
        out.append("ZeRO-3 parameter gathers")
    if config.optimizer_offload:
        out.append("optimizer offload")
    if config.recompute != "none" or (config.recompute_layers and any(p != "none" for p in config.recompute_layers)):
        out.append("recompute")
    if config.stage_layers and len(set(config.stage_layers)) > 1:
        out.append("unequal stages")
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Choice:
    """How the plan was chosen among those the model cannot tell apart: the candidates within the
    step-time error band of the fastest; ``rule`` "fastest" (none is safer) or "more-headroom-within-band"
    (one within the band has no more mechanisms, at least as much memory left, and is better on one)."""

    rule: str
    band: float                        # the validation's median step-time error (planner/accuracy.py)
    within: tuple[Candidate, ...]      # the candidates within the band of the fastest, the fastest first
    fastest: Candidate

    def to_json(self) -> dict:
        return {"rule": self.rule, "band": self.band, "within_band": len(self.within),
                "fastest": {"config": self.fastest.config.to_json(),
                            "step_time_s": self.fastest.estimate.step_time_s}}


def memory_left(c: Candidate) -> float:
    """Bytes the plan leaves free below its usable memory (the device's less the headroom)."""
    return c.estimate.usable_bytes - c.estimate.memory.total


def choose(best: Candidate, alternatives: tuple[Candidate, ...], band: float,
           memory_band: float = 0.0) -> tuple[Candidate, Choice]:
    """The plan to recommend: the fastest, unless a candidate within ``band`` (a fraction of its step
    time) of it is no riskier on either count (no more mechanisms, at least as much memory left) and
    safer on one (fewer mechanisms, or more memory left by more than ``memory_band``, the memory model's
    error, of the usable memory); of those, the one with the fewest mechanisms, then the most memory
    left, then the fastest."""
    within = tuple(c for c in (best, *alternatives) if c.estimate.step_time_s <= best.estimate.step_time_s * (1 + band))
    n0, left0 = len(mechanisms(best.config)), memory_left(best)
    margin = memory_band * best.estimate.usable_bytes
    safer = [c for c in within[1:] if len(mechanisms(c.config)) <= n0 and memory_left(c) >= left0
             and (len(mechanisms(c.config)) < n0 or memory_left(c) > left0 + margin)]
    if not safer:
        return best, Choice(rule="fastest", band=band, within=within, fastest=best)
    chosen = min(safer, key=lambda c: (len(mechanisms(c.config)), -memory_left(c), c.estimate.step_time_s))
    return chosen, Choice(rule="more-headroom-within-band", band=band, within=within, fastest=best)
