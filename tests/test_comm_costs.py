"""Communication and optimizer terms of the cost model against hand-computed values."""
from dataclasses import replace

import pytest

from planner.cluster import load_cluster
from planner.config import ParallelConfig, Workload
from planner.cost.compute import flash_attention_s
from planner.cost.layer import Context, layer_cost
from planner.cost.step import ADAM_BYTES_PER_PARAM, CostCache, RankCost, _dp_comm, _optimizer_s, rank_costs
from planner.layers import build_layer_graph
from planner.model import ZOO
from planner.network import Group, all_gather_s, all_reduce_s, p2p_s, reduce_scatter_s

A100 = load_cluster("a100-80g", 64)
SPEC = ZOO["gpt-7.5b"]                      # h 4096
GRAPH = build_layer_graph(SPEC)
BLOCK = GRAPH.layers[1]
TOKENS, H = 2 * 2048, 4096


def ctx(**kw):
    base = dict(micro_batch=2, seq_len=2048, tp=8, cp=1, sequence_parallel=False, precision="bf16",
                attention="flash", framework="megatron", tp_comm_overlap=False)
    base.update(kw)
    return Context(**base)


def test_block_tp_comm_is_two_all_reduces_each_way():
    one = all_reduce_s(A100, TOKENS * H * 2, Group(8, 8))
    assert layer_cost(BLOCK, ctx(), A100).tp_comm_s == pytest.approx(4 * one)


def test_sequence_parallel_turns_each_all_reduce_into_rs_plus_ag():
    one = reduce_scatter_s(A100, TOKENS * H * 2, Group(8, 8)) + all_gather_s(A100, TOKENS * H * 2, Group(8, 8))
    assert layer_cost(BLOCK, ctx(sequence_parallel=True), A100).tp_comm_s == pytest.approx(4 * one)


def test_tp_comm_overlap_exposes_what_the_gemms_cannot_hide():
    plain = layer_cost(BLOCK, ctx(), A100)
    overlapped = layer_cost(BLOCK, ctx(tp_comm_overlap=True), A100)
    # the GEMMs of a 7.5B block at tp 8 take longer than its collectives: one chunk in 8 stays
    assert overlapped.tp_comm_s == pytest.approx(plain.tp_comm_s / 8)


def test_context_parallel_ring_exchange_overlaps_attention():
    c = layer_cost(BLOCK, ctx(tp=1, cp=2), A100)
    # K and V of one rank: b * s/cp * 2 * kv_heads * d * 2 bytes, sent cp - 1 = 1 time over NVLink
    comm = p2p_s(A100, 2 * 1024 * 2 * 32 * 128 * 2, same_node=True)
    # causal flash attention of 1024 queries against 2048 keys, 32 heads of 128, batch 2
    fwd = 4 * 2 * 32 * 1024 * 2048 * 128 / 2 / (312e12 * 0.60)
    bwd = 2.5 * fwd
    # each ring step hides behind the attention of one block: (cp - 1)/cp of the kernel
    expected = max(0, comm - fwd / 2) + max(0, 2 * comm - bwd / 2)
    assert c.cp_comm_s == pytest.approx(expected)
    assert 0 < c.cp_comm_s < 2 * comm


def test_context_parallel_all_gather_exchange_is_exposed_and_keeps_the_whole_sequence():
    """meshplan's executor (runtime torch) all-gathers K and V before attention and reduce-scatters
    their gradients after it (executor/context.py): nothing overlapped."""
    ring, gathered = layer_cost(BLOCK, ctx(tp=2, cp=4), A100), layer_cost(BLOCK, ctx(tp=2, cp=4, framework="torch"),
                                                                             A100)
    # the whole sequence's K and V: b * s * 2 (K and V) * kv_heads / tp * d * 2 bytes; cp ranks 2 apart
    whole = 2 * 2048 * 2 * (32 // 2) * 128 * 2
    grp = Group(4, 4)                       # 4 ranks spaced 2 apart: all in one 8-GPU node
    assert gathered.cp_comm_s == pytest.approx(all_gather_s(A100, whole, grp) + reduce_scatter_s(A100, whole, grp))
    # it keeps the other ranks' 3/4 of K and V for backward: more saved bytes than the ring
    assert gathered.policy("none").act_bytes - ring.policy("none").act_bytes == pytest.approx(whole * 3 / 4)


def test_no_tp_no_comm():
    assert layer_cost(BLOCK, ctx(tp=1), A100).tp_comm_s == 0.0


WORK = Workload(global_batch=64, seq_len=2048, framework="megatron", overlap_grad_reduce=False)
CACHE = CostCache(GRAPH, A100, WORK)


def fake_rank(params=1e9, layers=10):
    """A rank of ten identical layers, one data-parallel collective each."""
    return RankCost(fwd_s=1.0, bwd_s=2.0, recompute_s=0.0, tp_comm_s=0.0, cp_comm_s=0.0, p2p_s=0.0, act_bytes=0.0,
                    peak_extra_bytes=0.0, params=params, matmul_flops=0.0, num_layers=layers,
                    buckets=(((params / layers, 0.0), layers),), first_bucket=(params / layers, 0.0))


def buffer_per_tp_rank(graph, tp: int) -> float:
    """The parameters one of ``tp`` ranks holds, from the layers' own counts: the replicated ones whole, the rest
    split (no experts here)."""
    return sum(layer.params_replicated + (layer.params - layer.params_replicated) / tp for layer in graph.layers)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_comm_per_zero_stage(zero):
    """Without --overlap-grad-reduce Megatron-LM reduces each model chunk's whole buffer in one call (ZeRO-0's
    all-reduce, the distributed optimizer's reduce-scatter and its gather back): a layer of 1e8 parameters pays
    1e8 / B of the call over the rank's B (no pipeline: the whole model's, per TP rank); Megatron-FSDP (ZeRO-2/3)
    a layer at a time."""
    config = ParallelConfig(dp=8, tp=8, pp=1, zero=zero, micro_batch=1, num_microbatches=4)
    grp = Group(8, 1)                         # tp 8 fills the node: DP peers one per node
    whole = buffer_per_tp_rank(GRAPH, 8)
    assert whole > 1e8
    share = 1e8 / whole                       # megatron reduces bf16's fp32 main gradients
    ar, rs, ag = (10 * share * f(A100, whole * b, grp) for f, b in
                  ((all_reduce_s, 4), (reduce_scatter_s, 4), (all_gather_s, 2)))
    rs_layer, ag_layer = (10 * f(A100, 1e8 * b, grp) for f, b in ((reduce_scatter_s, 4), (all_gather_s, 2)))
    expected = {0: ar, 1: rs + ag, 2: 4 * rs_layer + ag_layer, 3: 4 * (2 * ag_layer + rs_layer)}[zero]
    total, exposed = _dp_comm(CACHE, config, fake_rank())
    assert total == pytest.approx(expected)
    assert exposed == pytest.approx(expected)        # this workload does not overlap


def test_megatron_of_2021_all_reduces_each_chunks_buffer_in_one_call_with_its_local_ddp():
    """Megatron-LM of 2021's local DDP (--DDP-impl local, its default; megatron/model/distributed.py
    allreduce_gradients, for each model chunk after the backward), --no-overlap-grad-reduce here, all-reduces a
    chunk's contiguous buffer at once: on 2 stages of 2 chunks each, a chunk holds a quarter of the model's
    parameters per TP rank (the stages priced as even), and a layer pays its share of that call."""
    cache = CostCache(GRAPH, A100, replace(WORK, framework="megatron-2021", overlap_grad_reduce=False))
    config = ParallelConfig(dp=8, tp=8, pp=2, vpp=2, zero=0, micro_batch=1, num_microbatches=4,
                            schedule="interleaved-1f1b")
    chunk = buffer_per_tp_rank(GRAPH, 8) / 4
    expected = 10 * 1e8 / chunk * all_reduce_s(A100, chunk * 4, Group(8, 1))
    assert _dp_comm(cache, config, fake_rank())[0] == pytest.approx(expected)


def test_megatron_of_2021_overlapping_its_reduction_is_torch_ddp_in_25_mib_buckets():
    """--DDP-impl torch (training.py wraps each chunk in torch's DistributedDataParallel), --overlap-grad-reduce
    here: buckets of bucket_cap_mb = 25 MiB of gradients, each closed once a gradient takes it to the size
    (reducer.cpp compute_bucket_assignment_by_size): 4-byte gradients make buckets of 6,553,600 parameters, so a
    layer of 1e8 parameters is 15 buckets (15 x 6,553,600 = 98,304,000 <= 1e8 < 16 x), all-reduced one by one."""
    cache = CostCache(GRAPH, A100, replace(WORK, framework="megatron-2021", overlap_grad_reduce=True))
    config = ParallelConfig(dp=8, tp=8, pp=1, zero=0, micro_batch=1, num_microbatches=4)
    bucket = 25 * 2**20 / 4
    assert 15 * bucket <= 1e8 < 16 * bucket
    expected = 10 * 15 * all_reduce_s(A100, 1e8 / 15 * 4, Group(8, 1))
    assert _dp_comm(cache, config, fake_rank())[0] == pytest.approx(expected)


@pytest.mark.parametrize("precision, grad_bytes", [("bf16", 4), ("fp16", 2)])
def test_megatron_reduces_gradients_in_their_buffer_dtype(precision, grad_bytes):
    """Megatron-LM accumulates and reduces bf16 gradients in fp32 (arguments.py sets
    accumulate_allreduce_grads_in_fp32 under --bf16) and fp16 ones in fp16 (the grad buffer takes the
    parameters' dtype): ZeRO-0's all-reduce moves 4 or 2 bytes a parameter."""
    cache = CostCache(GRAPH, A100, replace(WORK, precision=precision))
    config = ParallelConfig(dp=8, tp=8, pp=1, zero=0, micro_batch=1, num_microbatches=4)
    whole = buffer_per_tp_rank(GRAPH, 8)       # one call for the buffer, this workload not overlapping
    expected = 10 * 1e8 / whole * all_reduce_s(A100, whole * grad_bytes, Group(8, 1))
    assert _dp_comm(cache, config, fake_rank())[0] == pytest.approx(expected)


def test_overlapped_all_reduce_hides_behind_backward():
    cache = CostCache(GRAPH, A100, replace(WORK, overlap_grad_reduce=True))
    config = ParallelConfig(dp=8, tp=8, pp=1, zero=0, micro_batch=1, num_microbatches=4)
    total, exposed = _dp_comm(cache, config, fake_rank())
    # shorter than the 2 s backward: the first layer's bucket stays exposed, plus the SMs all of it takes
    assert total < 2.0
    assert exposed == pytest.approx(total / 10 + A100.comm_sm_fraction * total)
    assert A100.comm_sm_fraction == pytest.approx(16 / 108)


def test_interleaving_widens_the_window_of_the_gradient_reduction():
    """ZeRO-0's all-reduce of 3e10 parameters (4 bytes each: longer than any window here) beside the last
    micro-batch's 2 s backward under 1F1B; under the interleaved schedule (pp 2, 4 chunks) the chunks finish one
    after another, so all but the last chunk's reductions also run beside the group's other micro-batch:
    2 (1 + (2 - 1) 3 / 4) = 3.5 s. The memo keeps the two apart (the same rank, one cache). The interleaved
    schedule's sends run beside compute and its stages sit on other nodes (8 x 8 GPUs a stage): in each backward
    a rank sends one hop per chunk over the NICs the data-parallel ring crosses, which widens the window by less
    (cost.step.network_busy_s); 1F1B's sends block, outside the window."""
    cache = CostCache(GRAPH, A100, replace(WORK, overlap_grad_reduce=True))
    rank = fake_rank(params=3e10)
    flat = ParallelConfig(dp=8, tp=8, pp=2, zero=0, micro_batch=1, num_microbatches=4, schedule="1f1b")
    chunked = replace(flat, vpp=4, schedule="interleaved-1f1b")
    total, plain = _dp_comm(cache, flat, rank)
    assert total > 3.5
    _, interleaved = _dp_comm(cache, chunked, rank)
    # longer than the window: the step waits for the reduction alone, the compute it slows ending first
    assert plain == pytest.approx(total - 2.0)
    busy = 4 * cache.hop_s(chunked) * 1.75               # four chunks' sends, in the widened backward window
    assert busy > 0
    assert interleaved == pytest.approx(total - (3.5 - busy))


def test_collectives_that_share_the_nics_take_turns_on_them():
    """What of 1.0 s of overlapped collectives a 0.8 s window hides when other traffic holds the same NICs for
    0.3 s of it: 0.5 s; 0.5 s exposed (the compute they slow by their SMs, 10% of 1.0 s, ends first). Without the
    other traffic: 0.2 s. Never less than the last collective with that slowdown (0.6 + 0.1 s here); under the
    window, the last one and the slowdown (0.1 + 0.05 s for 0.5 s of collectives)."""
    from planner.cost.step import exposed_s
    assert exposed_s(1.0, 0.8, 0.1, contention=0.1, busy=0.3) == pytest.approx(0.5)
    assert exposed_s(1.0, 0.8, 0.1, contention=0.1) == pytest.approx(0.2)
    assert exposed_s(1.0, 0.8, 0.6, contention=0.1, busy=0.3) == pytest.approx(0.7)
    assert exposed_s(0.5, 0.8, 0.1, contention=0.1) == pytest.approx(0.15)


def test_only_inter_node_traffic_on_the_data_parallel_nics_counts():
    """``network_busy_s``: nothing where the data-parallel group stays in a node (dp 4 x tp 2 on one node of 8),
    and where it crosses nodes, the expert all-to-alls only where the expert group crosses them too (ep 8 in a
    node: nothing; ep 16 over two nodes: each MoE layer's all-to-all time, split between forward and backward as
    the layer's time is)."""
    from planner.cost.step import network_busy_s
    spec = ZOO["mixtral-8x7b"]
    graph = build_layer_graph(replace(spec, num_layers=2, num_experts=16))
    cluster = load_cluster("h100-80g", 32)
    cache = CostCache(graph, cluster, Workload(global_batch=64, seq_len=4096, framework="torch"))
    inside = ParallelConfig(dp=4, tp=2, pp=1, ep=1, zero=1, micro_batch=1, num_microbatches=16)
    assert network_busy_s(cache, inside, rank_costs(cache, inside)[0]) == (0.0, 0.0)
    in_node = ParallelConfig(dp=32, tp=1, pp=1, ep=8, zero=1, micro_batch=1, num_microbatches=2)
    assert network_busy_s(cache, in_node, rank_costs(cache, in_node)[0]) == (0.0, 0.0)
    across = replace(in_node, ep=16)
    rank = rank_costs(cache, across)[0]
    fwd, bwd = network_busy_s(cache, across, rank)
    assert rank.ep_comm_s > 0
    assert fwd + bwd == pytest.approx(rank.ep_comm_s)
    assert 0 < fwd < bwd


def test_optimizer_step_streams_adam_state():
    config = ParallelConfig(dp=8, tp=8, pp=1, zero=1, micro_batch=1, num_microbatches=4)
    seconds, host = _optimizer_s(CACHE, config, fake_rank())
    assert seconds == pytest.approx(1e9 / 8 * ADAM_BYTES_PER_PARAM / (2039e9 * 0.9))
    assert host == 0


def test_cpu_optimizer_step_at_the_measured_adamw_rate():
    """cpu-gloo: the executor's AdamW loop measured at 3.87 GB/s at 28 B per parameter ([gpu.kernels]
    optimizer_GBps), not the 54 GB/s memory stream; 8 processes on 2 cores get a quarter of it each."""
    cpu = load_cluster("cpu-gloo", 2)
    cache = CostCache(GRAPH, cpu, replace(WORK, precision="fp32", framework="torch"))
    config = ParallelConfig(dp=2, tp=1, pp=1, zero=0, micro_batch=1, num_microbatches=1)
    seconds, _ = _optimizer_s(cache, config, fake_rank(params=1e6))
    assert seconds == pytest.approx(1e6 * 28 / 3.87e9)
    crowded = CostCache(GRAPH, load_cluster("cpu-gloo", 8), replace(WORK, precision="fp32", framework="torch"))
    config8 = replace(config, dp=8)
    assert _optimizer_s(crowded, config8, fake_rank(params=1e6))[0] == pytest.approx(4 * 1e6 * 28 / 3.87e9)


def test_offloaded_optimizer_runs_on_the_host():
    config = ParallelConfig(dp=8, tp=8, pp=1, zero=1, micro_batch=1, num_microbatches=4, optimizer_offload=True)
    seconds, host = _optimizer_s(CACHE, config, fake_rank())
    local = 1e9 / 8
    cpu = 8 * local * ADAM_BYTES_PER_PARAM / (409.6e9 * 0.5)         # 8 GPUs share the host DRAM
    pcie = local * (4 + 2) / (25e9 / 2)     # grads down, params up; two GPUs per PCIe switch uplink
    assert seconds == pytest.approx(cpu + pcie)
    assert host == pytest.approx(8 * 1e9 * 12 / 8)                  # fp32 master + Adam, sharded over 8


def test_torch_pipeline_defers_the_sharded_reduction_to_after_the_last_backward():
    """torch pipelining with FSDP ZeRO-3: the parameters are gathered before every micro-batch's backward and stay
    gathered into the next forward (reshard_after_backward False: counted on gloo in
    tests/test_pipeline_fsdp_calls.py), the first forward's gather priced once a step; the gradients
    reduce-scattered once after the last backward, with nothing beside it: exposed whole, where without a pipeline
    each micro-batch's reduce-scatter overlaps backward."""
    from planner.cost.step import dp_collectives
    cache = CostCache(GRAPH, A100, replace(WORK, framework="torch", precision="bf16"))
    config = ParallelConfig(dp=4, tp=8, pp=2, zero=3, micro_batch=1, num_microbatches=4)
    grp, params = Group(4, 1), 1e8                # tp 8 fills the node: DP peers one per node
    ag = all_gather_s(A100, params * 2, grp)      # bf16 parameters
    rs = reduce_scatter_s(A100, params * 4, grp)  # torch reduces in fp32
    assert dp_collectives(cache, config, params) == pytest.approx((ag, rs, ag))
    assert dp_collectives(cache, replace(config, pp=1), params) == pytest.approx((2 * ag + rs, 0.0, 0.0))
    total, exposed = _dp_comm(cache, config, fake_rank(params=params, layers=1))
    assert total == pytest.approx(4 * ag + rs + ag)
    assert exposed >= rs                          # the deferred reduction hides behind nothing


def test_pipeline_sends_are_exposed_in_1f1b():
    config = ParallelConfig(dp=2, tp=8, pp=4, zero=1, micro_batch=1, num_microbatches=8)
    ranks = rank_costs(CACHE, config)
    hop = p2p_s(A100, 2048 * H * 2 / 8, same_node=False)      # megatron scatter/gather: 1/tp per rank
    assert all(r.p2p_s == pytest.approx(2 * hop) for r in ranks)
    assert CACHE.hop_s(config) == pytest.approx(hop)


@pytest.mark.parametrize("framework, device, zero, tp, expected", [
    ("torch", "cuda", 2, 1, (True, True)),      # FSDP2's collectives on their own CUDA streams
    ("torch", "cpu", 2, 1, (False, False)),     # ... on gloo they block the training thread
    ("torch", "cpu", 3, 1, (False, False)),
    ("torch", "cpu", 0, 1, (True, True)),       # DDP's all-reduce runs on gloo's own threads
    ("torch", "cpu", 0, 2, (False, False)),     # ZeRO-0 under TP is FSDP2's replicate
    ("torch", "cuda", 1, 1, (True, False)),     # meshplan's ZeRO-1 reduces in its optimizer step
    ("torch", "cpu", 1, 1, (True, False)),
    ("megatron", "cuda", 1, 1, (True, True)),   # --overlap-grad-reduce
    ("deepspeed", "cuda", 2, 1, (True, True)),
])
def test_which_data_parallel_collectives_run_beside_compute(framework, device, zero, tp, expected):
    from planner.cost.step import dp_overlaps
    assert dp_overlaps(framework=framework, device_kind=device, overlap_grad_reduce=True, zero=zero, dp=2, tp=tp,
                       pp=1) == expected
    assert dp_overlaps(framework=framework, device_kind=device, overlap_grad_reduce=False, zero=zero, dp=2, tp=tp,
                       pp=1) == (False, False)


def test_torch_zero1_reduces_after_backward_and_fsdp_on_a_cpu_exposes_everything():
    """meshplan's ZeRO-1 reduce-scatters in the optimizer step: the reduction is exposed whole, where
    Megatron's overlaps backward. FSDP2 on a CPU (gloo) blocks on each collective: nothing overlaps."""
    from planner.cost.step import dp_collectives
    cache = CostCache(GRAPH, A100, replace(WORK, framework="torch", precision="bf16", overlap_grad_reduce=True))
    config = ParallelConfig(dp=8, tp=8, pp=1, zero=1, micro_batch=1, num_microbatches=4)
    params = 1e9 / 10
    rs, ag = dp_collectives(cache, config, params)[1:]
    rank = fake_rank(params=1e9, layers=10)
    total, exposed = _dp_comm(cache, config, rank)
    assert total == pytest.approx(10 * (rs + ag))
    assert exposed == pytest.approx(10 * (rs + ag))           # both after backward, nothing beside them
    cpu = load_cluster("cpu-gloo", 2)
    cache = CostCache(GRAPH, cpu, replace(WORK, framework="torch", precision="fp32", overlap_grad_reduce=True))
    config = ParallelConfig(dp=2, tp=1, pp=1, zero=2, micro_batch=1, num_microbatches=4)
    total, exposed = _dp_comm(cache, config, rank)
    per_micro, once, after = dp_collectives(cache, config, params)
    assert total == pytest.approx(10 * (4 * per_micro + once + after)) and exposed == pytest.approx(total)


def test_ranks_wait_for_the_slowest_at_each_blocking_tp_collective():
    """[runtime] sync_wait_coefficient c: a block's forward is split by two TP all-reduces (and so is its
    backward); after t seconds of work each waits c sqrt(t) for the rank behind. Without TP nothing waits."""
    import math
    cpu = load_cluster("cpu-gloo", 2)
    c = ctx(framework="torch", precision="fp32", tp=2, micro_batch=1, seq_len=256)
    steady = layer_cost(BLOCK, c, cpu)
    jittery = layer_cost(BLOCK, c, replace(cpu, sync_wait_coefficient=0.01))
    fwd = steady.fwd_s - steady.tp_comm_s / 2        # the layer's forward work (its all-reduces: half each way)
    bwd = steady.bwd_s - steady.tp_comm_s / 2
    assert steady.tp_comm_s > 0
    wait = 2 * 0.01 * math.sqrt(fwd / 2) + 2 * 0.01 * math.sqrt(bwd / 2)
    assert jittery.tp_comm_s == pytest.approx(steady.tp_comm_s + wait, rel=1e-6)
    alone = ctx(framework="torch", precision="fp32", tp=1, micro_batch=1, seq_len=256)
    assert layer_cost(BLOCK, alone, replace(cpu, sync_wait_coefficient=0.01)) == layer_cost(BLOCK, alone, cpu)


def test_a_tensor_parallel_block_in_torch_eager_pays_the_measured_host_time_of_dtensor():
    """[gpu.kernels] tp_block_overhead_us = [forward, backward]: added once per TP block and micro-batch,
    forward and backward, to its TP time; not to other layers, not without TP, not to Megatron's runtime."""
    cpu = load_cluster("cpu-gloo", 2)
    slow = replace(cpu, device=replace(cpu.device, tp_block_overhead_s=(0.005, 0.0125)))
    c = ctx(framework="torch", precision="fp32", tp=2, micro_batch=1, seq_len=256)
    base, paid = layer_cost(BLOCK, c, cpu), layer_cost(BLOCK, c, slow)
    assert paid.fwd_s == pytest.approx(base.fwd_s + 0.005, rel=1e-9)
    assert paid.bwd_s == pytest.approx(base.bwd_s + 0.0125, rel=1e-9)
    assert paid.tp_comm_s == pytest.approx(base.tp_comm_s + 0.0175, rel=1e-9)
    head = GRAPH.layers[-1]
    assert head.kind != "block" and layer_cost(head, c, slow) == layer_cost(head, c, cpu)
    alone = ctx(framework="torch", precision="fp32", tp=1, micro_batch=1, seq_len=256)
    assert layer_cost(BLOCK, alone, slow) == layer_cost(BLOCK, alone, cpu)
    megatron = ctx(framework="megatron", precision="fp32", tp=2, micro_batch=1, seq_len=256)
    assert layer_cost(BLOCK, megatron, slow) == layer_cost(BLOCK, megatron, cpu)
    # four processes on two cores: each gets half a core, the host time doubles (Cluster.with_gpus)
    shared = replace(slow, cores_per_node=2, gpus_per_node=4, threads_per_process=1).with_gpus(4)
    assert shared.device.tp_block_overhead_s == pytest.approx((0.01, 0.025))


def test_gloo_gathers_and_scatters_at_their_own_measured_bus_bandwidth():
    """[intra_node] all_gather_busbw_ratio / reduce_scatter_busbw_ratio: inside a node each runs at its
    ratio of the all-reduce bus bandwidth (link_GBps); across nodes the ratios do not apply."""
    cpu = load_cluster("cpu-gloo", 2)
    slow = replace(cpu, intra_all_gather_ratio=0.5, intra_reduce_scatter_ratio=0.25)
    grp, nbytes = Group(2, 2), 2**24
    bw = cpu.intra.bytes_per_s * cpu.intra.efficiency
    latency = cpu.intra.latency_s
    assert all_gather_s(cpu, nbytes, grp) == pytest.approx(0.5 * nbytes / bw + latency)
    assert all_gather_s(slow, nbytes, grp) == pytest.approx(0.5 * nbytes / (0.5 * bw) + latency)
    assert reduce_scatter_s(slow, nbytes, grp) == pytest.approx(0.5 * nbytes / (0.25 * bw) + latency)
    a100 = replace(A100, intra_all_gather_ratio=0.5)
    across = Group(8, 1)
    assert all_gather_s(a100, nbytes, across) == pytest.approx(all_gather_s(A100, nbytes, across))


def test_megatron_overlapping_its_reduction_issues_it_in_its_buckets():
    """With --overlap-grad-reduce Megatron-Core fills buckets of max(4e7, 1e6 x dp) parameters until each holds at
    least that many (core_r0.8.0 distributed_data_parallel.py): on dp 8, a layer of 1e8 parameters is two buckets of
    5e7, its ZeRO-1 reduce-scatter and all-gather two collectives each; a layer of 1e7 is a quarter of a bucket."""
    cache = CostCache(GRAPH, A100, replace(WORK, overlap_grad_reduce=True))
    config = ParallelConfig(dp=8, tp=8, pp=1, zero=1, micro_batch=1, num_microbatches=4)
    grp = Group(8, 1)
    big = 2 * (reduce_scatter_s(A100, 5e7 * 4, grp) + all_gather_s(A100, 5e7 * 2, grp))
    assert _dp_comm(cache, config, fake_rank())[0] == pytest.approx(10 * big)
    small = (reduce_scatter_s(A100, 4e7 * 4, grp) + all_gather_s(A100, 4e7 * 2, grp)) / 4
    assert _dp_comm(cache, config, fake_rank(params=1e8))[0] == pytest.approx(10 * small)


def test_deepspeed_and_meshplans_zero1_close_a_bucket_before_it_overflows():
    """DeepSpeed's ZeRO-1/2 buckets of reduce_bucket_size (5e8) parameters and meshplan's ZeRO-1 of 25 MiB of
    gradients (executor/zero1.py) never exceed their size: a layer of 1.2e9 parameters is three buckets under
    DeepSpeed, and 4-byte gradients of 1e7 parameters are two buckets of 5e6 under meshplan's ZeRO-1."""
    config = ParallelConfig(dp=8, tp=8, pp=1, zero=1, micro_batch=1, num_microbatches=4)
    grp = Group(8, 1)
    ds = CostCache(GRAPH, A100, replace(WORK, framework="deepspeed", precision="fp16", overlap_grad_reduce=True))
    three = 3 * (reduce_scatter_s(A100, 4e8 * 2, grp) + all_gather_s(A100, 4e8 * 2, grp))
    assert _dp_comm(ds, config, fake_rank(params=1.2e10))[0] == pytest.approx(10 * three)
    torch = CostCache(GRAPH, A100, replace(WORK, framework="torch", overlap_grad_reduce=True))
    bucket = 25 * 2**20 / 4                    # fp32 gradients
    assert bucket < 1e7 <= 2 * bucket
    two = 2 * (reduce_scatter_s(A100, 5e6 * 4, grp) + all_gather_s(A100, 5e6 * 4, grp))
    assert _dp_comm(torch, config, fake_rank(params=1e8))[0] == pytest.approx(10 * two)


def test_deepspeed_zero3_reduces_in_buckets_but_gathers_a_layer_at_a_time():
    """Today's DeepSpeed ZeRO-3 fills the same reduce_bucket_size buckets (stage3.py, one reduce_scatter_coalesced
    a bucket) and gathers each module's parameters when it runs: a layer of 1.2e9 parameters reduce-scatters in
    three buckets of 4e8 and gathers at once, for forward and again for backward, every micro-batch."""
    config = ParallelConfig(dp=8, tp=8, pp=1, zero=3, micro_batch=1, num_microbatches=4)
    grp = Group(8, 1)
    ds = CostCache(GRAPH, A100, replace(WORK, framework="deepspeed", precision="fp16", overlap_grad_reduce=True))
    layer = 3 * reduce_scatter_s(A100, 4e8 * 2, grp) + 2 * all_gather_s(A100, 1.2e9 * 2, grp)
    assert _dp_comm(ds, config, fake_rank(params=1.2e10))[0] == pytest.approx(4 * 10 * layer)


def test_megatron_prices_attention_at_cudnns_fused_kernel_where_the_profile_characterises_it():
    """TransformerEngine runs cuDNN's fused flash kernel on Hopper (planner/runtimes.py attention_kernel): the same
    block under Megatron-LM and under Megatron-LM of 2021 (no TransformerEngine) differs by the attention kernel alone;
    on an A100 profile, which does not characterise cuDNN's kernels, not at all."""
    h100 = load_cluster("h100-80g", 8)
    assert SPEC.dropout                     # GPT-7.5B as Megatron-LM trains it: attention dropout 0.1
    args = (2, 32, 2048, 2048, 128, h100.device, "bf16")
    fused = flash_attention_s(*args, fused=True, dropout=True)
    plain = flash_attention_s(*args)
    now, then = (layer_cost(BLOCK, ctx(tp=1, framework=f), h100) for f in ("megatron", "megatron-2021"))
    assert then.fwd_s - now.fwd_s == pytest.approx(plain[0] - fused[0], rel=1e-9)
    assert then.bwd_s - now.bwd_s == pytest.approx(plain[1] - fused[1], rel=1e-9)
    now, then = (layer_cost(BLOCK, ctx(tp=1, framework=f), A100) for f in ("megatron", "megatron-2021"))
    assert (now.fwd_s, now.bwd_s) == (then.fwd_s, then.bwd_s)


def test_meshplans_executor_prices_attention_at_cudnns_fused_kernel_and_torchtitans_published_runs_do_not():
    """torch 2.13's SDPA puts cuDNN first on Hopper (the executor's runtime); torchtitan's published runs ran before it
    did: the same block differs by the attention kernel alone."""
    h100 = load_cluster("h100-80g", 8)
    args = (2, 32, 2048, 2048, 128, h100.device, "bf16")
    fused, plain = flash_attention_s(*args, fused=True, dropout=True), flash_attention_s(*args)
    now, then = (layer_cost(BLOCK, ctx(tp=1, framework=f, eager_regime="autocast"), h100)
                 for f in ("torch", "torchtitan"))
    assert then.fwd_s - now.fwd_s == pytest.approx(plain[0] - fused[0], rel=1e-9)
    assert then.bwd_s - now.bwd_s == pytest.approx(plain[1] - fused[1], rel=1e-9)


def test_each_pass_hides_only_its_own_collectives():
    """FSDP2's ZeRO-2 (meshplan's runtime) gathers each layer before every forward and reduce-scatters it after
    every backward. The gathers can hide only behind the forward, the reductions only behind the backward: ten
    layers whose gathers take 1.5x the forward leave the excess exposed even though the backward, five times longer,
    hides every reduction with room to spare. Per micro-batch: max(10 g - 1, g + k 10 g) + max(10 r - 5, r + k 10 r)
    for a layer's gather g and reduction r (the first layer's opens the forward and closes the backward), k the
    SMs' share the collectives take from the compute beside them."""
    from planner.cost.step import dp_phases
    cache = CostCache(GRAPH, A100, replace(WORK, framework="torch", overlap_grad_reduce=True))
    config = ParallelConfig(dp=64, tp=1, pp=1, zero=2, micro_batch=1, num_microbatches=4)
    per_param = dp_phases(cache, config, 1e9)[0] / 1e9      # seconds per parameter gathered, bandwidth-bound
    params = 1.5 / per_param                        # ten layers whose gathers take 1.5 s
    g, _, r = dp_phases(cache, config, params / 10)
    assert 10 * g == pytest.approx(1.5, rel=0.05) and 10 * r < 5.0
    rank = replace(fake_rank(params=params), fwd_s=1.0, bwd_s=5.0)
    k = A100.comm_sm_fraction
    expected = 4 * (max(10 * g - 1.0, g + k * 10 * g) + max(10 * r - 5.0, r + k * 10 * r))
    total, exposed = _dp_comm(cache, config, rank)
    assert total == pytest.approx(4 * 10 * (g + r))
    assert exposed == pytest.approx(expected)
    # one window of 6 s for both would have hidden the forward's excess in the backward's room
    assert exposed > 4 * max(10 * (g + r) - 6.0, g + r + k * 10 * (g + r)) + 0.3
