"""The event order of each pipeline schedule of planner/schedules.py, per rank: plain functions of
(pp, vpp, micro-batches, rank), one per record, importing nothing of the cost model. The simulation
(planner/simulate.py) plays them; the split-backward records read their memory in flight off them.
"""
from __future__ import annotations


# -- the orders --------------------------------------------------------------------------------

def _all_forwards_first(*, pp: int, vpp: int, num_microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """GPipe: every forward, then every backward (Huang et al. 2019; torch.distributed.pipelining's GPipe)."""
    m = num_microbatches
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def _one_forward_one_backward(*, pp: int, vpp: int, num_microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """1F1B: ``pp - rank - 1`` warm-up forwards, then one forward one backward, then the cool-down
    backwards (Narayanan et al. 2021, Sec 2.2.1; Megatron-LM forward_backward_pipelining_without_interleaving).
    Without a pipeline: gradient accumulation, F B F B ..."""
    m = num_microbatches
    warmup = min(pp - rank - 1, m)
    out = [("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        out += [("F", warmup + i, 0), ("B", i, 0)]
    return out + [("B", i, 0) for i in range(m - warmup, m)]


def _interleaved(*, pp: int, vpp: int, num_microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B as Megatron-LM's forward_backward_pipelining_with_interleaving runs it: a warm-up of
    ``2 (p - rank - 1) + (v - 1) p`` chunk passes (all of them when m == p), chunk of the k-th pass
    ``(k mod pv) // p`` (reversed for backward), micro-batch ``(k // pv) p + k mod p``."""
    m = num_microbatches
    total, group = m * vpp, pp * vpp

    def op(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k % group) // pp
        return kind, (k // group) * pp + k % pp, chunk if kind == "F" else vpp - 1 - chunk

    warmup = total if m == pp else min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
    out = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [op("F", warmup + k), op("B", k)]
    return out + [op("B", k) for k in range(total - warmup, total)]


def _interleaved_zero_bubble(*, pp: int, vpp: int, num_microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """ZB1P over ``vpp`` chunks as torch.distributed.pipelining's ScheduleInterleavedZeroBubble orders it
    (schedules.py ``_get_1f1b_rank_ops`` with enable_zero_bubble; Qi et al., ICLR 2024, Sec 3, ZB-H1): a warm-up
    of ``(v - 1) r + (p - 1 - rank)`` forwards (r micro-batches per round, ``_get_warmup_ops`` with factor 1),
    then F, I pairs, each followed, once the rank's first ``rank`` backwards are past, by the weight gradient of
    the oldest backward; the cool-down's I each with a W, then the W left. Chunk of the k-th forward
    ``(k // r) mod v``, of the k-th backward ``v - 1 - ((k - warm-up) // r) mod v``."""
    m, v, p = num_microbatches, vpp, pp
    rounds = max(1, m // p)
    per_round = m // rounds
    total = v * m
    warmup = min((v - 1) * per_round + (p - 1 - rank), total)
    fwd_chunk = lambda k: (k // per_round) % v                          # noqa: E731
    bwd_chunk = lambda k: v - 1 - ((k - warmup) // per_round) % v       # noqa: E731
    count = {("F", c): 0 for c in range(v)} | {("I", c): 0 for c in range(v)} | {("W", c): 0 for c in range(v)}
    out: list[tuple[str, int, int]] = []

    def add(kind: str, chunk: int) -> None:
        out.append((kind, count[kind, chunk], chunk))
        count[kind, chunk] += 1

    backwards: list[int] = []
    weights = 0
    for k in range(total + warmup):
        if k < warmup:
            add("F", fwd_chunk(k))
            continue
        if k < total:
            add("F", fwd_chunk(k))
        add("I", bwd_chunk(k))
        backwards.append(k)
        if k - warmup >= rank:
            add("W", bwd_chunk(backwards[weights]))
            weights += 1
    while weights < len(backwards):
        add("W", bwd_chunk(backwards[weights]))
        weights += 1
    return out


def _zbv(*, pp: int, vpp: int, num_microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """ZB-V as torch.distributed.pipelining's ScheduleZBVZeroBubble orders it (Qi et al., ICLR 2024, Sec 6): two
    chunks per rank in a V (chunk 0 is stage ``rank``, chunk 1 stage ``2p - 1 - rank``); warm-up of
    ``2 (p - rank) - 1`` chunk-0 forwards, ``rank`` (F1, F0) pairs, ``p - rank`` (F1, I1, W1); then the steady
    (F0, I0, W0, F1, I1, W1); cool-down ``rank`` (I0, I1), ``p - rank`` (I0, W0), the W left. torch plans
    ``max(2p - 1, m)`` micro-batches and drops the passes of those past m."""
    p, m = pp, num_microbatches
    n = max(2 * p - 1, m)
    out: list[tuple[str, int, int]] = []
    cnt = {"F0": 0, "F1": 0, "I0": 0, "I1": 0, "W0": 0, "W1": 0}

    def add(kind: str, chunk: int) -> None:
        key = f"{kind}{chunk}"
        out.append((kind, cnt[key], chunk))
        cnt[key] += 1

    for _ in range(2 * (p - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1), add("F", 0)
    for _ in range(p - rank):
        add("F", 1), add("I", 1), add("W", 1)
    while cnt["F1"] < cnt["F0"] or cnt["F0"] < n:
        if cnt["F0"] < n:
            add("F", 0)
        add("I", 0), add("W", 0), add("F", 1), add("I", 1), add("W", 1)
    for _ in range(rank):
        add("I", 0), add("I", 1)
    for _ in range(p - rank):
        add("I", 0), add("W", 0)
    while cnt["W1"] < cnt["I1"]:
        add("W", 1)
    while cnt["W0"] < cnt["I0"]:
        add("W", 0)
    return [a for a in out if a[1] < m]


def _dualpipev(*, pp: int, vpp: int, num_microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """DualPipeV as torch.distributed.pipelining's ScheduleDualPipeV orders it (DeepSeek's DualPipe folded into a V,
    github.com/deepseek-ai/DualPipe; chunk 0 is stage ``rank``, chunk 1 stage ``2p - 1 - rank``), steps 1 to 8 of
    its ``_calculate_single_rank_operations``. Its overlapped forward + backward pairs (OVERLAP_F_B) run here as the
    forward then the whole backward, one after the other, as torch's runtime runs their sub-actions unless a custom
    function is registered for them; a whole backward (B) counts as the input and weight gradient both."""
    p, m = pp, num_microbatches
    out: list[tuple[str, int, int]] = []
    cnt: dict[tuple[str, int], int] = {}
    pending: list[tuple[int, int]] = []          # (chunk, micro-batch) of input gradients whose W is not run yet

    def add(kind: str, chunk: int) -> None:
        key = (kind if kind != "B" else "I", chunk)
        mb = cnt.get(key, 0)
        out.append((kind, mb, chunk))
        cnt[key] = mb + 1
        if kind == "I":
            pending.append((chunk, mb))

    def weight() -> None:
        if pending:
            chunk, mb = pending.pop(0)
            out.append(("W", mb, chunk))

    for _ in range((p - rank - 1) * 2):                      # 1: F0
        add("F", 0)
    for _ in range(rank + 1):                                # 2: F0 F1
        add("F", 0), add("F", 1)
    for _ in range(p - rank - 1):                            # 3: I1 W1 F1
        add("I", 1), weight(), add("F", 1)
    for i in range(m - 2 * p + rank + 1):                    # 4: F0 B1, F1 B0 (overlapped pairs)
        add("F", 0), add("B", 1)
        add("F", 1), add("B", 0)
    for _ in range(p - rank - 1):                            # 5: B1, F1 B0
        add("B", 1), add("F", 1), add("B", 0)
    split = False
    for i in range(rank + 1):                                # 6: B1 B0, the second half split
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        add("I" if split else "B", 1)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        add("I" if split else "B", 0)
    for _ in range(p - rank - 1):                            # 7: W0 B0
        weight(), add("I" if split else "B", 0)
    for _ in range(rank + 1):                                # 8: W0
        weight()
    return out


# The event order of each schedule of planner/schedules.py (a test checks that every record has one).
SCHEDULE_ORDERS = {"gpipe": _all_forwards_first, "1f1b": _one_forward_one_backward,
                   "interleaved-1f1b": _interleaved, "interleaved-zb": _interleaved_zero_bubble, "zbv": _zbv,
                   "dualpipev": _dualpipev}


def schedule_order(schedule: str, *, pp: int, vpp: int, num_microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """The passes one rank runs, in order: (kind, micro-batch, chunk), kind "F" forward, "B" whole backward, "I"
    input gradient, "W" weight gradient. Without a pipeline every
    schedule is gradient accumulation (1F1B's order with one rank)."""
    order = SCHEDULE_ORDERS[schedule] if pp > 1 else _one_forward_one_backward
    return order(pp=pp, vpp=vpp, num_microbatches=num_microbatches, rank=rank)
