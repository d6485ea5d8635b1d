"""The event simulation of one step: schedules, hand-computed timelines, the public cases."""
from dataclasses import replace

import pytest

from planner.cluster import load_cluster
from planner.config import ParallelConfig, Workload
from planner.cost.step import (CostCache, _optimizer_s, dp_collectives, dp_phases, estimate, play_config_pipeline,
                                rank_costs, rank_pipeline_s)
from planner.layers import build_layer_graph
from planner.model import ZOO, ModelSpec
from planner.search import search
from planner.search.space import Knobs
from planner.simulate import LayerWork, StepWork, schedule_order, simulate, simulate_work, step_time


def one_layer_stages(f, b, *, schedule="1f1b", m=4, hop=0.0, vpp=1, **kw) -> StepWork:
    """Stage r holds one layer of forward f[r] and backward b[r] (per chunk with vpp > 1)."""
    chunks = tuple(tuple((LayerWork(fwd_s=f[r], bwd_s=b[r]),) for _ in range(vpp)) for r in range(len(f)))
    return StepWork(schedule=schedule, num_microbatches=m, chunks=chunks, hop_s=hop,
                    blocking_sends=schedule != "interleaved-1f1b", **kw)


def compute_events(timeline, device):
    return [(e.kind[0].upper(), e.microbatch, e.start_s, e.end_s) for e in timeline.on(device, "compute")]


# -- the orders the runtimes use --------------------------------------------------------------------

def test_1f1b_order_is_warmup_steady_cooldown():
    order = schedule_order("1f1b", pp=4, vpp=1, num_microbatches=6, rank=0)
    assert [f"{k}{mb}" for k, mb, _ in order] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    last = schedule_order("1f1b", pp=4, vpp=1, num_microbatches=6, rank=3)
    assert [f"{k}{mb}" for k, mb, _ in last] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()


def test_interleaved_order_is_megatrons():
    # Megatron-LM forward_backward_pipelining_with_interleaving, p = 2, v = 2, m = 4, rank 0:
    # warm-up 2 (p - 1) + (v - 1) p = 4 chunk passes; pass k runs chunk (k mod 4) // 2
    # (reversed for backward) of micro-batch (k // 4) * 2 + k mod 2; worked out by hand
    order = schedule_order("interleaved-1f1b", pp=2, vpp=2, num_microbatches=4, rank=0)
    assert [f"{k}{mb}.{c}" for k, mb, c in order] == (
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0").split()


@pytest.mark.parametrize("schedule,vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3)])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_every_pass_runs_once(schedule, vpp, rank):
    order = schedule_order(schedule, pp=3, vpp=vpp, num_microbatches=6, rank=rank)
    assert sorted(order) == sorted((k, mb, c) for k in "FB" for mb in range(6) for c in range(vpp))


# -- equal stages: the closed forms hold --------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_equal_stages_bubble_is_p_minus_1(schedule):
    # (m + p - 1)(f + b): Narayanan et al. 2021, Sec 2.2
    t = simulate_work(one_layer_stages([1.0] * 4, [2.0] * 4, schedule=schedule, m=8))
    assert t.step_time_s == pytest.approx((8 + 4 - 1) * 3.0)
    assert t.breakdown.bubble == pytest.approx(3 * 3.0)


def test_interleaved_equal_stages_bubble_shrinks_by_v():
    # (m + (p - 1) / v)(f + b) with f, b per rank: ibid. Sec 2.2.2; each chunk is 1/v of it
    t = simulate_work(one_layer_stages([0.5] * 4, [1.0] * 4, schedule="interleaved-1f1b", m=8, vpp=2))
    assert t.step_time_s == pytest.approx((8 + 3 / 2) * 3.0)


# -- unequal stages: hand-computed schedules -----------------------------------------------------------

def test_unequal_1f1b_against_a_hand_computed_schedule():
    # p = 3, m = 4, middle stage twice as slow: f = 1, 2, 1; b = 2, 4, 2; no transfer time.
    # Worked out pass by pass on paper (each pass starts when its rank is free and its input is in):
    t = simulate_work(one_layer_stages([1.0, 2.0, 1.0], [2.0, 4.0, 2.0], m=4))
    assert compute_events(t, 0) == [("F", 0, 0, 1), ("F", 1, 1, 2), ("F", 2, 2, 3), ("B", 0, 10, 12),
                                    ("F", 3, 12, 13), ("B", 1, 16, 18), ("B", 2, 22, 24), ("B", 3, 26, 28)]
    assert compute_events(t, 1) == [("F", 0, 1, 3), ("F", 1, 3, 5), ("B", 0, 6, 10), ("F", 2, 10, 12),
                                    ("B", 1, 12, 16), ("F", 3, 16, 18), ("B", 2, 18, 22), ("B", 3, 22, 26)]
    assert compute_events(t, 2) == [("F", 0, 3, 4), ("B", 0, 4, 6), ("F", 1, 6, 7), ("B", 1, 7, 9),
                                    ("F", 2, 12, 13), ("B", 2, 13, 15), ("F", 3, 18, 19), ("B", 3, 19, 21)]
    assert t.step_time_s == 28
    # the closed form, (m - 1) * slowest + sum = 3 * 6 + 12 = 30, charges the last stage's
    # work that the warm-up hides
    assert t.breakdown.bubble == 28 - 4 * 3       # rank 0 computes 4 x (1 + 2)


def test_blocking_sends_against_a_hand_computed_schedule():
    # p = 2, m = 2, f = 1, b = 2, transfer 0.5. 1F1B: the sender waits for its send.
    t = simulate_work(one_layer_stages([1.0, 1.0], [2.0, 2.0], m=2, hop=0.5))
    assert compute_events(t, 0) == [("F", 0, 0, 1), ("F", 1, 1.5, 2.5), ("B", 0, 5, 7), ("B", 1, 8.5, 10.5)]
    assert compute_events(t, 1) == [("F", 0, 1.5, 2.5), ("B", 0, 2.5, 4.5), ("F", 1, 5, 6), ("B", 1, 6, 8)]
    assert t.step_time_s == 10.5
    assert [(e.start_s, e.end_s) for e in t.on(1, "send-prev")] == [(4.5, 5), (8, 8.5)]
    # posted asynchronously (interleaved's overlap_p2p_comm), rank 1's F1 starts at 4.5 instead
    free = simulate_work(replace(one_layer_stages([1.0, 1.0], [2.0, 2.0], m=2, hop=0.5), blocking_sends=False))
    assert free.step_time_s == 10.0


def test_data_parallel_tail_against_a_hand_computed_schedule():
    # one rank, two layers (f 1, b 2 each), m = 2; each layer's gradient reduction takes
    # 1.5 s, issued when its last backward ends. Backward of micro-batch 1: layer 1 runs
    # [8, 10], its reduction [10, 11.5]; layer 0 runs [10, 12], its reduction [12, 13.5].
    layers = (LayerWork(fwd_s=1, bwd_s=2, reduce_s=1.5), LayerWork(fwd_s=1, bwd_s=2, reduce_s=1.5))
    work = StepWork(schedule="1f1b", num_microbatches=2, chunks=((layers,),))
    t = simulate_work(work)
    assert [(e.start_s, e.end_s) for e in t.on(0, "dp")] == [(10, 11.5), (12, 13.5)]
    assert t.step_time_s == 13.5 and t.breakdown.dp_comm == 1.5
    # without overlap both run after the backward: 12 + 3
    assert simulate_work(replace(work, overlap_dp=False)).step_time_s == 15
    # layer 0's backward shares the SMs with layer 1's reduction for 1.5 s: 10% of that longer
    slowed = simulate_work(replace(work, contention=0.1))
    assert slowed.step_time_s == pytest.approx(12.15 + 1.5)


def test_traffic_on_the_data_parallel_nics_delays_the_collective_running_beside_it():
    """As the hand schedule above, but layer 0's backward sends 1 s of other inter-node traffic (an expert
    all-to-all) over the NICs the reductions use: layer 1's reduction, running [10, 11.5] beside it, waits that
    second, [10, 12.5]; layer 0's reduction queues behind it, [12.5, 14]. A delay is never more than what the
    collective had left: 2 s of traffic holds it 1.5 s, [10, 13], then [13, 14.5]."""
    layers = (LayerWork(fwd_s=1, bwd_s=2, reduce_s=1.5, busy_bwd_s=1.0), LayerWork(fwd_s=1, bwd_s=2, reduce_s=1.5))
    t = simulate_work(StepWork(schedule="1f1b", num_microbatches=2, chunks=((layers,),)))
    assert [(e.start_s, e.end_s) for e in t.on(0, "dp")] == [(10, 12.5), (12.5, 14)]
    assert t.step_time_s == 14
    layers = (replace(layers[0], busy_bwd_s=2.0), layers[1])
    t = simulate_work(StepWork(schedule="1f1b", num_microbatches=2, chunks=((layers,),)))
    assert [(e.start_s, e.end_s) for e in t.on(0, "dp")] == [(10, 13), (13, 14.5)]


def test_zero3_gathers_prefetch_one_layer_ahead():
    # one rank, two layers (f 1, b 2), gathers of 0.5 s before every forward and backward
    # (ZeRO-3), reductions 0.5 s, m = 1. Forward: gather 0 [0, .5] exposed, gather 1
    # [.5, 1] hidden under layer 0 [.5, 1.5]; layer 1 [1.5, 2.5]. Backward: gather 1
    # [2.5, 3] exposed, gather 0 [3, 3.5]; layer 1 [3, 5], its reduction [5, 5.5]; layer 0
    # [5, 7], its reduction [7, 7.5].
    layer = LayerWork(fwd_s=1, bwd_s=2, gather_fwd_s=0.5, gather_bwd_s=0.5, reduce_s=0.5)
    work = StepWork(schedule="1f1b", num_microbatches=1, chunks=(((layer, layer),),), gather_every_microbatch=True,
                    reduce_every_microbatch=True)
    t = simulate_work(work)
    assert [(e.start_s, e.end_s) for e in t.on(0, "dp")] == [(0, .5), (.5, 1), (2.5, 3), (3, 3.5), (5, 5.5),
                                                            (7, 7.5)]
    assert t.step_time_s == 7.5


# -- the cost model's plans -------------------------------------------------------------------------------

SMALL = ModelSpec(name="small", num_layers=16, hidden=2048, num_heads=16, num_kv_heads=16, head_dim=128,
                  ffn_hidden=5632, vocab_size=32000, seq_len=2048, max_positions=0, mlp="swiglu", norm="rmsnorm",
                  linear_bias=False, qkv_bias=False, tied_embeddings=False, dropout=False)


def test_unequal_stages_simulation_is_the_hand_schedule_not_the_closed_form():
    # Stage 0 holds the embedding and 15 blocks, stage 1 one block and the head: the
    # first stage is the bottleneck. Worked out by hand for p = 2, 1F1B, blocking sends
    # of h: rank 0 never waits once running (its backward b0 outlasts rank 1's whole
    # f1 + b1 + h), so the step is m (f0 + b0 + h) plus the optimizer; the closed form
    # (m - 1) T0 + T0 + T1 adds rank 1's work, which in fact hides behind rank 0's.
    graph = build_layer_graph(SMALL)
    cluster = load_cluster("h100-80g", 2)
    work = Workload(global_batch=8, seq_len=2048)
    config = ParallelConfig(dp=1, tp=1, pp=2, micro_batch=1, num_microbatches=8, schedule="1f1b",
                            stage_layers=(16, 3))
    cache = CostCache(graph, cluster, work)
    r0, r1 = rank_costs(cache, config)
    h = cache.hop_s(config)
    assert r0.bwd_s >= r1.fwd_s + r1.bwd_s + h and r0.fwd_s >= r1.fwd_s + r1.bwd_s    # the premises
    optimizer = max(_optimizer_s(cache, config, r)[0] for r in (r0, r1))
    hand = 8 * (r0.fwd_s + r0.bwd_s + h) + optimizer
    assert simulate(graph, cluster, work, config, cache).step_time_s == pytest.approx(hand, rel=1e-9)
    closed = estimate(graph, cluster, work, config, cache).step_time_s
    assert closed == pytest.approx(hand + r1.fwd_s + r1.bwd_s + 10 * h, rel=1e-9)


def test_dp_phases_are_the_cost_models_collectives():
    graph = build_layer_graph(ZOO["llama3-8b"])
    cluster = load_cluster("h100-80g", 64)
    for framework in ("torch", "megatron", "deepspeed"):
        cache = CostCache(graph, cluster, Workload(global_batch=64, seq_len=4096, framework=framework))
        for zero in (0, 1, 2, 3):
            config = ParallelConfig(dp=16, tp=4, pp=1, zero=zero, num_microbatches=4)
            g_f, g_b, red = dp_phases(cache, config, 2e8)
            per_micro, once, after = dp_collectives(cache, config, 2e8)
            every = zero == 3 or (zero == 2 and framework == "torch")
            assert per_micro + once + after == pytest.approx(g_f + g_b + red, rel=1e-12)
            assert per_micro == pytest.approx((g_f + g_b if every else 0) + (red if zero >= 2 else 0), rel=1e-12)


PLANS = [  # (model, cluster, gpus, config, workload extras)
    ("llama3-8b", "h100-80g", 8, dict(dp=8, tp=1, pp=1, zero=3, num_microbatches=8), {}),
    ("llama3-8b", "h100-80g", 16, dict(dp=4, tp=2, pp=2, zero=1, num_microbatches=16, schedule="interleaved-1f1b",
                                       vpp=2, recompute="selective", sequence_parallel=True), {}),
    ("llama3-70b", "h100-80g", 64, dict(dp=2, tp=8, pp=4, zero=1, num_microbatches=32, optimizer_offload=True,
                                        recompute="full"), {"overlap_grad_reduce": False}),
    ("gpt-1.7b", "a100-80g", 16, dict(dp=4, tp=1, pp=4, zero=0, num_microbatches=16, schedule="gpipe",
                                      stage_layers=(9, 6, 6, 6)), {"framework": "megatron"}),
]


@pytest.mark.parametrize("model,cluster_name,gpus,knobs,extra", PLANS)
def test_breakdown_adds_up_and_events_do_not_overlap(model, cluster_name, gpus, knobs, extra):
    graph = build_layer_graph(ZOO[model])
    cluster = load_cluster(cluster_name, gpus)
    config = ParallelConfig(micro_batch=1, **knobs)
    work = Workload(global_batch=config.dp * config.num_microbatches, seq_len=2048, **extra)
    t = simulate(graph, cluster, work, config)
    assert t.breakdown.total == pytest.approx(t.step_time_s, rel=1e-9)
    assert max(e.end_s for e in t.events) == pytest.approx(t.step_time_s, rel=1e-9)
    for device in range(config.pp):
        for stream in ("compute", "dp", "send-next", "send-prev"):
            spans = sorted((e.start_s, e.end_s) for e in t.on(device, stream))
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:])), (device, stream)
    passes = [e for e in t.events if e.kind in ("forward", "backward")]
    assert len(passes) == 2 * config.num_microbatches * config.pp * config.vpp


# -- the public validation cases ----------------------------------------------------------------------
# Narayanan et al., SC'21, Table 1 (NAR21) and the Megatron-Core README's H100 table (MLM24), as
# ../shared/validation/public_cases.json records them: layers, hidden, heads, vocabulary, sequence,
# GPUs, tp, pp, dp, global batch; micro-batch and virtual stages are not published: these are the
# ones `python benchmarks/simulation_vs_estimate.py` finds (the analytical search's choice).
CASES = [  # id, layers, hidden, heads, vocab, seq, tp, pp, dp, global batch, micro-batch, vpp
    ("NAR21-T1-1.7B", 24, 2304, 24, 51200, 2048, 1, 1, 32, 512, 16, 1),
    ("NAR21-T1-3.6B", 30, 3072, 32, 51200, 2048, 2, 1, 32, 512, 16, 1),
    ("NAR21-T1-7.5B", 36, 4096, 32, 51200, 2048, 4, 1, 32, 512, 16, 1),
    ("NAR21-T1-18.4B", 40, 6144, 48, 51200, 2048, 8, 1, 32, 1024, 16, 1),
    ("NAR21-T1-39.1B", 48, 8192, 64, 51200, 2048, 8, 2, 32, 1536, 4, 1),
    ("NAR21-T1-76.1B", 60, 10240, 80, 51200, 2048, 8, 4, 32, 1792, 2, 5),
    ("NAR21-T1-145.6B", 80, 12288, 96, 51200, 2048, 8, 8, 24, 2304, 2, 10),
    ("NAR21-T1-310.1B", 96, 16384, 128, 51200, 2048, 8, 16, 15, 2160, 1, 6),
    ("NAR21-T1-529.6B", 105, 20480, 128, 51200, 2048, 8, 35, 9, 2520, 1, 3),
    ("NAR21-T1-1008.0B", 128, 25600, 160, 51200, 2048, 8, 64, 6, 3072, 1, 2),
    ("MLM24-H100-1.7B", 24, 2048, 16, 131072, 4096, 1, 1, 48, 192, 4, 1),
    ("MLM24-H100-7.1B", 30, 4096, 32, 131072, 4096, 2, 1, 48, 192, 4, 1),
    ("MLM24-H100-16B", 32, 6144, 48, 131072, 4096, 4, 1, 48, 192, 4, 1),
    ("MLM24-H100-32B", 48, 7168, 56, 131072, 4096, 8, 1, 48, 192, 4, 1),
    ("MLM24-H100-70B", 84, 8192, 64, 131072, 4096, 8, 2, 48, 384, 2, 21),
    ("MLM24-H100-119B", 92, 10240, 80, 131072, 4096, 8, 4, 48, 768, 2, 23),
    ("MLM24-H100-177B", 96, 12288, 96, 131072, 4096, 8, 6, 48, 1152, 2, 16),
    ("MLM24-H100-314B", 96, 16384, 128, 131072, 4096, 8, 8, 48, 1536, 1, 12),
    ("MLM24-H100-462B", 112, 18432, 144, 131072, 4096, 8, 16, 48, 3072, 1, 7),
]


def public_case(row):
    """The case as benchmarks/fidelity.py states it: Megatron GPT, the runtime each source ran."""
    name, layers, h, heads, vocab, seq, tp, pp, dp, batch, mb, vpp = row
    nar = name.startswith("NAR21")
    spec = ModelSpec(name=name, num_layers=layers, hidden=h, num_heads=heads, num_kv_heads=heads, head_dim=h // heads,
                     ffn_hidden=4 * h, vocab_size=vocab, seq_len=seq, max_positions=seq, mlp="gelu", norm="layernorm",
                     linear_bias=True, qkv_bias=False, tied_embeddings=nar, dropout=True)   # MLM24: Megatron-LM's defaults
    if nar:   # Megatron-LM of 2021: fp16, full recompute, unfused attention, all-reduce after backward, blocking sends
        work = Workload(global_batch=batch, seq_len=seq, precision="fp16", framework="megatron-2021", attention="unfused",
                        overlap_grad_reduce=False)
        knobs = dict(zero=0, recompute="full", sequence_parallel=False)
    else:     # Megatron-Core r0.8: distributed optimizer, overlapped reductions, TP comm overlap
        work = Workload(global_batch=batch, seq_len=seq, framework="megatron", tp_comm_overlap=True)
        knobs = dict(zero=1, recompute="none", sequence_parallel=tp > 1)
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch=mb, num_microbatches=batch // (dp * mb), vpp=vpp,
                            schedule="interleaved-1f1b" if vpp > 1 else "1f1b", **knobs)
    return spec, load_cluster("a100-80g" if nar else "h100-80g", tp * pp * dp), work, config


@pytest.mark.parametrize("row", CASES, ids=[row[0] for row in CASES])
def test_simulation_agrees_with_the_closed_form_on_the_public_cases(row):
    spec, cluster, work, config = public_case(row)
    graph = build_layer_graph(spec)
    cache = CostCache(graph, cluster, work)
    closed = estimate(graph, cluster, work, config, cache)
    assert closed.fits
    simulated = simulate(graph, cluster, work, config, cache).step_time_s
    # the pipeline alone: the closed form against the same passes played in the schedule's order (stage sends
    # included; no data-parallel stream, no optimizer)
    assert rank_pipeline_s(cache, config) == pytest.approx(play_config_pipeline(cache, config), rel=0.005)
    # the step: the closed form sums the data-parallel stream's exposure past the backward window, the simulation
    # places it layer by layer: they part most where latency-bound collectives cross many nodes (MLM24-70B: dp 48
    # over 48 nodes at NCCL's ring latency: 2.2%, and 2.9% with Megatron's buckets each a call of their own until
    # the closed form gave the interleaved schedule's parameter gather the first group's forwards, 0.7%; MLM24-119B,
    # dp 48: 2.44%, and 2.50% since the interleaved closed form takes the fill and drain from the other ranks, which
    # put its pipeline 0.05% under the play where it had been 0.02% over)
    assert simulated == pytest.approx(closed.step_time_s, rel=0.026)


# -- the search ranks its finalists by the simulation ------------------------------------------------

def test_search_ranks_finalists_by_simulated_step_time():
    graph = build_layer_graph(ZOO["llama3-8b"])
    cluster = load_cluster("h100-80g", 16)
    work = Workload(global_batch=64, seq_len=4096)
    result = search(graph, cluster, work, Knobs(pp=2, tp=2), top_k=3)
    finalists = [result.best, *result.alternatives]
    cache = CostCache(graph, cluster, work)
    for cand in finalists:
        simulated = simulate(graph, cluster, work, cand.config, cache).step_time_s
        assert cand.estimate.step_time_s == pytest.approx(simulated, rel=1e-12)
        assert cand.estimate.time.total == pytest.approx(cand.estimate.step_time_s, rel=1e-9)
    times = [c.estimate.step_time_s for c in finalists]
    assert times == sorted(times)


@pytest.mark.parametrize("schedule,vpp,m", [("1f1b", 1, 96), ("interleaved-1f1b", 2, 80), ("gpipe", 1, 65)])
def test_step_time_extrapolates_the_steady_state_exactly(schedule, vpp, m):
    # unequal stages, sends, data-parallel tail and parameter gathers: the shortcut (taken when
    # m > 3 (m1 + group), m1 = 16 here) must give what simulating every micro-batch gives
    layer = lambda f: LayerWork(fwd_s=f, bwd_s=2 * f, gather_fwd_s=0.3 * f, reduce_s=0.4 * f, tp_comm_s=0.1 * f)
    chunks = tuple(tuple((layer(0.7 + 0.2 * r), layer(0.5)) for _ in range(vpp)) for r in range(4))
    work = StepWork(schedule=schedule, num_microbatches=m, chunks=chunks, hop_s=0.05,
                    blocking_sends=schedule != "interleaved-1f1b", contention=0.1, embedding_allreduce_s=0.2,
                    optimizer_s=(0.3, 0.3, 0.3, 0.4))
    full = simulate_work(work)
    fast_s, fast_parts = step_time(work)
    assert fast_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert fast_parts.total == pytest.approx(fast_s, rel=1e-9)
    for name in ("compute", "bubble", "pp_comm", "dp_comm", "optimizer"):
        assert getattr(fast_parts, name) == pytest.approx(getattr(full.breakdown, name), rel=1e-9, abs=1e-12)
