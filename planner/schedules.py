"""Pipeline schedules: one record each, the one home of everything meshplan knows about a schedule.

A record holds the schedule's names (``meshplan plan --schedule`` and plan.json, Megatron-LM,
torchtitan and torch.distributed.pipelining, DeepSpeed, Colossal-AI), where its virtual stages
sit, how many micro-batches each rank holds in flight, the pipeline's time, what it needs of the
backward pass, its constraints, and whether another schedule dominates it. The cost model, the
search (its bounds and the stage ILP), the simulation, the CLI's choices, plan.json, the
executor and the exports all read these records. What a record cannot hold is each schedule's
event order, which the simulation keeps beside it (``planner.pipeline_orders.SCHEDULE_ORDERS``, one
function per record, checked by a test), and the executor's construction of torch's class
(``executor/pipeline.py``, by ``torch_name``).

Adding a schedule: a record here, its event order in ``planner/pipeline_orders.py``, and (where torch's
class takes other arguments) its construction in ``executor/pipeline.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

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
    placement: Literal["loop", "v"] = "loop"
    # ^ "loop": virtual stage j on pipeline rank j % pp (Narayanan et al. 2021, Sec 2.2.2); "v": two stages per
    #   rank, rank r holds stages r and 2 pp - 1 - r (torch.distributed.pipelining._utils.
    #   generate_stage_to_rank_mapping style "v"; Qi et al., ICLR 2024, Sec 6: the first and the last stage on
    #   rank 0)
    backward: Literal["whole", "split"] = "whole"
    # ^ what it needs of the backward pass: "whole", one pass per stage and micro-batch (input and weight
    #   gradients together); "split", the input gradient (I) and the weight gradient (W) as separate passes
    #   (Qi et al., ICLR 2024, Sec 2.1; torch's stage_backward_input / stage_backward_weight)
    stages_per_rank: int | None = None    # virtual stages per rank it needs exactly (None: any --vpp >= 2)
    compiled_stages: bool = True          # runs stages that are torch.compile'd; torch's split-backward schedules
                                          # refuse them (schedules.py _check_torch_compile_compatibility)
    overlaps_sends: bool        # sends are posted and compute goes on (Megatron-LM overlap_p2p_comm); else
                                # the sender waits for its send before its next pass
    microbatches_multiple_of_pp: bool     # the micro-batches per step must be a multiple of pp
    dominated_by: str | None = None       # a schedule no slower with no more memory: not searched unless fixed
    fewer_microbatches_than_stages: str | None = None
    # ^ the schedule torch runs instead when a step has fewer micro-batches than stages (the same order)

    # -- time and memory ------------------------------------------------------------------------
    def pipeline_s(self, *, slowest, total, m: int, p: int, v: int, hop_s: float = 0.0, wgrad_s: float = 0.0) -> float:
        """The pipeline's time for ``m`` micro-batches from the slowest rank's forward + backward time
        per micro-batch and their sum over the ranks (each with its own sends): the largest of
        ``pipeline_terms``."""
        return max(self.pipeline_terms(slowest=slowest, total=total, m=m, p=p, v=v, hop_s=hop_s, wgrad_s=wgrad_s))

    def pipeline_terms(self, *, slowest, total, m: int, p: int, v: int, hop_s: float = 0.0, wgrad_s=0.0) -> tuple:
        """The pipeline's time as the largest of these terms, each linear in ``slowest``, ``total`` and ``wgrad_s``,
        so that they serve plain numbers and the stage ILP's expressions alike (a row per term). The first is the
        steady schedule's.

        One stage per rank (GPipe, 1F1B): (m - 1) slowest + sum, exact for the fill and drain of a
        linear pipeline (Narayanan et al. 2021, Sec 2.2: bubble (p - 1) t for equal stages); without a
        pipeline that is m times the one rank. Interleaved with v chunks: m slowest + (sum - slowest)/v, the
        slowest rank's m micro-batches and the fill and drain through the other ranks at 1/v of their time per
        micro-batch each (1F1B's form at v = 1; on equal stages (m + (p - 1)/v) slowest, the bubble fraction
        (p - 1)/(v m) of ibid. Sec 2.2.2), plus one stage-boundary transfer (``hop_s``) per hop of the fill and
        of the drain, 2 (p v - 1) hops that wait for their data and cannot overlap. Where one rank is slower
        (the embedding's or the head's), its bubble is the others' chunks, not its own: with one stage 1.8 times
        the others, (m + (p - 1)/v) slowest was up to 23% above the played interleaved 1F1B, this form 16%, and
        over the four interleaved schedules about half as far from the play on average (random stages played in
        each schedule's order: python benchmarks/pipeline_closed_form.py; tests/test_split_backward.py).

        Split backward (``wgrad_s``: the least rank's weight-gradient time per micro-batch, of ``slowest``):
        ZB-H1's bubble (p - 1)(T_F + T_I - T_W) on each chunk (Qi et al., ICLR 2024, Sec 3.1; the DualPipe README's
        ZB1P row (PP - 1)(F + B - 2W), B = I + W), less 2 (p - 1)/v W per rank. The simulation plays each
        schedule's own order (planner/simulate.py) and ranks the finalists; this closed form is its check (equal to
        it on equal stages for interleaved-zb and zbv; DualPipeV's paired order differs where T_I > T_F).
        ``wgrad_s`` 0 gives the interleaved 1F1B form.

        A V (zbv) with fewer micro-batches than its p v stages has no steady state for its weight gradients to
        fill: the first micro-batch's forward and input gradient through every stage is on the path (the sum over
        the ranks less their weight gradients), each further micro-batch adds one chunk's forward and input
        gradient behind it, and the last rank to finish runs its m weight gradients after its last input
        gradient: total - p W + (m - 1)(slowest - W)/v + m W, the second term. Played in torch's ZBV order
        (planner/pipeline_orders.py) on equal stages it is exact where T_F >= T_I, and (m - 1)(T_I - T_F) short
        where the input gradient is the longer; the steady term alone was 12% short at m = p and a third short at
        m = p/2 (tests/test_split_backward.py). It falls with W where it applies (m < 2p), as the steady term
        does, so a bound on the least rank's W bounds both."""
        if self.backward == "split" and p > 1:
            steady = m * slowest + (total - slowest) / v - 2 * (p - 1) / v * wgrad_s + 2 * (p * v - 1) * hop_s
            if self.placement == "v" and m < p * v:
                few = total - p * wgrad_s + (m - 1) / v * (slowest - wgrad_s) + m * wgrad_s + 2 * (p * v - 1) * hop_s
                return steady, few
            return (steady,)
        if self.virtual_stages and p > 1:
            return (m * slowest + (total - slowest) / v + 2 * (p * v - 1) * hop_s,)
        return ((m - 1) * slowest + total,)

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
            if self.stages_per_rank is not None and vpp != self.stages_per_rank:
                return "--vpp", f"{self.title} needs exactly --vpp {self.stages_per_rank} stages per rank"
        elif vpp != 1:
            return "--vpp", f"--vpp {vpp} needs a schedule with virtual stages ({one_of(virtual_names())})"
        if self.microbatches_multiple_of_pp and m is not None and pp > 1 and m % pp:
            return "--micro-batch", (f"{self.title} needs the micro-batches per step ({m}) to be a multiple of "
                                     f"pp ({pp})")
        return self._more_refusal(pp=pp, vpp=vpp, m=m)

    def _more_refusal(self, *, pp: int, vpp: int, m: int | None) -> tuple[str, str] | None:
        return None

    def compile_refusal(self, compile: bool) -> tuple[str, str] | None:
        """(flag, why) when the schedule cannot run compiled blocks (``Workload.compile``); None when it can."""
        if compile and not self.compiled_stages:
            return "--compile", (f"{self.title} splits the backward into input and weight gradients, which torch "
                                 "refuses for torch.compile'd stages (torch.distributed.pipelining "
                                 "_check_torch_compile_compatibility)")
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


@dataclass(frozen=True, kw_only=True)
class _SplitBackward(PipelineSchedule):
    """A schedule that runs the input gradient (I) and the weight gradient (W) as passes of their own."""

    min_microbatches_per_stage: int = 0   # the micro-batches per step it needs, per global stage (DualPipeV: 1)
    held: Callable[[int, int, int, int], int]
    # ^ (rank, pp, vpp, m) -> the most chunk-micro-batches the rank holds at once, read off the schedule's own order
    #   (planner.pipeline_orders.SCHEDULE_ORDERS): a chunk-micro-batch is held from its forward until its weight
    #   gradient (W, or a whole backward B) has run, since torch keeps the autograd graph of the input gradient
    #   (stage_backward_input: retain_graph=True) until stage_backward_weight, so until W the whole saved set counts
    #   (an upper bound: what its detach of the stage output frees is not counted). Closed forms of the orders,
    #   which tests/test_split_backward.py plays against them (``peak_held``)

    def _inflight(self, rank, pp, vpp, m):
        return self.held(rank, pp, vpp, m) / vpp

    def _more_refusal(self, *, pp, vpp, m):
        if self.min_microbatches_per_stage and m is not None and pp > 1 and m < pp * vpp:
            return "--micro-batch", (f"{self.title} needs at least as many micro-batches per step ({m}) as stages "
                                     f"({pp * vpp}) (torch.distributed.pipelining ScheduleDualPipeV)")
        return None


def peak_held(name: str, rank: int, pp: int, vpp: int, m: int) -> int:
    """The most chunk-micro-batches pipeline rank ``rank`` holds at once in schedule ``name``'s own order, played:
    each from its forward until its weight gradient (W) or whole backward (B) has run (what ``_SplitBackward.held``
    gives in closed form)."""
    from .pipeline_orders import schedule_order
    held = peak = 0
    for kind, _, _ in schedule_order(name, pp=pp, vpp=vpp, num_microbatches=m, rank=rank):
        held += 1 if kind == "F" else -1 if kind in "BW" else 0
        peak = max(peak, held)
    return peak


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

# Split-backward schedules of torch.distributed.pipelining (torch 2.13), which torchtitan runs by their class names
# ([parallelism] pipeline_parallel_schedule). Megatron-LM's mainline, DeepSpeed and Colossal-AI's export have none of
# them here: they run the ``nearest`` instead.
INTERLEAVED_ZB = _SplitBackward(
    name="interleaved-zb", title="interleaved zero bubble (ZB1P)",
    source="Qi et al., ICLR 2024, Sec 3 (ZB-H1); torch.distributed.pipelining ScheduleInterleavedZeroBubble",
    description="interleaved 1F1B with the weight gradients deferred into the bubble: same memory, less bubble",
    torch_name="InterleavedZeroBubble", megatron=None, deepspeed=None, colossalai=None, nearest="interleaved-1f1b",
    virtual_stages=True, overlaps_sends=True, microbatches_multiple_of_pp=True,   # torch: m a multiple of its
    backward="split", compiled_stages=False,                                     # rounds (max(1, m // pp))
    held=lambda rank, pp, vpp, m: pp * vpp)     # every chunk of the first round until its deferred W
ZBV = _SplitBackward(
    name="zbv", title="ZB-V",
    source="Qi et al., ICLR 2024, Sec 6 (ZB-V); torch.distributed.pipelining ScheduleZBVZeroBubble",
    description="zero bubble in a V: two stages per rank (r and 2pp-1-r), weight gradients fill the bubble",
    torch_name="ZBVZeroBubble", megatron=None, deepspeed=None, colossalai=None, nearest="interleaved-1f1b",
    virtual_stages=True, overlaps_sends=True, microbatches_multiple_of_pp=False, placement="v", stages_per_rank=2,
    backward="split", compiled_stages=False,
    # the V's warm-up: rank r holds m + 1 + r chunk-micro-batches, at most two per micro-batch and 2 pp in all
    held=lambda rank, pp, vpp, m: min(2 * m, m + 1 + rank, 2 * pp))
# The DualPipe README's table (github.com/deepseek-ai/DualPipe): DualPipeV's bubble (PP/2 - 1)(F&B + B - 3W),
# 2x parameters and PP + 1 activations per device are over PP stages on PP/2 devices, F, B, W per stage: here
# 2 pp stages on pp ranks, so two stages' parameters (the rank's share, as in any schedule: the V fold of torch's
# DualPipeV keeps no second copy) and 2 pp + 1 stage-micro-batches of activations at most
DUALPIPEV = _SplitBackward(
    name="dualpipev", title="DualPipeV",
    source="DeepSeek-V3 report (arXiv 2412.19437) Sec 3.2.1 and github.com/deepseek-ai/DualPipe; "
           "torch.distributed.pipelining ScheduleDualPipeV",
    description="DeepSeek's DualPipe folded into a V: forward and backward of two micro-batches paired",
    torch_name="DualPipeV", megatron=None, deepspeed=None, colossalai=None, nearest="interleaved-1f1b",
    virtual_stages=True, overlaps_sends=True, microbatches_multiple_of_pp=False, placement="v", stages_per_rank=2,
    backward="split", compiled_stages=False, min_microbatches_per_stage=1,
    held=lambda rank, pp, vpp, m: 2 * pp + 1)   # the README's PP + 1 over its PP stages: 2 pp + 1 here

SCHEDULES: dict[str, PipelineSchedule] = {s.name: s for s in (GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, INTERLEAVED_ZB,
                                                               ZBV, DUALPIPEV)}
NAMES: tuple[str, ...] = tuple(SCHEDULES)
DEFAULT = ONE_F_ONE_B.name          # the schedule of a plan without a pipeline, and of one without --vpp


def stage_of(placement: str, rank: int, chunk: int, pp: int) -> int:
    """The (global) stage that pipeline rank ``rank`` runs as its ``chunk``-th chunk under ``placement``
    (``PipelineSchedule.placement``)."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_chunk(placement: str, stage: int, pp: int) -> tuple[int, int]:
    """(pipeline rank, chunk on that rank) of global stage ``stage``; the inverse of ``stage_of``."""
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


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
