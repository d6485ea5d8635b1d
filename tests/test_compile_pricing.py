"""Compiled blocks (``--compile``: each block torch.compile'd, as torchtitan and meshplan's executor do): their
pointwise ops run as inductor's fused kernels, priced at their bytes at the profile's measured rate for the class
(norms at ``norm``, the rest at ``stream``) instead of as eager kernels, and AOTAutograd's min-cut partitioner
recomputes a norm's and an activation's output in backward rather than saving it. Expected values are written
out here from the layer's shapes."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner import api
from planner.cluster import load_cluster
from planner.config import ParallelConfig, Workload
from planner.cost.eager import CAST_UP_BYTES
from planner.cost.layer import layer_cost
from planner.cost.step import CostCache
from planner.layers import build_layer_graph
from planner.model import ModelSpec

H, F, HEADS, KV, D, SEQ, BLOCKS = 512, 1536, 8, 2, 64, 1024, 3
SPEC = ModelSpec(name="tiny-llama", num_layers=BLOCKS, hidden=H, num_heads=HEADS, num_kv_heads=KV, head_dim=D,
                 ffn_hidden=F, vocab_size=1024, seq_len=SEQ, max_positions=0, mlp="swiglu", norm="rmsnorm",
                 linear_bias=False, qkv_bias=False, tied_embeddings=False, dropout=False)
ONE = ParallelConfig(dp=1, tp=1, pp=1, zero=0, micro_batch=2, num_microbatches=1, recompute="none", ep=1)


def _estimate(compile: bool, spec: ModelSpec = SPEC, cluster: str = "profiles/measured/h100-sxm5.toml"):
    job = api.Job(model_source=spec.name, spec=spec, graph=build_layer_graph(spec), cluster=load_cluster(cluster, 1),
                  workload=Workload(global_batch=2, seq_len=SEQ, precision="bf16", framework="torch",
                                    compile=compile))
    return job, api.fixed_plan(job, ONE).best.estimate


def test_a_compiled_llama_block_recomputes_its_norm_and_activation_outputs():
    """Eager, a SwiGLU block keeps q_proj's and gate_proj's inputs (the two norms' outputs), silu's input, the
    product's two inputs and down_proj's input: h + h + 3 f + f per token beside what both keep. Compiled it
    keeps the gate's and up's outputs (2 f) and recomputes the rest: 2 h + 2 f fewer per token, 2 bytes each."""
    _, eager = _estimate(False)
    _, compiled = _estimate(True)
    tokens = ONE.micro_batch * SEQ
    fewer = BLOCKS * tokens * 2 * (2 * H + 2 * F)
    assert eager.memory.activations - compiled.memory.activations == pytest.approx(fewer, rel=1e-9)


def test_a_compiled_blocks_pointwise_ops_cost_their_bytes_at_the_profiles_class_rates():
    """The block against the same block without its elementwise ops, both compiled: the difference is each op's
    bytes over the profile's measured rate for its class, forward and backward."""
    job, _ = _estimate(True)
    cache = CostCache(job.graph, job.cluster, job.workload)
    ctx = cache.context(ONE)
    block = next(layer for layer in job.graph.layers if layer.is_block)
    bare = replace(block, ops=tuple(op for op in block.ops if op.kind != "elementwise"))
    full, without = layer_cost(block, ctx, job.cluster), layer_cost(bare, ctx, job.cluster)
    dev = job.cluster.device
    rate = dict(dev.eager_bytes_per_s)
    tokens = ONE.micro_batch * SEQ
    # RMSNorm: reads and writes h (4 h bytes) forward, 6 h backward; RoPE, the residual adds and SwiGLU as
    # planner/layers.py gives them, at 2-byte activations
    elementwise = [op for op in block.ops if op.kind == "elementwise"]
    fwd = sum(op.bytes_fwd * tokens / rate["norm" if op.norm else "stream"] for op in elementwise)
    bwd = sum(op.bytes_bwd * tokens / rate["norm" if op.norm else "stream"] for op in elementwise)
    norms = [op for op in elementwise if op.norm]
    assert len(norms) == 2 and all(op.bytes_fwd == 4 * H and op.params == H for op in norms)
    # outside the compiled graph, as eager: the norms' bf16 weight gradients cast to their fp32 .grad
    bwd += 2 * H * CAST_UP_BYTES / rate["cast_up"]
    assert full.fwd_s - without.fwd_s == pytest.approx(fwd, rel=1e-9)
    assert full.bwd_s - without.bwd_s == pytest.approx(bwd, rel=1e-9)


def test_compiling_makes_an_eager_step_faster_and_says_how_it_is_priced():
    # the datasheet profile: no host probe (the measured H100's makes this tiny model's step the host's, compiled
    # or not: the probe timed eager blocks, and a compiled block's host time was 86% of an eager one's on the
    # H200, docs/validation.md)
    _, eager = _estimate(False, cluster="h100-80g")
    _, compiled = _estimate(True, cluster="h100-80g")
    assert compiled.step_time_s < eager.step_time_s
    from conftest import run_cli
    proc = run_cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--compile",
                   "--framework", "torch", "--top-k", "1")
    assert proc.returncode == 0, proc.stderr
    assert "pointwise ops fused" in proc.stdout.splitlines()[0]
