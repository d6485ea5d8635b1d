"""A pipeline played pass by pass: each rank's passes in its schedule's order, each once its input has arrived,
the sends between the ranks (what ``planner/simulate.py`` plays with the data-parallel collectives, the optimizer
and the layer-by-layer detail besides, and what the search plays alone where the closed form does not hold:
``planner/cost/step.py played_pipeline_s``). It needs only the schedules, so the cost model can call it."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .pipeline_orders import schedule_order
from .schedules import SCHEDULES, rank_chunk, stage_of

SEND_NEXT, SEND_PREV = "send-next", "send-prev"     # a rank's send streams


@dataclass(frozen=True)
class _Shape:
    """What ``_needs`` and ``_send_target`` read of a StepWork: its stages and where they sit
    (``PipelineSchedule.placement``)."""
    pp: int
    vpp: int
    placement: str = "loop"

    def stage_of(self, rank: int, chunk: int) -> int:
        return stage_of(self.placement, rank, chunk, self.pp)

    def rank_of(self, stage: int) -> int:
        return rank_chunk(self.placement, stage, self.pp)[0]


def _needs(work: _Shape, rank: int, op: tuple[str, int, int]) -> tuple | None:
    """The arrival a pass waits for (None: its input is local; the weight gradient's always is, after its
    input gradient, which every order runs first)."""
    kind, mb, chunk = op
    if kind == "W":
        return None
    stage = work.stage_of(rank, chunk)
    if kind == "F":
        return ("F", mb, stage) if stage > 0 else None
    return ("B", mb, stage) if stage < work.pp * work.vpp - 1 else None


def _send_target(work: _Shape, rank: int, op: tuple[str, int, int]) -> tuple | None:
    """(stream, arrival key) of a pass's output: the next virtual stage (forward) or the previous
    (backward: whole or input gradient); None at the ends and for the weight gradient, which sends
    nothing. The stream is None where the target stage is on the same rank (the turn of a V): the
    output is there when the pass ends."""
    kind, mb, chunk = op
    if kind == "W":
        return None
    stage = work.stage_of(rank, chunk)
    target = stage + 1 if kind == "F" else stage - 1
    if not 0 <= target < work.pp * work.vpp:
        return None
    key = ("F" if kind == "F" else "B", mb, target)
    if work.rank_of(target) == rank:
        return None, key
    return SEND_NEXT if kind == "F" else SEND_PREV, key


@functools.lru_cache(maxsize=64)
def schedule_programs(schedule: str, pp: int, vpp: int, num_microbatches: int) -> tuple[tuple, tuple, tuple]:
    """Per rank: its passes in order (``schedule_order``), the arrival each waits for (``_needs``) and where
    its output goes (``_send_target``). They depend on the schedule's shape only, so the finalists of a
    search, which mostly share it, build them once (read-only tuples)."""
    shape = _Shape(pp, vpp, SCHEDULES[schedule].placement if pp > 1 else "loop")
    programs = tuple(tuple(schedule_order(schedule, pp=pp, vpp=vpp, num_microbatches=num_microbatches, rank=r))
                     for r in range(pp))
    needs = tuple(tuple(_needs(shape, r, op) for op in prog) for r, prog in enumerate(programs))
    targets = tuple(tuple(_send_target(shape, r, op) for op in prog) for r, prog in enumerate(programs))
    return programs, needs, targets


def shorter_runs(schedule: str, pp: int, num_microbatches: int) -> tuple[int, int] | None:
    """(m1, group): a step of ``num_microbatches`` is extrapolated from runs of m1, m1 + group and m1 + 2 group
    micro-batches (a group: one micro-batch in GPipe and 1F1B, pp of them with virtual stages), where those are
    less work than the step and the schedule repeats itself so; None where it is played whole. Not under the V
    placement (zbv, DualPipeV), whose steps of unequal stages grew alike over three lengths and then differently
    (played on 80 random pipelines of 4 to 16 ranks: extrapolated 0.2-3.0% short in 7 to 9 of them)."""
    m = num_microbatches
    group = pp if SCHEDULES[schedule].virtual_stages else 1
    m1 = group * max(2, -(-4 * pp // group))
    if SCHEDULES[schedule].placement == "v" or pp == 1 or m < m1 + 4 * group or (m - m1) % group \
            or 3 * (m1 + group) >= m:
        return None
    return m1, group


def play_pipeline(schedule: str, passes: tuple, num_microbatches: int, *, hop_s: float = 0.0,
                  blocking_sends: bool = True) -> float:
    """``_play_pipeline`` for ``num_microbatches``, extrapolated from ``shorter_runs`` where every rank's streams
    end alike later in each (planner/simulate.py ``step_time``'s rule, with each rank's streams for its parts), as
    the search plays the pipelines of hundreds of micro-batches too."""
    m = num_microbatches
    shorter = shorter_runs(schedule, len(passes), m)
    if shorter is None:
        return _play_pipeline(schedule, passes, m, hop_s=hop_s, blocking_sends=blocking_sends)
    m1, group = shorter
    runs = [_play_pipeline(schedule, passes, n, hop_s=hop_s, blocking_sends=blocking_sends, ends=True)
            for n in (m1, m1 + group, m1 + 2 * group)]
    first, second = ([b - a for a, b in zip(runs[i], runs[i + 1])] for i in (0, 1))
    if any(abs(x - y) > 1e-9 * max(1.0, max(runs[2])) for x, y in zip(first, second)):
        return _play_pipeline(schedule, passes, m, hop_s=hop_s, blocking_sends=blocking_sends)
    return max(a + (m - m1) // group * d for a, d in zip(runs[0], first))


def pipeline_floor(schedule: str, passes: tuple, num_microbatches: int, *, hop_s: float = 0.0) -> float:
    """A lower bound on ``play_pipeline``'s time, at the cost of a few sums (what the search asks before it plays
    a candidate that may not need playing: ``simulate.played_candidate``). Rank r's first stage is r, under
    either placement. Its first pass is a forward, at stage r or later: it waits for the first micro-batch's
    forward through every stage before r and the sends between them (each at least ``hop_s`` where it crosses
    ranks). Its last backward pass (a whole backward, or an input gradient under a split backward; only weight
    gradients may follow it) is at stage r or later, and its gradient then goes back through every stage before
    r. In between the rank runs its passes one after another, all of them but the weight gradients that may follow
    the last backward. And one micro-batch goes through every stage and back (a step of few micro-batches)."""
    p, v, m = len(passes), len(passes[0]), num_microbatches
    shape = _Shape(p, v, SCHEDULES[schedule].placement if p > 1 else "loop")
    split = SCHEDULES[schedule].backward == "split"
    forward, backward, crossing = [0.0] * (p * v), [0.0] * (p * v), [0.0] * (p * v)
    for r in range(p):
        for c, (f, b, w) in enumerate(passes[r]):
            stage = shape.stage_of(r, c)
            forward[stage], backward[stage] = f, (b - w if split else b)
    for stage in range(p * v - 1):      # the send from each stage to the next, and back
        crossing[stage] = hop_s if shape.rank_of(stage) != shape.rank_of(stage + 1) else 0.0
    most = sum(forward) + sum(backward) + 2 * sum(crossing)     # one micro-batch there and back
    fill = drain = 0.0
    for r in range(p):
        work = m * sum(f + b for f, b, _ in passes[r])
        trailing = m * sum(w for _, _, w in passes[r]) if split else 0.0
        most = max(most, fill + work, fill + work - trailing + drain)
        fill += forward[r] + crossing[r]
        drain += backward[r] + crossing[r]
    return most


def _play_pipeline(schedule: str, passes: tuple, num_microbatches: int, *, hop_s: float = 0.0,
                   blocking_sends: bool = True, ends: bool = False):
    """The step time ``simulate_work`` gives a pipeline of chunks with no data-parallel collective, no optimizer
    and no layer-by-layer detail, played without its bookkeeping (what the search calls thousands of times):
    ``passes[rank][chunk]`` = (forward, backward, of it the weight gradient) seconds per micro-batch. Each rank
    runs its passes in the schedule's order, each once its input has arrived and its own last blocking send is
    done; a send leaves on its stream when the pass ends and the stream is free."""
    p, v = len(passes), len(passes[0])
    programs, needs, targets = schedule_programs(schedule, p, v, num_microbatches)
    kinds = {"F": 0, "B": 1, "I": 2, "W": 3}
    seconds = [[(f, b, b - w, w) for f, b, w in rank] for rank in passes]
    durations = [[own[chunk][kinds[kind]] for kind, _, chunk in prog] for own, prog in zip(seconds, programs)]
    free, block = [0.0] * p, [0.0] * p
    send = [{SEND_NEXT: 0.0, SEND_PREV: 0.0} for _ in range(p)]
    arrivals: dict[tuple, float] = {}
    position = [0] * p
    remaining = sum(len(prog) for prog in programs)
    while remaining:
        progressed = False
        for r in range(p):
            need_of, target_of, took, sends = needs[r], targets[r], durations[r], send[r]
            n = len(took)
            i, t, until = position[r], free[r], block[r]
            while i < n:
                need = need_of[i]
                if need is not None:
                    ready = arrivals.get(need)
                    if ready is None:
                        break
                    if ready > t:
                        t = ready
                if until > t:
                    t = until
                t += took[i]
                target = target_of[i]
                if target is not None:
                    stream, key = target
                    if stream is None:          # the next stage is on this rank
                        arrivals[key] = t
                    else:
                        end = (t if t > sends[stream] else sends[stream]) + hop_s
                        sends[stream] = arrivals[key] = end
                        if blocking_sends:
                            until = end
                i += 1
            if i != position[r]:
                remaining -= i - position[r]
                position[r], free[r], block[r] = i, t, until
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule} deadlocked (a bug in schedule_order)")
    if ends:        # each rank's compute and send streams when they are done
        return [*free, *block, *(x for sends in send for x in sends.values())]
    return max(max(t, until) for t, until in zip(free, block))
