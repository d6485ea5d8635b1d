"""Pipeline schedules: one record each, the one home of everything meshplan knows about a schedule.

A record holds the schedule's names (``meshplan plan --schedule`` and plan.json, Megatron-LM,
torchtitan and torch.distributed.pipelining, DeepSpeed, Colossal-AI), where its virtual stages
sit, how many micro-batches each rank holds in flight, the pipeline's time, what it needs of the
backward pass, its constraints, and whether another schedule dominates it. The cost model, the
search (its bounds and the stage ILP), the simulation, the CLI's choices, plan.json, the
executor and the exports all read these records. What a record cannot hold is each schedule's
event order, which the simulation keeps beside it (``planner.simulate.SCHEDULE_ORDERS``, one
function per record, checked by a test), and the executor's construction of torch's class
(``executor/pipeline.py``, by ``torch_name``).

Adding a schedule: a record here, its event order in ``planner/simulate.py``, and (where torch's
class takes other arguments) its construction in ``executor/pipeline.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import UserError, one_of


@dataclass(frozen=True, kw_only=True)
class PipelineSchedule:
    """One pipeline schedule: its names, its shape, its time and memory, its constraints."""

    name: str                   # --schedule and plan.json's config.schedule
    title: str                  # in sentences: "interleaved 1F1B"
    description: str            # one line: --help, the README and the reports say the same
    source: str                 # where the schedule is defined
    # -- names in each framework (None: the framework cannot run it; ``nearest`` says what to run instead)
    torch_name: str             # torch.distributed.pipelining's get_schedule_class name, which is also
                                # torchtitan's parallelism.pipeline_parallel_schedule
    megatron: str | None        # how Megatron-LM runs it (pretrain_gpt.py flags), in words
    deepspeed: str | None       # DeepSpeed's PipelineEngine schedule (deepspeed/runtime/pipe/schedule.py)
    colossalai: str | None      # HybridParallelPlugin's pp_style
    nearest: str | None = None  # the schedule a framework that lacks this one runs instead
    # -- shape
    virtual_stages: bool        # several (virtual) stages per rank (--vpp >= 2); else exactly one
    placement: Literal["loop"] = "loop"   # virtual stage j on pipeline rank j % pp (Narayanan et al. 2021,
                                          # Sec 2.2.2)
    backward: Literal["whole"] = "whole"  # what it needs of the backward pass: one pass per stage and
                                          # micro-batch (input and weight gradients together)
    overlaps_sends: bool        # sends are posted and compute goes on (Megatron-LM overlap_p2p_comm); else
                                # the sender waits for its send before its next pass
    microbatches_multiple_of_pp: bool     # the micro-batches per step must be a multiple of pp
    dominated_by: str | None = None       # a schedule no slower with no more memory: not searched unless fixed
    fewer_microbatches_than_stages: str | None = None
    # ^ the schedule torch runs instead when a step has fewer micro-batches than stages (the same order)

    # -- time and memory ------------------------------------------------------------------------
    def pipeline_s(self, *, slowest, total, m: int, p: int, v: int, hop_s: float = 0.0):
        """The pipeline's time for ``m`` micro-batches from the slowest rank's forward + backward time
        per micro-batch and their sum over the ranks (each with its own sends). Linear in both, so it
        serves plain numbers and the stage ILP's expressions alike.

        One stage per rank (GPipe, 1F1B): (m - 1) slowest + sum, exact for the fill and drain of a
        linear pipeline (Narayanan et al. 2021, Sec 2.2: bubble (p - 1) t for equal stages); without a
        pipeline that is m times the one rank. Interleaved with v chunks: (m + (p - 1)/v) slowest (bubble
        fraction (p - 1)/(v m), ibid. Sec 2.2.2), plus one stage-boundary transfer (``hop_s``) per hop
        of the fill and of the drain, 2 (p v - 1) hops that wait for their data and cannot overlap."""
        if self.virtual_stages and p > 1:
            return (m + (p - 1) / v) * slowest + 2 * (p * v - 1) * hop_s
        return (m - 1) * slowest + total

    def inflight(self, *, rank: int, pp: int, vpp: int, m: int) -> float:
        """Micro-batches whose activations pipeline rank ``rank`` holds at its peak, in units of the
        rank's whole set of layers. Without a pipeline, one."""
        if pp == 1:
            return 1.0
        return self._inflight(rank, pp, vpp, m)

    def _inflight(self, rank: int, pp: int, vpp: int, m: int) -> float:
        raise NotImplementedError

    # -- constraints ----------------------------------------------------------------------------
    def refusal(self, *, pp: int, vpp: int, m: int | None = None) -> tuple[str, str] | None:
        """(flag, why) when this schedule cannot run ``pp`` stages of ``vpp`` virtual stages each with
        ``m`` micro-batches (None: not known yet); None when it can."""
        if self.virtual_stages:
            if pp < 2:
                return "--schedule", f"{self.title} needs pp >= 2"
            if vpp < 2:
                return "--vpp", f"{self.title} needs --vpp >= 2 virtual stages per rank"
        elif vpp != 1:
            return "--vpp", f"--vpp {vpp} needs a schedule with virtual stages ({one_of(virtual_names())})"
        if self.microbatches_multiple_of_pp and m is not None and pp > 1 and m % pp:
            return "--micro-batch", (f"{self.title} needs the micro-batches per step ({m}) to be a multiple of "
                                     f"pp ({pp})")
        return None


@dataclass(frozen=True, kw_only=True)
class _AllForwardsFirst(PipelineSchedule):
    def _inflight(self, rank, pp, vpp, m):
        return float(m)                         # every micro-batch's forward before any backward


@dataclass(frozen=True, kw_only=True)
class _OneForwardOneBackward(PipelineSchedule):
    def _inflight(self, rank, pp, vpp, m):
        return float(min(m, pp - rank))         # p - rank warm-up forwards (Narayanan et al. 2021, Sec 2.2.1)


@dataclass(frozen=True, kw_only=True)
class _Interleaved(PipelineSchedule):
    def _inflight(self, rank, pp, vpp, m):
        # rank r runs 2(p - r - 1) + (v - 1) p warm-up chunk-micro-batches plus one in flight, each 1/v of
        # the rank's layers (Megatron-LM schedules.py); for rank 0 that is 1 + (p - 1)/(p v) of p
        # micro-batches (Korthikanti et al. 2022, Sec 4.2.3)
        chunks = min(m * vpp, 2 * (pp - rank - 1) + (vpp - 1) * pp + 1)
        return chunks / vpp


GPIPE = _AllForwardsFirst(
    name="gpipe", title="GPipe", source="Huang et al. 2019",
    description="every forward, then every backward: all micro-batches in flight",
    torch_name="GPipe", megatron=None, deepspeed=None, colossalai=None, nearest="1f1b",
    virtual_stages=False, overlaps_sends=False, microbatches_multiple_of_pp=False,
    dominated_by="1f1b")        # the same time as 1F1B (the same passes, fill and drain), all m in flight
ONE_F_ONE_B = _OneForwardOneBackward(
    name="1f1b", title="1F1B", source="Narayanan et al. 2021, Sec 2.2.1 (PipeDream-Flush)",
    description="one forward, one backward after a warm-up: at most pp micro-batches in flight",
    torch_name="1F1B", megatron="the default with --pipeline-model-parallel-size > 1", deepspeed="1F1B (TrainSchedule)",
    colossalai="1f1b", virtual_stages=False, overlaps_sends=False, microbatches_multiple_of_pp=False,
    fewer_microbatches_than_stages="gpipe")     # torch's 1F1B class refuses m < pp
INTERLEAVED_1F1B = _Interleaved(
    name="interleaved-1f1b", title="interleaved 1F1B", source="Narayanan et al. 2021, Sec 2.2.2",
    description="1F1B over --vpp virtual stages per rank: a bubble --vpp times smaller, more sends",
    torch_name="Interleaved1F1B", megatron="--num-layers-per-virtual-pipeline-stage (or a layout with virtual "
                                           "stages)",
    deepspeed=None, colossalai="interleaved", nearest="1f1b",
    virtual_stages=True, overlaps_sends=True, microbatches_multiple_of_pp=True)

SCHEDULES: dict[str, PipelineSchedule] = {s.name: s for s in (GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B)}
NAMES: tuple[str, ...] = tuple(SCHEDULES)
DEFAULT = ONE_F_ONE_B.name          # the schedule of a plan without a pipeline, and of one without --vpp


def schedule(name: str, field: str = "--schedule") -> PipelineSchedule:
    """The record of ``name``; UserError naming ``field`` and the schedules there are."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise UserError(f"{name!r} is not a schedule; allowed: {one_of(NAMES)}", field=field) from None


def virtual_names() -> tuple[str, ...]:
    """The schedules that run several virtual stages per rank."""
    return tuple(s.name for s in SCHEDULES.values() if s.virtual_stages)


def default_for(vpp: int | None) -> str:
    """The schedule a plan with ``vpp`` virtual stages per rank runs when none is named: the first with
    virtual stages for vpp > 1, else 1F1B."""
    return virtual_names()[0] if (vpp or 1) > 1 else DEFAULT
