"""The closed forms of the virtual-stage pipelines against the same pipelines played pass by pass.

    python benchmarks/pipeline_closed_form.py [--trials 150] [--seed 1]

For each schedule with virtual stages (interleaved 1F1B, ZB1P, ZB-V, DualPipeV) it draws random pipelines of 2 to
12 ranks, each chunk's forward, input gradient and weight gradient jittered by 5%, in four shapes: all alike, or
one stage (the first, the last, one in the middle) 1.8 times the others, as an embedding's or a head's is. Each is
played in its schedule's own order (planner/pipeline_play.py ``play_pipeline``, what the simulation plays) and
priced in closed form (``PipelineSchedule.pipeline_s``), and, for comparison, by the form the closed form had
before 2026-11-29, (m + (p - 1)/v) slowest (less 2 (p - 1)/v W for the split backward), whose bubble was the
slowest rank's own chunks. It prints the mean and the range of closed / played - 1 for both, and a second table for
ZB-V with fewer micro-batches than its 2 pp stages, where the closed form takes the larger of the steady term and
the term of a V with no steady state (``PipelineSchedule.pipeline_terms``). Numbers of the schedules' shapes only:
no model, no cluster.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.pipeline_play import play_pipeline  # noqa: E402
from planner.schedules import SCHEDULES, stage_of  # noqa: E402

SHAPES = ("alike", "first 1.8x", "last 1.8x", "middle 1.8x")


def _passes(rng: random.Random, record, p: int, v: int, shape: str, f: float, i: float, w: float) -> tuple:
    heavy = {"first 1.8x": 0, "last 1.8x": p * v - 1, "middle 1.8x": (p * v) // 2}.get(shape)
    out = []
    for r in range(p):
        chunks = []
        for c in range(v):
            k = rng.uniform(0.95, 1.05) * (1.8 if stage_of(record.placement, r, c, p) == heavy else 1.0)
            ww = k * w if record.backward == "split" else 0.0
            chunks.append((k * f, k * i + ww, ww))
        out.append(tuple(chunks))
    return tuple(out)


def rank_sums(record, passes: tuple) -> tuple[float, float, float]:
    """(the slowest rank's time per micro-batch, the sum over the ranks, the least rank's weight gradients; 0 where
    the schedule runs whole backwards) of ``passes[rank][chunk]`` = (forward, backward, of it the weight gradient)."""
    per = [sum(f + b for f, b, _ in chunks) for chunks in passes]
    least_w = min(sum(w for _, _, w in chunks) for chunks in passes) if record.backward == "split" else 0.0
    return max(per), sum(per), least_w


def closed_and_before(record, passes: tuple, m: int) -> tuple[float, float]:
    """(the closed form, the form before 2026-11-29) of ``passes`` over ``m`` micro-batches."""
    p, v = len(passes), len(passes[0])
    slowest, total, least_w = rank_sums(record, passes)
    closed = record.pipeline_s(slowest=slowest, total=total, m=m, p=p, v=v, wgrad_s=least_w)
    return closed, (m + (p - 1) / v) * slowest - 2 * (p - 1) / v * least_w


def _row(errors: list[float]) -> str:
    return f"{100 * sum(map(abs, errors)) / len(errors):5.2f}%  [{100 * min(errors):+6.2f}%, {100 * max(errors):+6.2f}%]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=150, help="pipelines per schedule and shape (default 150)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print("closed / played - 1: mean |error| [least, most]")
    print(f"{'schedule':17} {'stages':12} {'closed form':27} {'before 2026-11-29':27}")
    for name in ("interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"):
        record = SCHEDULES[name]
        for shape in SHAPES:
            ours, old = [], []
            for _ in range(args.trials):
                p = rng.choice([2, 4, 8, 12])
                v = record.stages_per_rank or rng.choice([2, 3, 4])
                m = p * rng.choice([1, 2, 4]) if record.microbatches_multiple_of_pp else rng.randint(2 * p, 4 * p)
                f = rng.uniform(0.5, 2.0)
                passes = _passes(rng, record, p, v, shape, f, f * rng.uniform(0.8, 1.4), f * rng.uniform(0.3, 1.0))
                played = play_pipeline(name, passes, m)
                closed, before = closed_and_before(record, passes, m)
                ours.append(closed / played - 1)
                old.append(before / played - 1)
            print(f"{name:17} {shape:12} {_row(ours):27} {_row(old):27}")
    print()
    print("ZB-V with m < 2 pp micro-batches, stages alike: closed form, and its steady term alone")
    record = SCHEDULES["zbv"]
    for label, ratio in (("T_I <= T_F", (0.6, 1.0)), ("T_I > T_F", (1.0, 1.6))):
        ours, steady = [], []
        for _ in range(args.trials):
            p = rng.choice([2, 4, 8, 12, 16, 24])
            m = rng.randint(1, 2 * p - 1)
            f = rng.uniform(0.5, 2.0)
            passes = _passes(rng, record, p, 2, "alike", f, f * rng.uniform(*ratio), f * rng.uniform(0.2, 1.2))
            played = play_pipeline("zbv", passes, m)
            slowest, total, least_w = rank_sums(record, passes)
            terms = record.pipeline_terms(slowest=slowest, total=total, m=m, p=p, v=2, wgrad_s=least_w)
            ours.append(max(terms) / played - 1)
            steady.append(terms[0] / played - 1)
        print(f"  {label:11} closed form {_row(ours)}   steady term alone {_row(steady)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
