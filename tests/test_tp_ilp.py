"""The tensor-parallel sharding ILP over a block's operator graph."""
import pytest

from planner.cluster import load_cluster
from planner.layers import Op, Saved, build_layer_graph
from planner.model import ZOO
from planner.search.tp_dataflow import INPUT, OUTPUT, add_op, block_graph, new_graph
from planner.search.tp_ilp import Context, brute_force, replicated, solve_sharding

A100 = load_cluster("a100-80g", 8)
H100 = load_cluster("h100-80g", 8)

MEGATRON = {  # Shoeybi et al. 2019, Sec 3: column-parallel then row-parallel, heads split
    "q_proj": "column", "k_proj": "column", "v_proj": "column", "core": "heads", "o_proj": "row",
    "fc1": "column", "gelu": "feature", "fc2": "row",
    "gate_proj": "column", "up_proj": "column", "act": "feature", "down_proj": "row", "rope": "feature",
}


def ctx(tp, sp, tokens=4096):
    return Context(tp=tp, tokens=tokens, micro_batch=1, seq_len=tokens, precision="bf16", attention="flash",
                   sequence_parallel=sp)


@pytest.mark.parametrize("model", ["gpt3-175b", "gpt-1.7b", "llama3-8b", "llama3-70b", "llama2-13b"])
@pytest.mark.parametrize("cluster", [A100, H100], ids=["a100", "h100"])
@pytest.mark.parametrize("tp,sp", [(2, False), (8, False), (4, True), (8, True)])
def test_transformer_blocks_get_megatrons_pattern(model, cluster, tp, sp):
    spec = ZOO[model]
    layer = build_layer_graph(spec).layers[1]
    sharding = solve_sharding(block_graph(layer, spec.hidden), ctx(tp, sp), cluster)
    for name, strategy in sharding.strategies.items():
        short = name.rsplit(".", 1)[-1]
        if short in MEGATRON:
            assert strategy == MEGATRON[short], (name, strategy)
        else:   # norms, residual adds: replicated, or split by sequence with sequence parallelism
            assert strategy == ("sequence" if sharding.boundary == "S" else "replicate"), (name, strategy)
    assert sharding.boundary == ("S" if sp else "R")


def _linear(name, k, n, bias=True):
    return Op(name=name, kind="linear", params=k * n + (n if bias else 0), in_features=k, out_features=n,
              saved=(Saved(elems=k, split="tp"),))


def _pointwise(name, width, norm=False, params=0):
    return Op(name=name, kind="elementwise", params=params, bytes_fwd=4 * width, bytes_bwd=6 * width, norm=norm,
              split="sp", saved=(Saved(elems=width, split="sp"),))


def vit_block(h=1024, heads=16):
    """A vision-transformer encoder block: pre-norm, bidirectional attention, GELU MLP,
    with layer-scale multiplies on both branches (a structure the builder never makes)."""
    g = new_graph(h)
    n1 = add_op(g, _pointwise("norm1", h, norm=True, params=2 * h), (INPUT, h))
    q = add_op(g, _linear("q", h, h), (n1, h))
    k = add_op(g, _linear("k", h, h), (n1, h))
    v = add_op(g, _linear("v", h, h), (n1, h))
    a = add_op(g, Op(name="attn", kind="attention", heads=heads, kv_heads=heads, head_dim=h // heads, causal=False),
               (q, h), (k, h), (v, h))
    o = add_op(g, _linear("proj", h, h), (a, h))
    ls1 = add_op(g, _pointwise("layer_scale1", h, params=h), (o, h))
    r1 = add_op(g, _pointwise("add1", h), (ls1, h), (INPUT, h))
    n2 = add_op(g, _pointwise("norm2", h, norm=True, params=2 * h), (r1, h))
    f1 = add_op(g, _linear("fc1", h, 4 * h), (n2, h))
    act = add_op(g, _pointwise("gelu", 4 * h), (f1, 4 * h))
    f2 = add_op(g, _linear("fc2", 4 * h, h), (act, 4 * h))
    ls2 = add_op(g, _pointwise("layer_scale2", h, params=h), (f2, h))
    r2 = add_op(g, _pointwise("add2", h), (ls2, h), (r1, h))
    g.add_edge(r2, OUTPUT, features=h)
    return g


def parallel_block(h=2048, heads=16):
    """GPT-J / PaLM style: attention and MLP read the same normed input, outputs summed."""
    g = new_graph(h)
    n = add_op(g, _pointwise("norm", h, norm=True, params=2 * h), (INPUT, h))
    qkv = add_op(g, _linear("qkv", h, 3 * h), (n, h))
    a = add_op(g, Op(name="attn", kind="attention", heads=heads, kv_heads=heads, head_dim=h // heads), (qkv, 3 * h))
    o = add_op(g, _linear("out", h, h), (a, h))
    up = add_op(g, _linear("up", h, 4 * h), (n, h))
    act = add_op(g, _pointwise("act", 4 * h), (up, 4 * h))
    down = add_op(g, _linear("down", 4 * h, h), (act, 4 * h))
    s = add_op(g, _pointwise("sum", h), (o, h), (down, h), (INPUT, h))
    g.add_edge(s, OUTPUT, features=h)
    return g


@pytest.mark.parametrize("build", [vit_block, parallel_block])
@pytest.mark.parametrize("tp,sp", [(2, False), (8, True)])
def test_unseen_blocks_get_a_valid_sharding_no_worse_than_replicating(build, tp, sp):
    graph = build()
    sharding = solve_sharding(graph, ctx(tp, sp, tokens=2048), A100)
    baseline = replicated(graph, ctx(tp, sp, tokens=2048), A100)
    assert sharding.seconds < float("inf")
    assert sharding.seconds <= baseline.seconds
    assert set(sharding.strategies) == {v for v in graph.nodes if v not in (INPUT, OUTPUT)}
    # the heavy GEMMs end up split: the ILP found something better than replicating them
    assert sharding.param_bytes < baseline.param_bytes


def mlp_block(h=1024):
    g = new_graph(h)
    n = add_op(g, _pointwise("norm", h, norm=True, params=2 * h), (INPUT, h))
    a = add_op(g, _linear("fc1", h, 4 * h), (n, h))
    b = add_op(g, _pointwise("act", 4 * h), (a, 4 * h))
    c = add_op(g, _linear("fc2", 4 * h, h), (b, 4 * h))
    r = add_op(g, _pointwise("add", h), (c, h), (INPUT, h))
    g.add_edge(r, OUTPUT, features=h)
    return g


@pytest.mark.parametrize("build", [mlp_block, parallel_block])
@pytest.mark.parametrize("tp,sp,cluster", [(2, False, A100), (4, True, A100), (8, True, H100), (2, True, load_cluster("l40s", 8))])
def test_ilp_equals_brute_force(build, tp, sp, cluster):
    graph = build()
    c = ctx(tp, sp, tokens=2048)
    ilp, every = solve_sharding(graph, c, cluster), brute_force(graph, c, cluster)
    assert ilp.seconds == pytest.approx(every.seconds, rel=1e-9, abs=1e-12)
