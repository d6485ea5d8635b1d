"""The stage ILP against the exhaustive reference, and what its choices buy."""
import math
import json
import random
from dataclasses import replace

import pulp
import pytest

from planner.cluster import load_cluster
from planner.config import ParallelConfig, Workload
from planner.layers import build_layer_graph
from planner.model import ModelSpec, ZOO
from planner.search import search
from planner.search.space import Knobs, Layout, Space
from planner.search.stages import GroupProblem, compositions, graph_shape, regime_problems
from planner.search.ilp import solve_group
from planner.search.exhaustive import solve_group_exhaustively
from planner.cost.step import CostCache


def tiny(rng: random.Random, i: int) -> ModelSpec:
    heads = rng.choice([2, 4])
    hidden = heads * rng.choice([64, 128, 256])
    gpt = rng.random() < 0.5
    return ModelSpec(name=f"tiny{i}", num_layers=rng.choice([4, 5, 6]), hidden=hidden, num_heads=heads,
                     num_kv_heads=heads, head_dim=hidden // heads, ffn_hidden=4 * hidden,
                     vocab_size=rng.choice([512, 50000, 150000]), seq_len=rng.choice([512, 2048]),
                     max_positions=2048 if gpt else 0, mlp="gelu" if gpt else "swiglu",
                     norm="layernorm" if gpt else "rmsnorm", linear_bias=gpt, qkv_bias=False,
                     tied_embeddings=gpt and rng.random() < 0.5, dropout=gpt)


def scenario(i: int):
    """A small model on a small cluster; most fix a pipeline depth (tiny models would
    never choose one) so that stage sizes, per-stage recompute and the schedule matter;
    about half squeeze the device memory so that recompute and ZeRO choices bind."""
    rng = random.Random(1000 + i)
    spec = tiny(rng, i)
    graph = build_layer_graph(spec)
    cluster = load_cluster(rng.choice(["a100-40g", "h100-80g", "l40s", "v100-32g"]), rng.choice([2, 4]))
    precision = "fp16" if cluster.name == "v100-32g" else "bf16"
    workload = Workload(global_batch=cluster.num_gpus * rng.choice([2, 4]), seq_len=spec.seq_len,
                        precision=precision, framework=rng.choice(["torch", "megatron", "deepspeed"]),
                        attention=rng.choice(["flash", "unfused"]))
    pp = rng.choice([None, 2, 2, cluster.num_gpus])
    knobs = Knobs(pp=pp, tp=1 if pp else None,
                  schedule=rng.choice([None, "1f1b", "interleaved-1f1b"]) if pp else None,
                  vpp=2 if pp and rng.random() < 0.3 and pp * 2 <= spec.num_layers else None)
    if knobs.vpp:
        knobs = replace(knobs, schedule="interleaved-1f1b")
    if knobs.schedule == "interleaved-1f1b" and knobs.vpp is None:
        knobs = replace(knobs, schedule=None)
    return graph, squeezed(rng, graph, cluster, workload, knobs, 0.6), workload, knobs


SCENARIOS = 32


@pytest.mark.parametrize("i", range(SCENARIOS))
def test_ilp_search_equals_exhaustive_optimum(i):
    assert_ilp_equals_exhaustive(*scenario(i))


def squeezed(rng: random.Random, graph, cluster, workload, knobs, chance: float):
    """With probability ``chance``, ``cluster`` with its device memory squeezed to 80-100% of what the best
    balanced plan needs, so that recompute and ZeRO choices bind; else ``cluster``."""
    if rng.random() < chance:
        uniform = search(graph, cluster, workload, knobs, top_k=1, solver="uniform")
        if uniform.best is not None:
            squeeze = uniform.best.estimate.memory.total * rng.uniform(0.8, 1.0)
            return replace(cluster, device=replace(cluster.device, memory_bytes=squeeze))
    return cluster


def assert_ilp_equals_exhaustive(graph, cluster, workload, knobs) -> None:
    """The cost model's optimum, before the final ranking by simulation (which re-ranks the finalists, and the
    two searches keep different runners-up) and before the choice of a safer plan within the model's error (which
    chooses among those runners-up, in a band that profiles/validation/accuracy.toml sets): the ILP's equals the
    enumeration's."""
    ilp = search(graph, cluster, workload, knobs, top_k=1, solver="cbc", simulate=False, prefer="fastest")
    reference = search(graph, cluster, workload, knobs, top_k=1, solver="exhaustive", prune=False, simulate=False,
                       prefer="fastest")
    if reference.best is None:
        assert ilp.best is None
        return
    assert ilp.best is not None
    assert ilp.best.estimate.step_time_s == pytest.approx(reference.best.estimate.step_time_s, rel=1e-3)


def split_backward_scenario(i: int):
    """A small model on 4 GPUs of the torch runtime with a pipeline and the search free to pick any schedule,
    the split-backward ones (interleaved-zb, zbv, dualpipev) included, or one of them fixed; about half squeeze
    the memory."""
    rng = random.Random(5000 + i)
    spec = replace(tiny(rng, i), num_layers=rng.choice([4, 6, 8]))
    graph = build_layer_graph(spec)
    cluster = load_cluster(rng.choice(["a100-40g", "h100-80g"]), 4)
    workload = Workload(global_batch=rng.choice([8, 16]), seq_len=spec.seq_len, precision="bf16", framework="torch",
                        attention=rng.choice(["flash", "unfused"]))
    knobs = Knobs(pp=rng.choice([2, 4]) if spec.num_layers >= 8 else 2, tp=1,
                  schedule=rng.choice([None, "interleaved-zb", "zbv", "dualpipev"]))
    return graph, squeezed(rng, graph, cluster, workload, knobs, 0.5), workload, knobs


@pytest.mark.parametrize("i", range(8))
def test_ilp_search_equals_exhaustive_with_split_backward_schedules(i):
    assert_ilp_equals_exhaustive(*split_backward_scenario(i))


def finetune_scenario(i: int):
    """A small model on 2 or 4 GPUs trained with LoRA or QLoRA (planner/finetune.py): frozen base weights (16-bit
    or NF4), adapters of rank 4 or 8 on some projections; ZeRO, stage sizes and recompute searched, about half with
    the memory squeezed so that they bind."""
    rng = random.Random(7000 + i)
    spec = replace(tiny(rng, i), mlp="swiglu", norm="rmsnorm", linear_bias=False, max_positions=0, dropout=False,
                   tied_embeddings=rng.random() < 0.3)
    graph = build_layer_graph(spec)
    cluster = load_cluster(rng.choice(["a100-40g", "h100-80g"]), rng.choice([2, 4]))
    mode = rng.choice(["lora", "qlora"])
    workload = Workload(global_batch=cluster.num_gpus * rng.choice([2, 4]), seq_len=spec.seq_len, precision="bf16",
                        framework=rng.choice(["torch", "deepspeed"]), attention=rng.choice(["flash", "unfused"]),
                        finetune=mode, lora_rank=rng.choice([4, 8]),
                        lora_targets=rng.choice([("q", "v"), ("q", "k", "v", "o", "gate", "up", "down"), ("down",)]))
    pp = rng.choice([None, 2, cluster.num_gpus])
    knobs = Knobs(pp=pp, tp=1 if pp else None)
    return graph, squeezed(rng, graph, cluster, workload, knobs, 0.5), workload, knobs


@pytest.mark.parametrize("i", range(8))
def test_ilp_search_equals_exhaustive_with_finetune_modes(i):
    assert_ilp_equals_exhaustive(*finetune_scenario(i))


GROUPS = [  # (model, cluster, gpus, layout, schedule, vpp, memory squeeze)
    ("gpt", "a100-40g", 4, Layout(tp=1, pp=4, cp=1, dp=1, micro_batch=1), "1f1b", 1, 0.9),
    ("llama", "h100-80g", 4, Layout(tp=1, pp=2, cp=1, dp=2, micro_batch=2), "interleaved-1f1b", 2, 0.85),
    ("llama", "l40s", 4, Layout(tp=1, pp=4, cp=1, dp=1, micro_batch=1), "gpipe", 1, 0.95),
    ("gpt", "v100-32g", 4, Layout(tp=2, pp=2, cp=1, dp=1, micro_batch=1), "1f1b", 1, 0.8),
    ("llama", "a100-40g", 8, Layout(tp=1, pp=4, cp=1, dp=2, micro_batch=1), "1f1b", 1, 1.0),
    # split-backward schedules (planner/schedules.py backward "split"): the weight gradients' term, and in a V the
    # embedding and the head (with a tied embedding, both its copies) on rank 0
    ("gpt", "h100-80g", 4, Layout(tp=1, pp=2, cp=1, dp=2, micro_batch=1), "zbv", 2, 0.9),
    ("llama", "a100-40g", 4, Layout(tp=1, pp=2, cp=1, dp=2, micro_batch=1), "dualpipev", 2, 0.85),
    ("gpt", "a100-40g", 4, Layout(tp=1, pp=2, cp=1, dp=2, micro_batch=1), "interleaved-zb", 2, 0.9),
    ("llama", "h100-80g", 2, Layout(tp=1, pp=2, cp=1, dp=1, micro_batch=2), "interleaved-zb", 2, 1.0),
    # a V with fewer micro-batches than its stages (m = 2 and 1 on 4 stages): the schedule's time is the larger of
    # two terms (PipelineSchedule.pipeline_terms, the ILP's row (q))
    ("gpt", "h100-80g", 4, Layout(tp=1, pp=2, cp=1, dp=2, micro_batch=2), "zbv", 2, 0.9),
    ("llama", "a100-40g", 4, Layout(tp=1, pp=2, cp=1, dp=2, micro_batch=4), "zbv", 2, 0.85),
]


def _group_setting(case, **spec_changes):
    """(graph, cluster, workload, cost cache, space) of a GROUPS case: a small GPT or Llama of 6 blocks."""
    kind, cluster_name, gpus = case[:3]
    base = ZOO["gpt-1.7b" if kind == "gpt" else "llama3-8b"]
    spec = replace(base, **{**dict(num_layers=6, hidden=512, num_heads=4, num_kv_heads=4, head_dim=128,
                                   ffn_hidden=2048, seq_len=1024, max_positions=1024 if kind == "gpt" else 0),
                            **spec_changes})
    graph = build_layer_graph(spec)
    cluster = load_cluster(cluster_name, gpus)
    workload = Workload(global_batch=8, seq_len=1024, precision="fp16" if cluster_name == "v100-32g" else "bf16")
    return graph, cluster, workload, CostCache(graph, cluster, workload), Space(graph, gpus, workload, Knobs(),
                                                                                 cluster.device.dtypes)


@pytest.mark.parametrize("case", GROUPS)
def test_group_ilp_equals_group_enumeration(case):
    """One group at a time: the ILP's optimum is the best of every stage split, recompute
    assignment and ZeRO/offload option, under tight memory (one problem per eager regime of the ZeRO
    stages: stages.regime_problems)."""
    layout, schedule, vpp, squeeze = case[3:]
    graph, cluster, workload, cache, space = _group_setting(case)
    from planner.cost.step import estimate
    looses = regime_problems(space, cache, layout, schedule, vpp, False, graph_shape(cache))
    assert looses
    for k, loose in enumerate(looses):
        found = solve_group_exhaustively(loose)
        assert found is not None
        # squeeze memory to the exhaustive optimum's need: recompute and ZeRO choices must bind
        need = estimate(graph, cluster, workload, loose.config(found[0], found[1])).memory.total
        tight = replace(cluster, device=replace(cluster.device, memory_bytes=need * squeeze))
        cache_k = CostCache(graph, tight, workload)
        pr = regime_problems(space, cache_k, layout, schedule, vpp, False, graph_shape(cache_k))[k]
        assert [o.zero for o in pr.options] == [o.zero for o in loose.options]
        reference = solve_group_exhaustively(pr)
        ilp = solve_group(pr, "cbc")
        if reference is None:
            assert ilp is None
            continue
        assert ilp is not None
        config = pr.config(ilp[0], ilp[1])
        est = estimate(graph, tight, workload, config)
        assert est.fits
        assert est.step_time_s == pytest.approx(reference[2], rel=1e-6)
        assert ilp[2] == pytest.approx(est.step_time_s, rel=1e-6)      # the ILP prices it as the cost model does


@pytest.mark.parametrize("schedule,vpp,zero", [("interleaved-1f1b", 2, 0), ("interleaved-1f1b", 2, 3), ("1f1b", 1, 0)])
def test_group_ilp_prices_the_nics_the_data_parallel_ring_shares_as_the_cost_model_does(schedule, vpp, zero,
                                                                                         monkeypatch):
    """Four nodes of 8: dp 16 spans two of them and each stage sits on its own, so the data-parallel ring shares the
    NICs with the stage-boundary sends where those run beside compute (cost.step.network_busy_s). Rather than
    squeezing memory, slow the network so that the collectives outgrow their windows and the shared NICs count.
    ZeRO-0 and ZeRO-3, whose collectives the torch runtime overlaps. The ILP's optimum is the best of every split
    as the cost model prices it, the shared NICs included (they lengthen this step where the sends run beside
    compute). Its own objective is not compared: on several nodes its data-parallel rows price these plans up to
    10% above the cost model, before the shared NICs as after (a bound, not the price)."""
    from planner.cost import step
    from planner.cost.step import estimate, network_busy_s, rank_costs
    from planner.cluster import Link
    spec = replace(ZOO["llama3-8b"], num_layers=6, hidden=512, num_heads=4, num_kv_heads=4, head_dim=128,
                   ffn_hidden=2048, seq_len=1024)
    graph = build_layer_graph(spec)
    cluster = load_cluster("h100-80g", 32)
    cluster = replace(cluster, nic=Link(bytes_per_s=cluster.nic.bytes_per_s / 400, efficiency=cluster.nic.efficiency,
                                        latency_s=cluster.nic.latency_s))
    workload = Workload(global_batch=64, seq_len=1024, precision="bf16")
    cache = CostCache(graph, cluster, workload)
    space = Space(graph, 32, workload, Knobs(zero=zero), cluster.device.dtypes)
    layout = Layout(tp=1, pp=2, cp=1, dp=16, micro_batch=1)
    pr = GroupProblem(space, cache, layout, schedule, vpp, False, graph_shape(cache))
    assert pr.shares_nics
    assert (pr.sends_busy_s > 0) == (schedule == "interleaved-1f1b")
    reference = solve_group_exhaustively(pr)
    ilp = solve_group(pr, "cbc")
    assert reference is not None and ilp is not None
    config = pr.config(ilp[0], ilp[1])
    est = estimate(graph, cluster, workload, config)
    assert est.step_time_s == pytest.approx(reference[2], rel=1e-6)
    busy = network_busy_s(cache, config, rank_costs(cache, config)[0])
    assert busy == (pytest.approx(pr.sends_busy_s), pytest.approx(pr.sends_busy_s))
    monkeypatch.setattr(step, "network_busy_s", lambda *args: (0.0, 0.0))
    alone = estimate(graph, cluster, workload, config).step_time_s
    assert (est.step_time_s > alone * 1.01) == (schedule == "interleaved-1f1b")


def test_large_vocabulary_pipeline_gets_unequal_stages(cli):
    """Llama-3 8B (vocabulary 128256) on 8 pipeline stages: the head makes the last stage
    heavy, so it gets fewer blocks, and the estimate says how much that saves."""
    out = cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "64", "--pp", "8", "--tp", "1", "--prefer", "fastest",
              "--global-batch", "256", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    stages = doc["config"]["stage_layers"]
    gain = doc["gains"]["non_uniform_stages"]
    assert gain["saved_s"] > 0 and gain["balanced_step_time_s"] > doc["estimate"]["step_time_s"]
    # blocks per stage (embedding on the first, norm + head on the last): the last has fewer
    blocks = [stages[0] - 1] + stages[1:-1] + [stages[-1] - 2]
    assert blocks[-1] < max(blocks)
    assert len(set(blocks)) > 1


def test_partial_recompute_when_memory_needs_only_some(cli):
    """Llama-3 70B on 64 A100-80GB with tp 8 x pp 4, no context parallelism, ZeRO-0, 8K sequences:
    memory is short on the early stages (they hold the most micro-batches in flight)."""
    out = cli("plan", "--model", "llama3-70b", "--cluster", "a100-80g", "--gpus", "64", "--global-batch", "128",
              "--pp", "4", "--tp", "8", "--cp", "1", "--zero", "0", "--seq-len", "8192", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    layers = doc["config"]["recompute_layers"]
    recomputed = [p for p in layers if p != "none"]
    assert recomputed and layers.count("none") > len(recomputed)
    gain = doc["gains"]["partial_recompute"]
    assert gain["recomputed_layers"] == len(recomputed) < gain["blocks"]
    assert sum(gain["by_policy"].values()) == len(recomputed)
    assert gain["full_recompute_step_time_s"] > doc["estimate"]["step_time_s"]


def test_why_it_won_is_in_the_json(cli):
    out = cli("plan", "--model", "gpt-7.5b", "--cluster", "a100-80g", "--gpus", "32", "--global-batch", "256",
              "--json")
    doc = json.loads(out.stdout)
    assert doc["alternatives"] and all("lost_on" in a and " s per step" in a["lost_on"] for a in doc["alternatives"])
    assert doc["limits"].startswith("memory: stage") and "GiB" in doc["limits"]
    alternatives = [a["estimate"]["step_time_s"] for a in doc["alternatives"]]
    assert alternatives == sorted(alternatives)
    chosen, fastest = doc["estimate"]["step_time_s"], doc["choice"]["fastest"]["step_time_s"]
    assert fastest == min([chosen] + alternatives)
    if doc["choice"]["rule"] == "fastest":
        assert chosen == fastest
    else:           # a safer plan within the model's error of the fastest, which the runners-up then list
        assert chosen <= fastest * (1 + doc["choice"]["band"]) and fastest in alternatives


def test_highs_and_cbc_agree(cli):
    args = ["plan", "--model", "llama2-13b", "--cluster", "a100-40g", "--gpus", "16", "--global-batch", "64",
            "--pp", "4", "--tp", "2", "--json"]
    cbc = json.loads(cli(*args).stdout)
    highs = json.loads(cli(*args, "--solver", "highs").stdout)
    assert highs["estimate"]["step_time_s"] == pytest.approx(cbc["estimate"]["step_time_s"], rel=1e-6)


def _tiny_llama_group(layers: int, seq: int, cluster, capacity_fraction: float):
    """A Llama-shaped model with a small vocabulary (the blocks' activations dominate memory) on pp 2 with
    1F1B, its device memory set ``capacity_fraction`` of the way from the least any uniform policy needs
    to what no recompute needs: (problem, exhaustive optimum, ILP optimum)."""
    from planner.cost.step import estimate
    spec = replace(ZOO["llama3-8b"], num_layers=layers, hidden=1024, num_heads=8, num_kv_heads=8, head_dim=128,
                   ffn_hidden=4096, seq_len=seq, max_positions=0, vocab_size=2048)
    graph = build_layer_graph(spec)
    workload = Workload(global_batch=4, seq_len=seq, memory_headroom=0.0)     # the fraction is of all the memory
    layout = Layout(tp=1, pp=2, cp=1, dp=1, micro_batch=1)
    space = Space(graph, 2, workload, Knobs(), cluster.device.dtypes)
    loose = GroupProblem(space, CostCache(graph, cluster, workload), layout, "1f1b", 1, False, graph_shape(
        CostCache(graph, cluster, workload)))

    def need(policy: str) -> float:
        counts = loose.spread_counts([{c: layers // 2 if c == policy else 0 for c in loose.policies}] * 2)
        return estimate(graph, cluster, workload, loose.config(counts, loose.options[0])).memory.total

    least, most = min(need(p) for p in loose.policies), need("none")
    tight = replace(cluster, device=replace(cluster.device, memory_bytes=least + capacity_fraction * (most - least)))
    cache = CostCache(graph, tight, workload)
    pr = GroupProblem(space, cache, layout, "1f1b", 1, False, graph_shape(cache))
    return pr, solve_group_exhaustively(pr), solve_group(pr, "cbc")


def _policies_used(counts) -> set[str]:
    return {p for stage in counts for p, n in stage.items() if n}


@pytest.mark.parametrize("fraction", [0.7, 0.3, 0.2])
def test_ilp_mixes_new_policies_like_the_exhaustive_search(fraction):
    """Tight memory on a PCIe host (h100-80g): the optimum mixes operator-level selective recompute with no
    recompute and full recompute across the blocks, and the ILP finds it."""
    pr, reference, ilp = _tiny_llama_group(8, 16384, load_cluster("h100-80g", 2), fraction)
    assert set(pr.policies) == {"none", "op", "full", "activation-offload"}     # selective equals none under flash
    assert reference is not None and ilp is not None
    assert ilp[2] == pytest.approx(reference[2], rel=1e-6)
    used = _policies_used(reference[0])
    assert "op" in used and len(used) >= 2, used
    assert estimate_fits(pr, ilp)


def test_ilp_mixes_offload_where_the_host_link_is_fast():
    """Each GPU's host link at NVLink-C2C's 450 GB/s per direction (NVIDIA GH200 datasheet: 900 GB/s
    bidirectional) and the host DRAM not the limit: offload costs little, and where memory is tightest the
    optimum keeps offloading on one rank and recomputes on the other."""
    from planner.cluster import Link
    fast = replace(load_cluster("h100-80g", 2), host=Link(bytes_per_s=450e9, efficiency=1.0, latency_s=10e-6),
                   host_dram=Link(bytes_per_s=2 * 512e9, efficiency=1.0, latency_s=0.0))
    pr, reference, ilp = _tiny_llama_group(8, 8192, fast, 0.1)
    assert ilp[2] == pytest.approx(reference[2], rel=1e-6)
    assert "activation-offload" in _policies_used(reference[0]) and len(_policies_used(reference[0])) >= 2
    assert estimate_fits(pr, ilp)


def estimate_fits(pr, found) -> bool:
    from planner.cost.step import estimate
    est = estimate(pr.cache.graph, pr.cache.cluster, pr.cache.workload, pr.config(found[0], found[1]))
    return est.fits and est.step_time_s == pytest.approx(found[2], rel=1e-6)


def test_a_stage_ilp_stopped_at_its_time_limit_is_said_not_proven(monkeypatch):
    """PuLP reports HiGHS's and CBC's time limit, a solution in hand, as status Optimal (its solution status
    LpSolutionIntegerFeasible): such a stage ILP's plan is the best found, not the proven optimum, and the plan says
    so where the search relied on one (plan.json search.ilp_unproven, the last line of `meshplan plan`)."""
    from planner import api
    from planner.plan import Plan
    job = api.JobInputs(model="llama3-8b", cluster="h100-80g", gpus=16, framework="torch").load()
    knobs = api.Knobs(pp=4, tp=1)
    proven = api.plan(job, knobs, top_k=1)
    assert proven.search.ilp_solves > 0 and proven.search.ilp_unproven == 0
    assert "time limit" not in proven.search.line()
    real = pulp.LpProblem.solve

    def stopped(self, *args, **kwargs):
        status = real(self, *args, **kwargs)
        if self.sol_status == pulp.LpSolutionOptimal:
            self.sol_status = pulp.LpSolutionIntegerFeasible        # what a time limit leaves
        return status
    monkeypatch.setattr(pulp.LpProblem, "solve", stopped)
    unproven = api.plan(job, knobs, top_k=1)
    assert 0 < unproven.search.ilp_unproven <= unproven.search.ilp_solves     # those that held a plan
    assert "stopped at the time limit" in unproven.search.line()
    assert Plan.from_json(unproven.to_json()).search.ilp_unproven == unproven.search.ilp_unproven


def test_unproven_stage_ilps_of_the_runner_up_without_experts_are_counted(monkeypatch):
    """The best plan without expert parallelism, shown among the runners-up, comes from a search of its own: its
    stage ILPs stopped at the time limit are the plan's too (Qwen3-30B-A3B on 32 H100, those without experts made
    to stop)."""
    from planner import api
    from planner.search import ilp
    real = ilp.solve_group
    stopped = []

    def dense_stopped(problem, *args, **kwargs):
        found = real(problem, *args, **kwargs)
        if found is not None and found[0] is not None and problem.layout.ep == 1:
            stopped.append(problem)
            return found[:3] + (False,)
        return found
    monkeypatch.setattr(ilp, "solve_group", dense_stopped)
    result = api.plan(api.JobInputs(model="qwen3-30b-a3b", cluster="h100-80g", gpus=32).load())
    assert result.best.config.ep > 1 and any(c.config.ep == 1 for c in result.alternatives)
    assert stopped and result.search.ilp_unproven == len(stopped)


@pytest.mark.parametrize("block_s, fixed_s, v, blocks", [
    (1.0, [1.0, 0.0, 0.0], 1, 7),
    (0.5, [0.0, 0.0, 0.0, 2.0], 2, 11),
    (2.0, [0.3, 0.0, 0.7, 0.0, 0.0], 1, 13),
    (0.0, [0.4, 0.1, 0.2], 1, 5),
])
def test_most_least_weight_gradients_is_the_best_integer_split(block_s, fixed_s, v, blocks):
    """The cut (o) of the stage ILP: the least rank's weight-gradient time is at most the best any integer split
    reaches, found here by enumerating every split."""
    from planner.search.stages import most_least_wgrad
    best = max(min(f + block_s * n for f, n in zip(fixed_s, split)) for split in compositions(blocks, len(fixed_s), v))
    assert most_least_wgrad(block_s, fixed_s, v, blocks) == pytest.approx(best)


def test_most_least_weight_gradients_below_the_mean_where_blocks_do_not_divide():
    """94 blocks over 32 ranks of two virtual stages (Qwen3-235B's under ZB-V on 32 stages), the head and the
    embedding's weight gradients on rank 0: some other rank keeps 2 blocks whatever the split, so at most 2 blocks'
    time, where the relaxation's mean is 94/32 blocks and rank 0's share."""
    from planner.search.stages import most_least_wgrad
    assert most_least_wgrad(0.0025, [0.0043] + [0.0] * 31, 2, 94) == pytest.approx(2 * 0.0025)


@pytest.mark.parametrize("case", GROUPS)
def test_least_slowest_with_its_optimizer_is_the_best_integer_split(case):
    """The cut (p) of the stage ILP and the groups' bound: the least of a T_max + O over the integer splits (each rank
    at least v blocks, g_r its fixed layers, blocks and least recompute; o_r its optimizer step), found here by
    enumerating every split of the blocks over the ranks. The embedding and the head's optimizer step on the end
    ranks pull them towards fewer blocks, the pipeline towards balance."""
    from planner.search.stages import _least_recompute_s, least_slowest_and_optimizer
    layout, schedule, vpp = case[3:6]
    _, _, _, cache, space = _group_setting(case, num_layers=10, vocab_size=128000)
    for pr in regime_problems(space, cache, layout, schedule, vpp, False, graph_shape(cache)):
        t_block = pr.block.fwd_s + pr.block.bwd_s
        for opt in pr.options:
            for a in (0.0, 1.0, float(pr.m), 50.0 * pr.m):
                best = math.inf
                for split in compositions(pr.num_blocks, pr.p, pr.v):
                    slowest = max(f.fwd_s + f.bwd_s + b * t_block + _least_recompute_s(pr, opt, r, b)
                                  for r, (f, b) in enumerate(zip(pr.fixed, split)))
                    optimizer = max(opt.block_optimizer_s * b + opt.optimizer_s_per_param * f.params
                                    for f, b in zip(pr.fixed, split))
                    best = min(best, a * slowest + optimizer)
                assert least_slowest_and_optimizer(pr, opt, a) == pytest.approx(best, rel=1e-9)


def test_zero_stages_split_by_the_regime_their_layers_run_in():
    """torch: FSDP2 or replicate (bf16 layers) against DDP or no wrapper (autocast), as executor/parallelize.py
    ``dp_wrapper`` decides: one stage problem per regime, its layers priced in it; bounds in the cheaper one."""
    case = ("llama", "h100-80g", 4, Layout(tp=1, pp=1, cp=1, dp=4, micro_batch=1), "1f1b", 1, 1.0)
    graph, cluster, workload, cache, space = _group_setting(case)
    plain = regime_problems(space, cache, case[3], "1f1b", 1, False, graph_shape(cache))
    assert [sorted({o.zero for o in pr.options}) for pr in plain] == [[0, 1], [2, 3]]   # DDP, ZeRO-1; FSDP2
    assert [pr.ctx.eager_regime for pr in plain] == ["autocast", "bf16"]
    autocast, bf16 = (pr.block for pr in plain)
    assert bf16.fwd_s + bf16.bwd_s < autocast.fwd_s + autocast.bwd_s      # no input casts, a bf16 residual stream
    piped = Layout(tp=1, pp=2, cp=1, dp=2, micro_batch=1)
    assert [sorted({o.zero for o in pr.options})
            for pr in regime_problems(space, cache, piped, "1f1b", 1, False, graph_shape(cache))] == [[0, 2, 3], [1]]
    config = ParallelConfig(dp=4, tp=1, pp=1, micro_batch=1, num_microbatches=2)
    assert cache.regime(cache.bound_config(config, [0, 1, 2, 3])) == "bf16"
    assert cache.bound_config(config, [0, 1]).zero == 0            # one regime: itself
    assert not cache._no_dearer(cache.context(config.but(zero=0)), cache.context(config.but(zero=3)))


def test_a_policy_s_problem_is_solved_alike_whatever_was_solved_before():
    """A runtime with one recompute policy for every block solves one problem per policy, copies of one group
    (``with_policies``). Each copy's optimizer frontier is its own: the frontier of a policy under which no split
    fits (none, selective) once made the full-recompute problem infeasible too (random scenario 17 once the default
    memory headroom was 0.18)."""
    graph, cluster, workload, knobs = scenario(17)
    space = Space(graph, cluster.num_gpus, workload, knobs, cluster.device.dtypes, cluster.device_kind)
    cache = CostCache(graph, cluster, workload)
    layout = Layout(tp=1, pp=2, cp=1, dp=1, micro_batch=1)
    (whole,) = regime_problems(space, cache, layout, "1f1b", 1, False, graph_shape(cache))
    alone = {policy: solve_group(GroupProblem(space, cache, layout, "1f1b", 1, False, graph_shape(cache),
                                              policies=(policy,)), "cbc") for policy in whole.policies}
    assert alone["full"] is not None and alone["none"] is None
    in_turn = {policy: solve_group(whole.with_policies((policy,)), "cbc") for policy in whole.policies}
    assert {p: r and r[:3] for p, r in in_turn.items()} == {p: r and r[:3] for p, r in alone.items()}
