"""The enumerating search: exact against evaluating every candidate, legal, respects fixed knobs."""
import json
import random

import pytest

from planner.cluster import load_cluster
from planner.config import Workload
from planner.errors import UserError
from planner.layers import build_layer_graph
from planner.model import ModelSpec
from planner.search import search
from planner.search.space import Knobs, Space


def tiny_model(rng: random.Random, name: str) -> ModelSpec:
    heads = rng.choice([4, 8])
    hidden = heads * rng.choice([32, 64, 128])
    gpt = rng.random() < 0.5
    return ModelSpec(name=name, num_layers=rng.choice([2, 3, 4, 6, 8]), hidden=hidden, num_heads=heads,
                     num_kv_heads=heads if gpt else heads // 2, head_dim=hidden // heads,
                     ffn_hidden=4 * hidden if gpt else 3 * hidden, vocab_size=rng.choice([1000, 32000]),
                     seq_len=rng.choice([256, 1024, 4096]), max_positions=4096 if gpt else 0,
                     mlp="gelu" if gpt else "swiglu", norm="layernorm" if gpt else "rmsnorm", linear_bias=gpt,
                     qkv_bias=False, tied_embeddings=gpt, dropout=gpt)


def scenarios(count: int):
    rng = random.Random(2026)
    for i in range(count):
        spec = tiny_model(rng, f"tiny{i}")
        cluster = load_cluster(rng.choice(["a100-40g", "h100-80g", "l40s"]), rng.choice([4, 8, 16]))
        # tight memory: shrink the device so only some candidates fit
        if rng.random() < 0.5:
            from dataclasses import replace
            graph = build_layer_graph(spec)
            need = graph.num_params * rng.choice([4, 8, 16]) / cluster.num_gpus + 0.2e9
            cluster = replace(cluster, device=replace(cluster.device, memory_bytes=need, reserved_bytes=0.1e9))
        workload = Workload(global_batch=cluster.num_gpus * rng.choice([1, 2, 4]), seq_len=spec.seq_len,
                            framework=rng.choice(["torch", "megatron", "deepspeed"]))
        yield spec, cluster, workload


@pytest.mark.parametrize("index", range(12))
def test_pruned_search_finds_the_exhaustive_optimum(index):
    spec, cluster, workload = list(scenarios(12))[index]
    graph = build_layer_graph(spec)
    # the cost model's optimum (the simulation re-ranks finalists and runners-up afterwards; the
    # runners-up are each layout's best where the search reached it, so that pool depends on pruning)
    pruned = search(graph, cluster, workload, top_k=3, solver="uniform", simulate=False)
    full = search(graph, cluster, workload, top_k=3, prune=False, solver="uniform", simulate=False)
    assert pruned.candidates == full.candidates
    if full.best is None:
        assert pruned.best is None
        assert pruned.least_memory.estimate.memory.total == pytest.approx(full.least_memory.estimate.memory.total)
    else:
        assert pruned.best.estimate.step_time_s == pytest.approx(full.best.estimate.step_time_s, rel=1e-12)
        assert pruned.evaluated < full.evaluated


def test_every_enumerated_candidate_is_legal():
    spec, cluster, workload = next(scenarios(1))
    graph = build_layer_graph(spec)
    space = Space(graph, cluster.num_gpus, workload, Knobs(), cluster.device.dtypes)
    n = 0
    for layout in space.layouts():
        for schedule, vpp in space.schedules(layout):
            for sp in space.sequence_parallel(layout):
                for zero in space.zeros(layout):
                    for config in space.configs(layout, schedule, vpp, sp, zero):
                        space.check(config)        # raises if illegal
                        n += 1
    assert n > 100


def test_fixed_knobs_are_respected():
    spec, cluster, workload = next(scenarios(1))
    graph = build_layer_graph(spec)
    result = search(graph, cluster, workload, Knobs(tp=2, zero=1, recompute="full"))
    c = result.best.config
    assert (c.tp, c.zero, c.recompute) == (2, 1, "full")


def test_impossible_fixed_knobs_explain_themselves():
    spec, cluster, workload = next(scenarios(1))
    graph = build_layer_graph(spec)
    with pytest.raises(UserError, match="does not divide"):
        search(graph, cluster, workload, Knobs(tp=3))


def test_runners_up_are_slower_and_distinct():
    spec, cluster, workload = list(scenarios(3))[2]
    result = search(build_layer_graph(spec), cluster, workload, top_k=4)
    times = [result.best.estimate.step_time_s] + [a.estimate.step_time_s for a in result.alternatives]
    assert times == sorted(times)
    assert len({a.config for a in result.alternatives} | {result.best.config}) == len(times)


def test_the_published_llama3_405b_layout_plans_with_one_layer_per_stage(cli):
    """Llama 3 paper (Dubey et al. 2024, Sec 3.3.2, Table 4): tp 8, pp 16, 8 virtual stages per rank,
    dp 128: 126 blocks + the embedding + the head in 128 virtual stages of one layer each."""
    out = cli("plan", "--model", "llama3-405b", "--cluster", "h100-80g", "--gpus", "16384", "--global-batch", "2048",
              "--tp", "8", "--pp", "16", "--vpp", "8", "--dp", "128", "--cp", "1", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    stages = doc["stages"]
    assert len(stages) == 128
    assert stages[0] == ["embed"] and stages[-1] == ["norm", "lm_head"]
    assert stages[1:-1] == [[f"layers.{i}"] for i in range(126)]
    assert doc["estimate"]["step_time_s"] > 0
