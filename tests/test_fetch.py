"""ZeRO-3 one tensor at a time (planner/cost/fetch.py): DeepSpeed v0.3.13-v0.4.2's fetches and gradient buckets,
by hand."""
import pytest

from planner.api import load_job
from planner.config import ParallelConfig
from planner.cost import fetch
from planner.cost.step import CostCache, estimate
from planner.layers import build_layer_graph
from planner.model import load_model
from planner import network
from planner.runtimes import RUNTIMES

H = 12288       # GPT-3 175B's width


def _block(model: str):
    graph = build_layer_graph(load_model(model))
    return graph, next(layer for layer in graph.layers if layer.kind == "block")


def test_a_gpt_block_is_six_modules_with_a_fused_qkv():
    graph, block = _block("gpt3-175b")
    assert fetch.submodules(block, 1, graph.hidden) == [
        (H, H),                         # input LayerNorm: weight, bias
        (3 * H * H, 3 * H),             # query_key_value: one weight, one bias
        (H * H, H),                     # output projection
        (H, H),                         # post-attention LayerNorm
        (4 * H * H, 4 * H),             # h -> 4h
        (4 * H * H, H)]                 # 4h -> h


def test_a_llama_block_keeps_q_k_v_apart_and_splits_under_tp():
    graph, block = _block("llama3-8b")
    h, kv, f = 4096, 1024, 14336
    assert fetch.submodules(block, 2, graph.hidden) == [
        (h,), (h * h / 2,), (h * kv / 2,), (h * kv / 2,), (h * h / 2,), (h,),
        (h * f / 2,), (h * f / 2,), (f * h / 2,)]


def test_reuse_distance_keeps_only_what_returns_within_the_limit():
    subs = [(10.0,), (5.0, 5.0), (100.0,)]
    # between a module's recomputed forward and its backward: the modules after it, forward and backward
    assert fetch.kept_for_backward(subs, 25) == [False, False, True]          # 220, 200, 0
    assert fetch.kept_for_backward(subs, 201) == [False, True, True]
    assert fetch.kept_for_backward(subs, 221) == [True, True, True]


@pytest.fixture(scope="module")
def two_nodes():
    """GPT-3 175B under DeepSpeed of 2021 on two DGX A100 (16 ranks, 8 per node)."""
    job = load_job("gpt3-175b", "a100-80g", gpus=16, global_batch=16, framework="deepspeed-2021", precision="fp16")
    return (job, CostCache(job.graph, job.cluster, job.workload), network.group(job.cluster, 16, 1),
            RUNTIMES["deepspeed-2021"].timing.zero3_per_tensor)


def test_one_gather_as_deepspeed_issues_it(two_nodes):
    job, cache, grp, spec = two_nodes
    x = 1e8                                           # 200 MB of fp16
    nbytes = 2e8
    hbm = 2039e9 * 0.90
    # NCCL's ring at Simple over 16 ranks on 2 nodes: 8.4 us base, 14 NVLink steps of 3.4 us, 1 network step of
    # 14 us; bus bandwidth: 8 ranks per node, each node's 8 NICs at 200 Gb/s x 0.9 = 180 GB/s
    ring = 8.4e-6 + 14 * 3.4e-6 + 14e-6 + 15 / 16 * nbytes / 180e9
    # zeros, the loop over 16 ranks, then 16 copy launches beside NCCL's gather and the copies on the GPU
    expected = nbytes / hbm + 16 * 2.7e-6 + max(16 * 6e-6, ring + 2 * nbytes / hbm)
    assert fetch.gather_s(cache, x, grp, spec) == pytest.approx(expected, rel=1e-9)
    # a tiny tensor: the host's launches decide
    small = 2 * 12288 / hbm + 16 * 2.7e-6 + 16 * 6e-6
    assert fetch.gather_s(cache, 12288, grp, spec) == pytest.approx(small, rel=0.02)


def test_a_recomputed_block_fetches_three_times_less_what_stays(two_nodes):
    _, cache, grp, spec = two_nodes
    _, block = _block("gpt3-175b")
    subs = fetch.submodules(block, 1, H)
    one = sum(fetch.gather_s(cache, x, grp, spec) for s in subs for x in s)
    last = sum(fetch.gather_s(cache, x, grp, spec) for x in subs[-1])       # 4h -> h: used again at once
    fwd, bwd, _ = fetch.layer_phases(cache, block, "full", 1, grp, spec, 2.0)
    assert fwd == pytest.approx(one) and bwd == pytest.approx(2 * one - last)
    fwd, bwd, _ = fetch.layer_phases(cache, block, "none", 1, grp, spec, 2.0)
    assert fwd == pytest.approx(one) and bwd == pytest.approx(one)


def test_a_gradient_joins_the_open_bucket_unless_it_would_overflow_it():
    # 3 | 4 + 2 | 10, and the next layer's 3 closes the 10: the same three buckets every layer
    assert fetch.gradient_buckets([3.0, 4.0, 2.0, 10.0], 6.0) == [(3.0, 0.25), (6.0, 0.25), (10.0, 0.25)] * 4
    # layers smaller than a bucket share it: 25 layers of 2 fill 10 buckets of 5, 0.4 of one per layer
    small = fetch.gradient_buckets([1.0, 1.0], 5.0)
    assert small == [(5.0, 1 / 25)] * 10


def test_a_gpt_block_all_reduces_its_gradients_in_five_buckets(two_nodes):
    job, cache, grp, spec = two_nodes
    _, block = _block("gpt3-175b")
    hbm = 2039e9 * 0.90
    # backward order: fc2 (b, w), fc1 (b, w), LN2, proj, qkv, LN1; with 5e8 elements a bucket, every layer
    # after the first reduces 4h^2 | 4h | 4h^2 | LN2 + proj + qkv bias (6h + h^2) | qkv weight + LN1 + the next
    # layer's fc2 bias (3h^2 + 3h); played over 3 layers (10 buckets' worth), the first opens with fc2's bias
    # alone and the last closes on 3h^2 + 2h
    per_layer = [4 * H * H, 4 * H, 4 * H * H, 6 * H + H * H]
    run = [H] + per_layer + [3 * H * H + 3 * H] + per_layer + [3 * H * H + 3 * H] + per_layer + [3 * H * H + 2 * H]
    assert fetch.gradient_buckets([x for s in reversed(fetch.submodules(block, 1, H)) for x in reversed(s)],
                                  5e8) == [(y, 1 / 3) for y in run]
    # each: flattened, divided and copied back (three passes reading and writing 2 bytes an element) and
    # all-reduced
    expected = sum(3 * 2 * 2 * y / hbm + network.all_reduce_s(job.cluster, 2 * y, grp) for y in run) / 3
    assert fetch.layer_phases(cache, block, "none", 1, grp, spec, 2.0)[2] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("gpus", [384, 768, 1536])
def test_deepspeed_of_2021_is_slower_than_todays_and_falls_as_the_gpus_double(gpus):
    """Narayanan et al. SC'21 Table 2's shape: at a fixed global batch, per-GPU throughput of ZeRO-3 falls as
    the GPUs double, because every tensor's gather costs a host step per rank."""
    def tflops(framework: str, n: int) -> float:
        job = load_job("gpt3-175b", "a100-80g", gpus=n, global_batch=1536, framework=framework, precision="fp16")
        cfg = ParallelConfig(dp=n, tp=1, pp=1, zero=3, micro_batch=1536 // n, num_microbatches=1, recompute="full")
        return estimate(job.graph, job.cluster, job.workload, cfg).model_tflops_per_gpu
    assert tflops("deepspeed-2021", gpus) < tflops("deepspeed", gpus)
    if gpus > 384:
        assert tflops("deepspeed-2021", gpus) < tflops("deepspeed-2021", gpus // 2)


def test_a_gpt_block_holds_its_two_largest_modules_and_a_bucket_twice_with_the_next_gradient(two_nodes):
    _, _, _, spec = two_nodes
    _, block = _block("gpt3-175b")
    gathered, grads = fetch.working_set(block, 1, H, spec)
    # h -> 4h and 4h -> h, weights and biases; the largest bucket is one 4h^2 weight alone (over 5e8 elements),
    # held with its flattened copy and the gradient after it
    assert gathered == 2 * 4 * H * H + 4 * H + H
    assert grads == 3 * 4 * H * H


def test_per_tensor_zero3_holds_less_than_a_layer_gathered_twice():
    """GPT-3 175B on 16 ranks: deepspeed-2021's extra device memory is the working set above (2 bytes each), where
    today's DeepSpeed holds a whole layer gathered, prefetched and its gradient (12h^2 + 13h parameters x 6 bytes)."""
    from planner.cost.step import other_bytes
    cfg = ParallelConfig(dp=16, tp=1, pp=1, zero=3, micro_batch=1, num_microbatches=1, recompute="full")
    per_layer = 12 * H * H + 13 * H
    for framework, extra in (("deepspeed-2021", 2 * (2 * 4 * H * H + 5 * H) + 2 * 3 * 4 * H * H),
                             ("deepspeed", 6 * per_layer)):
        job = load_job("gpt3-175b", "a100-80g", gpus=16, global_batch=16, framework=framework, precision="fp16")
        cache = CostCache(job.graph, job.cluster, job.workload)
        assert other_bytes(cache, cfg) - job.cluster.device.reserved_bytes == pytest.approx(extra, rel=1e-9)
