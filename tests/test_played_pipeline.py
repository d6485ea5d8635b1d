"""Pipelines whose virtual stages hold unequal blocks, played rather than priced by the closed form, and the
extrapolation of long steps."""
import random
from dataclasses import replace

import pytest

from planner import api
from planner.config import ParallelConfig
from planner.cost.step import CostCache, played_pipeline_s, rank_pipeline_s, uneven_virtual_stages
from planner.pipeline_play import _play_pipeline, pipeline_floor, play_pipeline
from planner.schedules import SCHEDULES
from planner.simulate import LayerWork, StepWork, simulate_work, simulated_estimate, step_time


def _random_pipeline(rng: random.Random, schedule: str):
    rec = SCHEDULES[schedule]
    p = rng.choice([2, 3, 4, 8])
    v = rec.stages_per_rank or (rng.choice([2, 3, 4]) if rec.virtual_stages else 1)
    m = p * rng.choice([1, 2, 3]) if rec.microbatches_multiple_of_pp else rng.choice([1, 2, 3, 5, 8, 16])
    layers = [[[LayerWork(fwd_s=rng.uniform(0.5, 2), bwd_s=b, wgrad_s=rng.uniform(0, b / 2))
                for b in (rng.uniform(1, 4) for _ in range(rng.randint(1, 3)))] for _ in range(v)] for _ in range(p)]
    return p, v, m, layers


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_play_is_the_simulation(schedule):
    """The search's player gives the step the simulation gives the same chunks (no collective, no optimizer),
    for every schedule, unequal chunks, sends blocking or not."""
    rng = random.Random(schedule)
    for _ in range(12):
        p, v, m, layers = _random_pipeline(rng, schedule)
        if SCHEDULES[schedule].refusal(pp=p, vpp=v, m=m):
            continue
        hop, blocking = rng.choice([0.0, 0.1, 0.7]), rng.choice([True, False])
        work = StepWork(schedule=schedule, num_microbatches=m, hop_s=hop, blocking_sends=blocking,
                        chunks=tuple(tuple(tuple(chunk) for chunk in rank) for rank in layers))
        passes = tuple(tuple((sum(x.fwd_s for x in chunk), sum(x.bwd_s for x in chunk), sum(x.wgrad_s for x in chunk))
                             for chunk in rank) for rank in layers)
        simulated = simulate_work(work, record=False).step_time_s
        assert _play_pipeline(schedule, passes, m, hop_s=hop, blocking_sends=blocking) == pytest.approx(simulated,
                                                                                                        rel=1e-12)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_pipeline_floor_is_at_most_the_played_pipeline(schedule):
    """The floor the search checks before it plays a candidate never exceeds the played step, for every schedule,
    unequal chunks, sends blocking or not; and is the step where nothing overlaps: one micro-batch through two
    ranks, and one rank alone."""
    rng = random.Random("floor" + schedule)
    for _ in range(24):
        p, v, m, layers = _random_pipeline(rng, schedule)
        if SCHEDULES[schedule].refusal(pp=p, vpp=v, m=m):
            continue
        hop, blocking = rng.choice([0.0, 0.1, 0.7]), rng.choice([True, False])
        passes = tuple(tuple((sum(x.fwd_s for x in chunk), sum(x.bwd_s for x in chunk), sum(x.wgrad_s for x in chunk))
                             for chunk in rank) for rank in layers)
        played = play_pipeline(schedule, passes, m, hop_s=hop, blocking_sends=blocking)
        assert pipeline_floor(schedule, passes, m, hop_s=hop) <= played * (1 + 1e-12)


def test_pipeline_floor_by_hand():
    # 1F1B, one micro-batch over two ranks: F0, send, F1, B1, send, B0 = 1 + 0.5 + 2 + 3 + 0.5 + 4
    passes = (((1.0, 4.0, 1.0),), ((2.0, 3.0, 1.0),))
    assert pipeline_floor("1f1b", passes, 1, hop_s=0.5) == pytest.approx(11.0)
    assert play_pipeline("1f1b", passes, 1, hop_s=0.5) == pytest.approx(11.0)
    # four micro-batches: rank 1 waits for the first forward (1 + 0.5), runs 4 x (2 + 3), and its last backward's
    # gradient goes back through rank 0 (0.5 + 4): 26; rank 0 alone is 4 x 5 = 20
    assert pipeline_floor("1f1b", passes, 4, hop_s=0.5) == pytest.approx(26.0)
    assert play_pipeline("1f1b", passes, 4, hop_s=0.5) >= 26.0


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_are_simulated_whole(schedule):
    """Eight ranks of unequal stages under a V schedule: three runs of 32, 40 and 48 micro-batches grow alike, yet
    256 take 1.4% longer than extrapolated from them; the step is the whole simulation's."""
    chunks = tuple(tuple((LayerWork(fwd_s=1 + (r * 3 + c * 5) % 4 * 0.5, bwd_s=2 + (r * 7 + c) % 3 * 0.8,
                                    wgrad_s=0.3 + (r + c * 2) % 2 * 0.2),) for c in range(2)) for r in range(8))
    work = StepWork(schedule=schedule, num_microbatches=256, chunks=chunks, hop_s=0.1, blocking_sends=False)
    short = [simulate_work(replace(work, num_microbatches=n), record=False).step_time_s for n in (32, 40, 48)]
    assert short[1] - short[0] == pytest.approx(short[2] - short[1], rel=1e-12)      # they grow alike
    whole = simulate_work(work, record=False).step_time_s
    assert short[0] + 28 * (short[1] - short[0]) < whole * 0.99                      # and the step does not
    assert step_time(work)[0] == pytest.approx(whole, rel=1e-12)
    passes = tuple(tuple((c[0].fwd_s, c[0].bwd_s, c[0].wgrad_s) for c in rank) for rank in chunks)
    assert play_pipeline(schedule, passes, 256, hop_s=0.1, blocking_sends=False) == pytest.approx(whole, rel=1e-12)


def test_uneven_virtual_stages_are_played():
    """61 blocks of DeepSeek-V3 over 16 ranks x 3 virtual stages (13 of two blocks, 35 of one): the closed form,
    which takes a rank's chunks alike, is 0.5 s short of the pipeline the simulation plays. Llama 3 70B's 80 over
    8 x 2 (five each, the embedding and the head beside the first and last five) keeps the closed form."""
    job = api.JobInputs(model="deepseek-v3", cluster="h100-80g", gpus=1024, framework="megatron",
                        precision="bf16").load()
    cache = CostCache(job.graph, job.cluster, job.workload)
    config = ParallelConfig(dp=32, tp=1, pp=16, cp=2, ep=8, zero=1, micro_batch=1, num_microbatches=32, vpp=3,
                            schedule="interleaved-1f1b", recompute="full")
    assert uneven_virtual_stages(cache, config)
    played = played_pipeline_s(cache, config)
    assert played > rank_pipeline_s(cache, config) + 0.5
    # the whole simulation's step: the played pipeline and what follows it (the data-parallel tail, the optimizer:
    # under 0.2 s here)
    simulated = simulated_estimate(job.graph, job.cluster, job.workload, config, cache).step_time_s
    assert played <= simulated <= played + 0.2

    job = api.JobInputs(model="llama3-70b", cluster="h100-80g", gpus=64, framework="megatron").load()
    cache = CostCache(job.graph, job.cluster, job.workload)
    assert len(job.graph.layers) == 83         # the embedding, 80 blocks, the final norm and the head
    even = ParallelConfig(dp=1, tp=8, pp=8, micro_batch=1, num_microbatches=16, vpp=2, schedule="interleaved-1f1b",
                          sequence_parallel=True, stage_layers=(6,) + (5,) * 14 + (7,))
    assert not uneven_virtual_stages(cache, even)
    assert played_pipeline_s(cache, even) is None


def test_search_ranks_uneven_virtual_stages_by_their_played_pipeline():
    """DeepSeek-V3 on 1024 H100 under Megatron-LM in FP8 with delayed scaling: the closed form put 16 ranks x 3
    uneven virtual stages first (3.4 s), and the finalists, all of such layouts, simulated at 4.4 s and up; a
    1F1B plan over 32 stages simulates at 3.7 s. Ranked by their played pipelines as they come, the search's
    recommendation is no slower than that plan."""
    job = api.JobInputs(model="deepseek-v3", cluster="h100-80g", gpus=1024, framework="megatron",
                        precision="fp8-delayed").load()
    plan = api.plan(job, prefer="fastest")
    known = ParallelConfig(dp=8, tp=2, pp=32, cp=2, ep=8, zero=1, micro_batch=1, num_microbatches=128,
                           recompute="none", sequence_parallel=True)
    reference = simulated_estimate(job.graph, job.cluster, job.workload, known).step_time_s
    assert plan.best.estimate.step_time_s <= reference * 1.001


def _dp_split(zero: int, pp: int):
    from planner.cost.step import dp_collectives, dp_phases
    job = api.JobInputs(model="llama3-8b", cluster="h100-80g", gpus=16, framework="torch").load()
    cache = CostCache(job.graph, job.cluster, job.workload)
    config = ParallelConfig(dp=16 // pp, tp=1, pp=pp, zero=zero, micro_batch=1, num_microbatches=8)
    params = 218_112_000.0          # a Llama 3 8B block
    return dp_phases(cache, config, params), dp_collectives(cache, config, params)


def test_torch_pipelining_keeps_fsdp_parameters_gathered_from_each_backward():
    """torch.distributed.pipelining sets reshard_after_backward False on every FSDP module (stage.py
    backward_maybe_with_nosync, torch 2.13) and reduces once after the last backward: ZeRO-2's parameters, which no
    forward reshards, are gathered once a step; ZeRO-3's, resharded after each forward, again before each backward
    but not before each forward. The search priced a gather before every forward, and the simulation blocked on
    it: GPT-OSS-120B on 64 B200 for torchtitan recommended a DualPipeV plan of 1.95 s over one of 1.42 s."""
    (fwd, bwd, reduce), (per_micro, once, after) = _dp_split(zero=2, pp=1)
    assert bwd == 0 and per_micro == pytest.approx(fwd + reduce) and once == 0 and after == 0
    (fwd, bwd, reduce), (per_micro, once, after) = _dp_split(zero=2, pp=2)
    assert per_micro == 0 and once == reduce and after == fwd > 0
    (fwd, bwd, reduce), (per_micro, once, after) = _dp_split(zero=3, pp=2)
    assert bwd == fwd > 0 and per_micro == bwd and once == reduce and after == fwd
    (fwd, bwd, reduce), (per_micro, once, after) = _dp_split(zero=3, pp=1)
    assert per_micro == pytest.approx(fwd + bwd + reduce) and once == 0 and after == 0


def test_the_simulation_gathers_forward_once_where_the_parameters_stay_gathered():
    """Two ranks, four micro-batches, a 1 s gather before each layer's forward and backward that nothing hides
    (blocking collectives): with the forward's gathers made once, the step is 3 s a rank shorter (three forwards
    gather no more)."""
    layer = LayerWork(fwd_s=0.1, bwd_s=0.2, gather_fwd_s=1.0, gather_bwd_s=1.0)
    work = StepWork(schedule="1f1b", num_microbatches=4, chunks=(((layer,),), ((layer,),)),
                    gather_every_microbatch=True, overlap_dp=False)
    every = simulate_work(work, record=False)
    once = simulate_work(replace(work, gather_forward_once=True), record=False)
    assert every.step_time_s - once.step_time_s == pytest.approx(3.0, rel=1e-9)


def test_candidates_turned_away_by_their_floor_change_nothing(monkeypatch):
    """The search plays a candidate of uneven virtual stages only where its pipeline's floor leaves it a chance
    to be kept: the same recommendation, runners-up and step times as playing every one, with fewer plays
    (Qwen3-235B-A22B on 64 H100, whose 94 blocks divide into no virtual stages evenly)."""
    import planner.search.driver as driver
    from planner import pipeline_play
    from planner.simulate import played_candidate
    job = api.JobInputs(model="qwen3-235b-a22b", cluster="h100-80g", gpus=64).load()
    plays = []
    real = pipeline_play.play_pipeline

    def counted(*args, **kwargs):
        plays.append(1)
        return real(*args, **kwargs)

    def summary(result):
        return [(c.config, c.estimate.step_time_s) for c in (result.best, *result.alternatives)]

    import planner.cost.step as step
    monkeypatch.setattr(step, "play_pipeline", counted)
    floored = api.plan(job)
    n_floored = len(plays)
    plays.clear()
    monkeypatch.setattr(driver, "played_candidate", lambda cache, cand, bar: played_candidate(cache, cand))
    every = api.plan(job)
    assert summary(floored) == summary(every)
    assert n_floored < len(plays)
