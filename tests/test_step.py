"""Composition of a step: pipeline formulas and whole-step properties."""
from dataclasses import replace

import pytest

from planner.cluster import load_cluster
from planner.config import ParallelConfig, Workload
from planner.cost.step import estimate, pipeline_s
from planner.placement import assign_layers, balanced_stage_layers
from planner.layers import build_layer_graph
from planner.model import ZOO


def cfg(**kw):
    base = dict(dp=1, tp=1, pp=4, micro_batch=1, num_microbatches=8, schedule="1f1b")
    base.update(kw)
    return ParallelConfig(**base)


def test_1f1b_equal_stages_has_p_minus_1_bubble():
    assert pipeline_s([2.0] * 4, cfg()) == pytest.approx((8 + 4 - 1) * 2.0)


def test_1f1b_unequal_stages():
    # (m - 1) * slowest + sum of stages
    assert pipeline_s([1.0, 2.0, 1.0, 1.5], cfg()) == pytest.approx(7 * 2.0 + 5.5)


def test_interleaved_bubble_shrinks_by_v():
    c = cfg(schedule="interleaved-1f1b", vpp=2)
    assert pipeline_s([2.0] * 4, c) == pytest.approx((8 + 3 / 2) * 2.0)
    assert pipeline_s([2.0] * 4, c, hop_s=0.01) == pytest.approx((8 + 3 / 2) * 2.0 + 2 * 7 * 0.01)


def test_stage_placement():
    graph = build_layer_graph(ZOO["gpt-1.7b"])         # embed, 24 blocks, norm, head
    counts = balanced_stage_layers(graph, 5)
    assert sum(counts) == len(graph.layers)
    blocks = [counts[0] - 1] + list(counts[1:-1]) + [counts[-1] - 2]
    # the extra blocks go to the middle stages; the last stage also holds the LM head
    assert sorted(blocks) == [4, 5, 5, 5, 5] and blocks[-1] == 4
    placed = assign_layers(graph, cfg(pp=2, vpp=2, schedule="interleaved-1f1b"))
    assert [len(chunks) for chunks in placed] == [2, 2]
    assert placed[0][0][0] == 0 and placed[1][1][-1] == len(graph.layers) - 1   # embed first, head last


GRAPH = build_layer_graph(ZOO["llama3-8b"])
CLUSTER = load_cluster("h100-80g", 8)
WORK = Workload(global_batch=64, seq_len=4096)


def test_more_microbatches_cost_proportionally_more_compute():
    c = ParallelConfig(dp=8, tp=1, pp=1, zero=3, micro_batch=1, num_microbatches=8)
    a = estimate(GRAPH, CLUSTER, WORK, c)
    b = estimate(GRAPH, CLUSTER, replace(WORK, global_batch=128), replace(c, num_microbatches=16))
    assert b.time.compute == pytest.approx(2 * a.time.compute)
    assert b.memory.activations == pytest.approx(a.memory.activations)


def test_full_recompute_trades_time_for_memory():
    c = ParallelConfig(dp=8, tp=1, pp=1, zero=3, micro_batch=1, num_microbatches=8)
    none = estimate(GRAPH, CLUSTER, WORK, c)
    full = estimate(GRAPH, CLUSTER, WORK, replace(c, recompute="full"))
    # the loss's backward workspace (two fp32 copies of the logits under torch eager, 4.2 GB here)
    # is the same under both policies
    assert full.step_time_s > none.step_time_s and full.memory.activations < none.memory.activations / 3
    # the recomputed forward is one more forward of every block
    assert full.time.recompute == pytest.approx(none.time.compute / 3, rel=0.25)


def test_mfu_definition():
    c = ParallelConfig(dp=8, tp=1, pp=1, zero=1, micro_batch=1, num_microbatches=8)
    e = estimate(GRAPH, CLUSTER, WORK, c)
    flops = GRAPH.model_flops_per_token(4096) * 64 * 4096
    assert e.mfu == pytest.approx(flops / e.step_time_s / 8 / 989.4e12)
    assert e.tokens_per_s == pytest.approx(64 * 4096 / e.step_time_s)


def test_zero3_shards_states_over_dp():
    c = ParallelConfig(dp=8, tp=1, pp=1, zero=0, micro_batch=1, num_microbatches=8)
    z0 = estimate(GRAPH, CLUSTER, WORK, c).memory
    z3 = estimate(GRAPH, CLUSTER, WORK, replace(c, zero=3)).memory
    assert z3.optimizer == pytest.approx(z0.optimizer / 8)
    assert z0.params + z0.grads + z0.optimizer == pytest.approx(18 * GRAPH.num_params, rel=1e-9)


@pytest.mark.parametrize("model,cluster", [("gpt3-175b", "a100-80g"), ("llama3-8b", "h100-80g"),
                                           ("mixtral-8x7b", "h200")])
def test_work_floor_is_linear_and_below_the_layer_time(model, cluster):
    """The search orders and prunes layouts by k x (floor at micro-batch 1): it must never exceed
    the priced forward + backward at micro-batch k, and must not be vacuous."""
    from planner.cost.layer import Context, layer_cost
    graph = build_layer_graph(ZOO[model])
    c = load_cluster(cluster, 16)
    for layer in graph.layers:
        for tp, cp, sp in [(1, 1, False), (2, 1, True), (8, 1, False), (4, 2, True)]:
            def ctx(mb):
                return Context(micro_batch=mb, seq_len=2048, tp=tp, cp=cp, sequence_parallel=sp, precision="bf16",
                               attention="flash", framework="megatron", tp_comm_overlap=False)
            one = layer_cost(layer, ctx(1), c).work_floor_s
            for k in (1, 2, 3, 5, 8):
                cost = layer_cost(layer, ctx(k), c)
                assert cost.work_floor_s == pytest.approx(k * one, rel=1e-9)
                assert k * one <= (cost.fwd_s + cost.bwd_s) * (1 + 1e-12)      # equal for memory-bound layers
            if layer.is_block and tp <= 2:
                assert cost.work_floor_s > 0.5 * (cost.fwd_s + cost.bwd_s)


def test_processes_beyond_the_cores_time_share_them():
    """cpu-gloo is 2 cores (profiles/cpu-gloo.toml [host] cores): 4 one-thread processes get half a
    core each, so every layer runs 2x as long as with 2 processes and gloo moves half as fast;
    GPU profiles have no cores to share."""
    from planner.cost.layer import Context, layer_cost
    graph = build_layer_graph(ZOO["llama2-7b"])
    ctx = Context(micro_batch=1, seq_len=256, tp=1, cp=1, sequence_parallel=False, precision="fp32",
                  attention="flash", framework="torch", tp_comm_overlap=False)
    two, four, eight = (load_cluster("cpu-gloo", n) for n in (2, 4, 8))
    assert (two.time_share, four.time_share, eight.time_share) == (1.0, 0.5, 0.25)
    block = graph.layers[1]
    base = layer_cost(block, ctx, two)
    for cluster, factor in ((four, 2.0), (eight, 4.0)):
        cost = layer_cost(block, ctx, cluster)
        assert cost.fwd_s == pytest.approx(factor * base.fwd_s, rel=1e-9)
        assert cost.bwd_s == pytest.approx(factor * base.bwd_s, rel=1e-9)
        assert cluster.intra.bytes_per_s == pytest.approx(two.intra.bytes_per_s / factor)
    assert eight.with_gpus(2).device.peak("fp32") == two.device.peak("fp32")      # back to alone
    gpu = load_cluster("a100-80g", 1024)
    assert gpu.time_share == 1.0 and gpu.with_gpus(8).device == gpu.device


def test_torch_offload_copies_every_microbatch_under_fsdp_and_once_under_zero1():
    """Offloaded, the torch runtime copies per local parameter: FSDP2 (ZeRO-3) the fp32 shard up
    before the forward and the backward all-gathers and the fp32 gradient shard down, 4 + 4 + 4 bytes
    every micro-batch; ZeRO-1's sharded AdamW gradient rows down, parameter rows down and up, 12 bytes
    once a step (planner/runtimes.py). Doubling the micro-batches adds 8 x 12 bytes per local
    parameter under ZeRO-3 and nothing under ZeRO-1, beyond what it adds without offload."""
    from planner.cost.step import CostCache, optimizer_time_s
    from planner.network import host_transfer_s
    params = 1e9
    work = replace(WORK, framework="torch", precision="fp32")
    extra = {}
    for zero in (1, 3):
        seconds = {}
        for offload in (False, True):
            for m in (8, 16):
                c = ParallelConfig(dp=8, tp=1, pp=1, zero=zero, micro_batch=1, num_microbatches=m,
                                   optimizer_offload=offload)
                cache = CostCache(GRAPH, CLUSTER, replace(work, global_batch=8 * m))
                seconds[offload, m] = optimizer_time_s(cache, c, params)
        extra[zero] = (seconds[True, 16] - seconds[True, 8]) - (seconds[False, 16] - seconds[False, 8])
    assert extra[3] == pytest.approx(host_transfer_s(CLUSTER, params / 8 * 12 * 8))
    assert extra[1] == pytest.approx(0.0, abs=1e-12)


def test_megatron_2021_waits_for_every_interleaved_send():
    """Megatron-LM of 2021 waits on each stage-boundary exchange (p2p_communication.py ``_communicate``: wait on
    every request, then torch.cuda.synchronize()), so an interleaved rank pays all 2 v sends per micro-batch, and the
    fill and drain add no hop beyond them; today's Megatron-LM posts them beside compute (overlap_p2p_comm)."""
    from planner import network
    from planner.cost.step import CostCache, fill_hop_s, rank_costs, sends_overlap
    from planner.network import fabric
    graph = build_layer_graph(ZOO["gpt-1.7b"])          # hidden 2304, 24 blocks
    cluster = load_cluster("a100-80g", 32)
    c = ParallelConfig(dp=1, tp=8, pp=4, micro_batch=2, num_microbatches=8, schedule="interleaved-1f1b", vpp=2,
                       recompute="full")
    work = Workload(global_batch=16, seq_len=2048, precision="fp16", framework="megatron-2021", attention="unfused")
    # one hop: micro-batch 2 x 2048 tokens x 2304 x 2 bytes, 1/8 of it per TP rank (scatter/gather, Narayanan et
    # al. 2021 Sec 4.1), across nodes (tp 8 fills a node)
    f = fabric(cluster)
    hop = 2 * 2048 * 2304 * 2 / 8 / f.net_bytes_per_s + f.net_latency_s
    old = CostCache(graph, cluster, work)
    assert old.hop_s(c) == pytest.approx(hop) == network.p2p_s(cluster, 2 * 2048 * 2304 * 2 / 8, same_node=False)
    assert not sends_overlap("interleaved-1f1b", "megatron-2021") and sends_overlap("interleaved-1f1b", "megatron")
    assert [r.p2p_s for r in rank_costs(old, c)] == pytest.approx([2 * 2 * hop] * 4)
    assert fill_hop_s(old, c) == 0.0
    new = CostCache(graph, cluster, replace(work, framework="megatron"))
    assert [r.p2p_s for r in rank_costs(new, c)] == [0.0] * 4      # a chunk's compute hides its send
    assert fill_hop_s(new, c) == pytest.approx(hop)
