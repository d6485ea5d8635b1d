"""The stage ILP: block placement, per-block recompute and ZeRO/optimizer-offload for one group.

Write-up (all times per step, seconds; memory per GPU, bytes). Indices: virtual
stage j = 0..S-1 (S = p v), rank r = j mod p, recompute policy c, option k
(a ZeRO stage with or without optimizer offload).

Variables
    n[r,c] >= 0 integer   blocks of rank r that use recompute policy c (spread over its
                          v virtual stages: the cost model sums a rank's chunks)
    z[k] in {0,1}         the ZeRO/optimizer-offload option
    h[r,c] in {0,1}       rank r has a block with policy c (for its transient peak)
    T_max >= 0            the slowest rank's forward + backward per micro-batch
    y[r] >= 0             exposed pipeline sends of rank r (a schedule that overlaps its sends)
    x1,x2,x3[k,r] >= 0    exposed data-parallel terms of rank r under option k
    D >= 0, O >= 0        exposed data-parallel time, optimizer time

Rank quantities (linear in n): F[r] = sum n f + F_fixed, B[r] = sum n (b + rc_c) +
B_fixed, P[r] params, A[r] saved activations per micro-batch (on the device; policy "activation-offload" keeps
its blocks' on the host, counted in (g)).

Constraints
    (a) sum_{r,c} n[r,c] = L                               every block placed
    (b) sum_c n[r,c] >= v                                  every virtual stage holds a block
    (c) sum_k z[k] = 1                                     one ZeRO/optimizer-offload option
    (d) T_max >= F[r] + B[r] + sends[r]                    the slowest rank
    (e) y[r] >= 2 v hop - (F[r] + B[r])                    overlapped sends not hidden
    (f) P[r] s_k + A[r] inflight_r + E[r] + other_k <= cap + M (1 - z[k])     GPU memory (GiB)
    (g) nodes' offloaded optimizer and activations <= host memory + M (1 - z[k])
    (h) E[r] >= e_c h[r,c], n[j,c] <= L h[r,c]             transient of recomputed blocks
    (i) x1 >= per_micro - (F + B), x1 >= first layer's;   x2, x3 alike for the
        reduction after backward and the gather after the optimizer (overlap)
    (j) D >= exposed_k[r] - slack[r] - M (1 - z[k])        data-parallel time on the path
    (k) O >= optimizer_k(P[r]) - M (1 - z[k])              optimizer step
    (l) objective <= the best step time found so far       (optional cutoff)
    (m) T_max >= the least slowest rank of any integer split that fits    (a cut: implied by the rest)
    (n) W <= W_fixed[r] + w sum_c n[r,c]                   split-backward schedules: W, the least weight-
                                                           gradient time of any rank (cost.step.pipeline_s)
    (q) P >= each of the schedule's terms                  where it has more than one (a V with fewer
                                                           micro-batches than stages: pipeline_terms)

Objective: pipeline(T_max, sum of rank times) + D + O + tied-embedding sync (+ a
millionth of the summed rank times to break ties toward less work), where pipeline
is the schedule's own formula (planner/schedules.py ``PipelineSchedule.pipeline_s``:
(m - 1) T_max + sum_r (F + B + sends) for 1F1B and GPipe, m T_max + (sum_r (F + B + sends) - T_max)/v +
2 (p v - 1) hop for interleaved 1F1B, less 2 (p - 1)/v W for the split-backward ones, which the
objective's negative coefficient drives up to the least rank's), linear in all three; where the schedule's time is
the largest of several such terms (``PipelineSchedule.pipeline_terms``), P of (q). Every term is the cost model's
own (planner/cost/step.py), linear in the decisions, so the optimum here is the cost
model's optimum over this space, to within the search's optimality gap (result.py OPTIMALITY_GAP, 0.1%: the
solvers stop there, as the search's bounds prune there).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pulp

from ..errors import UserError
from .result import OPTIMALITY_GAP
from .stages import GroupProblem, Option, least_slowest_and_optimizer, least_slowest_rank, optimizer_frontier

SOLVERS = ("cbc", "highs")


def make_solver(name: str, time_limit_s: float):
    if name == "cbc":
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=OPTIMALITY_GAP)
    if name == "highs":
        try:
            import highspy  # noqa: F401
        except ImportError:
            raise UserError("HiGHS is not installed; pip install highspy, or use --solver cbc",
                            field="--solver") from None
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=OPTIMALITY_GAP)
    raise UserError(f"unknown solver {name!r}; allowed: cbc or highs", field="--solver")


def solve_group(problem: GroupProblem, solver: str = "cbc", time_limit_s: float = 20.0,
                cutoff_s: float | None = None):
    """(counts per virtual stage by policy, option, objective seconds, whether the solver proved it optimal), or
    None when nothing fits (or nothing beats ``cutoff_s``). A solver stopped by ``time_limit_s`` returns the
    solution it holds, unproven (PuLP reports HiGHS's kTimeLimit as LpStatusOptimal with the solution status
    LpSolutionIntegerFeasible: pulp/apis/highs_api.py), or (None, None, inf, False) where it holds none.

    Variables are per rank: the cost model is indifferent to how a rank spreads its
    blocks over its virtual stages (each gets at least one, the rest evenly)."""
    pr, cache = problem, problem.cache
    block, L, p, v, m = pr.block, pr.num_blocks, pr.p, pr.v, pr.m
    gib = 2.0**30                                      # memory rows in GiB: well-scaled coefficients
    cap, host_cap = cache.usable_bytes / gib, cache.cluster.job_host_memory_bytes / gib
    prob = pulp.LpProblem("stages", pulp.LpMinimize)
    n = {(r, c): pulp.LpVariable(f"n_{r}_{c}", 0, L, cat="Integer") for r in range(p) for c in pr.policies}
    z = {k: pulp.LpVariable(f"z_{k}", cat="Binary") for k in range(len(pr.options))}
    t_max = pulp.LpVariable("T_max", 0)
    D = pulp.LpVariable("D", 0)
    O = pulp.LpVariable("O", 0)
    rc = {c: block.policy(c).recompute_s for c in pr.policies}
    act = {c: block.policy(c).act_bytes / gib for c in pr.policies}
    transient = {c: block.policy(c).peak_extra_bytes / gib for c in pr.policies}
    host_act = {c: block.policy(c).host_bytes / gib for c in pr.policies}

    # each rank's blocks, an integer of its own (b: at least one per virtual stage): implied by the counts per policy,
    # but the solver branches on it first. The relaxation moves fractions of blocks between ranks (Qwen3-235B's 94
    # blocks over 32 stages: 1.0 on rank 0, 3.23 on ranks 28-30, where every integer split puts 3 on ranks 0-30);
    # branching on the policies' counts alone, HiGHS stopped at its 20 s on three 1F1B groups there, which it now
    # solves in 0.3-0.6 s
    blocks = [pulp.LpVariable(f"N_{r}", v, L, cat="Integer") for r in range(p)]
    prob += pulp.lpSum(n.values()) == L, "a_every_block_placed"
    for r in range(p):
        prob += blocks[r] == pulp.lpSum(n[r, c] for c in pr.policies), f"b_rank_{r}_blocks"
    prob += pulp.lpSum(z.values()) == 1, "c_one_zero_option"

    rank_time = []
    for r in range(p):
        nb = blocks[r]
        fixed = pr.fixed[r]
        F = block.fwd_s * nb + fixed.fwd_s
        B = pulp.lpSum((block.bwd_s + rc[c]) * n[r, c] for c in pr.policies) + fixed.bwd_s
        # (forward, backward) seconds of the rank's other inter-node traffic on the data-parallel NICs
        busy = tuple(pulp.lpSum(pr.block_busy_s(c)[i] * n[r, c] for c in pr.policies) + extra + pr.sends_busy_s
                     for i, extra in enumerate((fixed.busy_fwd_s, fixed.busy_bwd_s)))
        sends = 2 * v * pr.hop_s if p > 1 else 0.0
        if pr.sends_overlap:
            y = pulp.LpVariable(f"y_{r}", 0)
            prob += y >= sends - (F + B), f"e_rank_{r}_sends"
            sends = y
        rank_time.append(F + B + sends)
        prob += t_max >= rank_time[r], f"d_rank_{r}_slowest"
        # (h) the rank's transient peak: the largest of its layers' while they run backward. One binary per
        # distinct transient above the fixed layers' (policies with the same transient share it): h[r,e] = 1
        # when a block of the rank has a transient of at least e
        E = pulp.LpVariable(f"E_{r}", fixed.extra_bytes / gib)
        most_blocks = _most_blocks(pr, r, cap, act)
        levels = sorted({t for t in transient.values() if t > fixed.extra_bytes / gib})
        for i, level in enumerate(levels):
            h = pulp.LpVariable(f"h_{r}_{i}", cat="Binary")
            prob += pulp.lpSum(n[r, c] for c in pr.policies if transient[c] >= level) <= most_blocks * h, \
                f"h_rank_{r}_uses_transient_{i}"
            prob += E >= level * h, f"h_rank_{r}_transient_{i}"
        A = pulp.lpSum(act[c] * n[r, c] for c in pr.policies) + fixed.act_bytes / gib
        for k, opt in enumerate(pr.options):
            # big-M: the row's left-hand side at its largest (every block on this rank, the
            # largest activations and transient), so the row is slack when option k is not chosen
            states = (opt.block_state_bytes * nb + opt.fixed_state_bytes(fixed)) / gib
            most = ((opt.block_state_bytes * L + opt.fixed_state_bytes(fixed)) / gib
                    + pr.inflight[r] * (L * max(act.values()) + fixed.act_bytes / gib)
                    + max([fixed.extra_bytes / gib] + list(transient.values())) + opt.other_bytes / gib)
            prob += (states + pr.inflight[r] * A + E + opt.other_bytes / gib
                     <= cap + max(0.0, most - cap) * (1 - z[k])), f"f_rank_{r}_memory_{k}"
            if opt.host_bytes or any(host_act.values()):
                # the node's GPUs alike: offloaded optimizer states and offloaded activations in flight
                per_node = cache.cluster.gpus_on_a_node
                H = per_node * ((opt.block_host_bytes * nb + opt.fixed_host_bytes(fixed)) / gib
                                + pr.inflight[r] * pulp.lpSum(host_act[c] * n[r, c] for c in pr.policies if host_act[c]))
                total_host = opt.block_host_bytes * L + sum(opt.fixed_host_bytes(f) for f in pr.fixed)
                most = per_node * (total_host / gib + pr.inflight[r] * L * max(host_act.values()))
                prob += H <= host_cap + max(0.0, most - host_cap) * (1 - z[k]), f"g_rank_{r}_host_{k}"
            _data_parallel(prob, pr, opt, k, r, nb, F, B, D, z[k], busy)
            most_opt = opt.block_optimizer_s * L + opt.optimizer_s_per_param * fixed.params
            prob += O >= opt.block_optimizer_s * nb + opt.optimizer_s_per_param * fixed.params \
                - most_opt * (1 - z[k]), f"k_rank_{r}_optimizer_{k}"

    # (m) a cut implied by (a)-(h): the slowest rank is at least as slow as in the best integer split when
    # each rank recomputes as little as its memory allows (``stages.least_slowest_rank``). The LP relaxation
    # spreads fractions of blocks and of recompute evenly over the ranks; this lifts its bound to the
    # integer balance, which the branch and bound otherwise proves rank by rank
    least = min(least_slowest_rank(pr, opt) for opt in pr.options)
    if least == math.inf:
        return None                                     # no split fits even with the most frugal policies
    prob += t_max >= least, "m_least_slowest_rank"
    # (p) the same with the slowest rank's optimizer step (row (k)), on the pipeline's term in T_max:
    # ``stages.least_slowest_and_optimizer``. Fewer blocks on the ranks holding the embedding or the head lower O
    # and raise T_max; the relaxation settles it with fractions of blocks (Qwen3-235B on 256 H100: four groups of
    # 1.0-1.5 s each now pruned or solved at once). Only where the two pull apart (a frontier of more than one
    # point): elsewhere the row added little and slowed HiGHS, one group of Llama 3 405B on 16,384 H100 from 0.09
    # to 1.3 s
    if any(len(optimizer_frontier(pr, opt)) > 1 for opt in pr.options):
        a = (pr.schedule.pipeline_terms(slowest=1.0, total=0.0, m=m, p=p, v=v)[0]
             - pr.schedule.pipeline_terms(slowest=0.0, total=0.0, m=m, p=p, v=v)[0])
        joint = min(least_slowest_and_optimizer(pr, opt, a) for opt in pr.options)
        prob += a * t_max + O >= joint, "p_least_slowest_with_its_optimizer"
    wgrad = 0.0
    if pr.split_backward:
        wgrad = pulp.LpVariable("W", 0)
        for r in range(p):
            prob += wgrad <= pr.fixed[r].wgrad_s + block.wgrad_s * blocks[r], f"n_rank_{r}_weight_gradients"
        # (o) a cut implied by (a), (b) and (n): the least rank's weight gradients in the best integer split for them
        # (``stages.most_least_wgrad``); the relaxation's W reaches the mean over the ranks, and the branch and
        # bound otherwise proves the integer balance rank by rank (Qwen3-235B on 256 B200, ZB-V over 32 stages:
        # 1.7 s to rule a group out against the best so far)
        prob += wgrad <= pr.wgrad_bound, "o_most_least_weight_gradients"
    terms = pr.schedule.pipeline_terms(slowest=t_max, total=pulp.lpSum(rank_time), m=m, p=p, v=v,
                                       hop_s=pr.hop_s if pr.sends_overlap else 0.0, wgrad_s=wgrad)
    if len(terms) == 1:
        pipeline = terms[0]
    else:       # the largest of the schedule's terms (a V with fewer micro-batches than stages)
        pipeline = pulp.LpVariable("P", 0)
        for j, term in enumerate(terms):
            prob += pipeline >= term, f"q_pipeline_term_{j}"
    # tie-break (a millionth of the work of every rank): among plans the closed form prices
    # the same (only the slowest rank counts in the interleaved schedule), no useless recompute
    objective = pipeline + D + O + pr.tied_s + 1e-6 * pulp.lpSum(rank_time)
    # state the objective in units of a rough step time so that its coefficients sit far
    # above the solver's tolerances whatever the model's size (milliseconds to minutes)
    unit = max(1e-12, m * (L * (block.fwd_s + block.bwd_s) + sum(f.fwd_s + f.bwd_s for f in pr.fixed)) / p)
    prob += objective * (1.0 / unit)
    if cutoff_s is not None:
        prob += objective * (1.0 / unit) <= cutoff_s / unit, "l_beats_the_best_so_far"
    status = prob.solve(make_solver(solver, time_limit_s))
    if pulp.LpStatus[status] == "Not Solved":       # stopped before it found any solution
        return None, None, math.inf, False
    if pulp.LpStatus[status] != "Optimal":
        return None
    per_rank = [{c: int(round(n[r, c].value() or 0)) for c in pr.policies} for r in range(p)]
    chosen = max(z, key=lambda k: z[k].value() or 0)
    proven = prob.sol_status == pulp.LpSolutionOptimal
    return pr.spread_counts(per_rank), pr.options[chosen], pulp.value(prob.objective) * unit, proven


def _most_blocks(pr: GroupProblem, r: int, cap_gib: float, act_gib: dict[str, float]) -> int:
    """The most blocks rank r can hold: the others hold at least v each (b), and its memory (f) fits
    no more with the least activations any policy keeps under the most frugal option."""
    gib = 2.0**30
    fixed, inflight = pr.fixed[r], pr.inflight[r]
    fit = 0.0
    for opt in pr.options:
        base = (opt.other_bytes + opt.fixed_state_bytes(fixed) + fixed.extra_bytes) / gib + inflight * fixed.act_bytes / gib
        per_block = opt.block_state_bytes / gib + inflight * min(act_gib.values())
        fit = max(fit, (cap_gib - base) / per_block if per_block > 0 else math.inf)
    most = pr.num_blocks - (pr.p - 1) * pr.v
    return most if fit >= most else max(0, math.floor(fit + 1e-9))


def _data_parallel(prob, pr: GroupProblem, opt: Option, k: int, r: int, nb, F, B, D, z, busy=(0.0, 0.0)) -> None:
    """(i)-(j): the rank's exposed data-parallel time under option k, as the cost model
    prices it (planner/cost/step.py::_dp_comm_uncached), layer by layer; ``busy``: (forward, backward) seconds in
    which other inter-node traffic holds the NICs (cost.step.network_busy_s), out of the windows that hide it."""
    if not pr.has_dp:
        return
    blk = pr.block_collectives(opt)
    fixed = [pr.collectives(opt, bucket) for bucket in pr.fixed[r].buckets]
    totals = [blk[i] * nb + sum(f[i] for f in fixed) for i in range(3)]    # per micro, once, after
    m = pr.m
    cache = pr.cache
    first = pr.collectives(opt, pr.first_layer_params(r))
    kappa = cache.cluster.comm_sm_fraction
    # big-M: the exposure at its largest (every block on this rank, nothing to hide behind)
    L = pr.num_blocks
    big = sum(w * ((blk[i] * L + sum(f[i] for f in fixed)) * (1 + kappa) + first[i])
              for i, w in enumerate((m, 1, 1)))
    overlap, once_overlaps = pr.dp_overlaps(opt)
    if not overlap:
        exposed = m * totals[0] + totals[1] + totals[2]
    else:
        # (comm, window, last, weight) of each term as cost.step._dp_comm_uncached prices it: each micro-batch's
        # forward collectives and backward ones beside their pass, the reduction once, the gather after the optimizer
        blk_p = pr.block_passes(opt)
        fixed_p = [pr.passes(opt, bucket) for bucket in pr.fixed[r].buckets]
        first_p = pr.passes(opt, pr.first_layer_params(r))
        terms = []
        for i, window in enumerate((F - busy[0], B - busy[1])):
            if blk_p[i] or any(f[i] for f in fixed_p):
                terms.append((f"m{i}", blk_p[i] * nb + sum(f[i] for f in fixed_p), window, first_p[i], m))
        exposed = 0
        for i, window in ((1, B - busy[1]), (2, F - busy[0])):
            if blk[i] == 0 and all(f[i] == 0 for f in fixed):
                continue
            if (i == 2 and not pr.param_gather_overlaps) or (i == 1 and not once_overlaps):
                exposed += totals[i]        # the step's all-gather ends the optimizer step; the reduction
                continue                    # runs after the last backward (cost.step.dp_overlaps)
            terms.append((str(i), totals[i], window, first[i], 1))
        for name, comm, window, last, weight in terms:      # cost.step.exposed_s, a maximum of two lines
            x = pulp.LpVariable(f"x{name}_{k}_{r}", 0)
            prob += x >= comm - window, f"i_rank_{r}_opt_{k}_term_{name}_exceeds_window"
            prob += x >= last + kappa * comm, f"i_rank_{r}_opt_{k}_term_{name}_last_and_contention"
            exposed += weight * x
    slack = r * B if pr.p > 1 else 0
    prob += D >= exposed - slack - big * (1 - z), f"j_rank_{r}_data_parallel_{k}"
