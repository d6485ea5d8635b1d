"""The host's side of a step of the torch executor: no step ends before the host has issued it.

Each eager operator costs the host microseconds (Python, the dispatcher, autograd's bookkeeping) and
launches its kernels asynchronously, so the GPU runs ahead of nothing: where the kernels are short
(small models, short sequences, many micro-batches) the GPU waits for the host and the step takes
the host's time (measured on one H200: benchmarks/results/gpu_round2_runs.json, whose FSDP rows with
2 to 4 micro-batches ran 2.5 to 3.7 times their kernels' GPU time). FSDP2's hooks around every
block, operator-level checkpointing's policy calls and a mixture of experts' routing add host work of
their own. Under expert parallelism the routing also copies the tokens per expert back to the host each
layer (the all-to-all's splits), which drains the GPU's queue; without it the executor's grouped GEMM
reads nothing back (executor/moe.py, since 2026-11-27: the probe's ``moe`` regime was measured before,
with a copy per layer).

``meshplan profile`` measures the executor's host time per block in each of those regimes
(executor/profile/host.py, ``[gpu.kernels] host_us``): per block per micro-batch and per step, and the rest
of the step (embedding, head, loss, optimizer) per micro-batch and per step. A block of another model is
priced by the operators it dispatches over the probe block's (``operators``: the host pays Python, the
dispatcher and autograd's bookkeeping per operator, views included, and a launch where there is a kernel;
counted from the executor's models, planner/eager_table.py), or where the table has no count for them, by
its kernel launches over the probe block's of its kind, dense or MoE (``launches``); on one H100 operators
took round 1's host-bound GPT-2 row from +32% to +18% (docs/validation.md), except FSDP2's part, which is
priced by its parameter tensors over the probe block's (``parameter_tensors``: FSDP2's hooks walk each
parameter; on one H100 this took round 3's GPT-2 FSDP plans from 34% and 62% too fast to -8% and +14%,
docs/validation.md). The step is then the larger of the GPU's time and the host's (``host_s``): where they
are close, the host also stalls the GPU at its synchronisations, which this bound leaves out. Only the torch
runtime is measured (other runtimes: no bound), and only profiles written by ``meshplan profile`` on a GPU
carry it.
"""
from __future__ import annotations

import functools

from ..model import ModelSpec
from ..runtimes import priced_as
from .eager import wraps_in_fsdp

PROBE_EXPERTS = 8


def probe_spec(blocks: int, experts: int = 0) -> ModelSpec:
    """The probe's model (executor/profile/host.py trains it): a Llama-style block (RMSNorm, RoPE,
    grouped-query attention, SwiGLU) at tiny widths, its MLP a mixture of ``experts`` (top 2) where
    given."""
    return ModelSpec(name=f"host-probe-{blocks}", num_layers=blocks, hidden=256, num_heads=4, num_kv_heads=2,
                     head_dim=64, ffn_hidden=512, vocab_size=256, seq_len=64, max_positions=0, mlp="swiglu",
                     norm="rmsnorm", linear_bias=False, qkv_bias=False, tied_embeddings=False, dropout=False,
                     num_experts=experts, experts_per_token=2 if experts else 0)


def launches(layer) -> float:
    """Kernels a block launches per micro-batch as torch eager runs it under autocast: its elementwise
    kernels forward and backward (planner/eager_table.py, counted from the executor's models; two per
    elementwise operator where the family is not tabled), three GEMMs per linear (forward, input and
    weight gradient) and two per attention core (forward, backward)."""
    eager = dict(layer.eager).get("autocast")
    kinds = [op.kind for op in layer.ops]
    elementwise = eager.fwd_kernels + eager.bwd_kernels if eager else 2 * kinds.count("elementwise")
    return elementwise + 3 * kinds.count("linear") + 2 * kinds.count("attention")


def parameter_tensors(layer) -> int:
    """The parameter tensors of a block as the executor builds it: a weight per linear (fused q, k and v
    one), its bias where it has one, and a norm's weight (and bias: a LayerNorm's parameters are twice
    the width)."""
    width = next((op.in_features for op in layer.ops if op.kind == "linear"), 0)
    count = 0
    for op in layer.ops:
        if op.params <= 0 or op.fused_with_previous:
            continue
        if op.kind == "linear":
            count += 1 + (op.params > op.in_features * op.out_features * op.num_gemms)
        else:
            count += max(round(op.params / width), 1) if width else 1
    return count


def _probe_block(experts: int = 0):
    from ..layers import build_layer_graph
    return next(layer for layer in build_layer_graph(probe_spec(1, experts)).layers if layer.is_block)


@functools.lru_cache(maxsize=2)
def probe_launches(experts: int = 0) -> float:
    """``launches`` of the probe's block, dense or a mixture of ``experts``."""
    return launches(_probe_block(experts))


def operators(layer) -> float:
    """Operators the dispatcher runs for a block per micro-batch, forward and backward, under autocast (views and
    GEMMs included: planner/eager_table.py, counted from the executor's models by executor/eager_counts.py); 0
    where the table has no family for the block."""
    eager = dict(layer.eager).get("autocast")
    return float(eager.fwd_ops + eager.bwd_ops) if eager else 0.0


def _host_ratio(layer, experts: int) -> float:
    """A block's host work over its probe block's: by the operators each dispatches where the table counts both
    (the host pays per operator: Python, the dispatcher, autograd's node, then the launch, if any), else by the
    kernels each launches (``launches``)."""
    probe = _probe_block(experts)
    ops, probe_ops = operators(layer), operators(probe)
    if ops and probe_ops:
        return ops / probe_ops
    return launches(layer) / probe_launches(experts)


@functools.lru_cache(maxsize=1)
def probe_tensors() -> int:
    """``parameter_tensors`` of the dense probe's block."""
    return parameter_tensors(_probe_block())


def block_host_s(layer, policy: str, *, m: int, fsdp: bool, table: dict) -> float:
    """Host seconds of one block over a step of ``m`` micro-batches: the probe block's of its kind (the
    dense probe, or the MoE probe for a block with routed experts), plus what the policy (``op``,
    ``full``) adds over the dense probe, scaled by the block's launches over its probe block's, plus
    what FSDP adds over the dense probe, scaled by the block's parameter tensors over the probe's.
    Each regime's time is ``m`` times its per-micro-batch part plus its per-step part (``table``:
    seconds)."""
    def at(regime: str) -> float:
        per_microbatch, per_step = table[regime][:2]
        return m * per_microbatch + per_step
    routed = any(op.routed for op in layer.ops) and "moe" in table
    eager = at("eager")
    total = at("moe" if routed else "eager") + sum(
        at(regime) - eager for regime in ("op", "full") if policy == regime and regime in table)
    # FSDP2's host work is per parameter (its unshard, reshard and gradient hooks walk each FSDPParam)
    per_parameter = at("fsdp") - eager if fsdp and "fsdp" in table else 0.0
    return (max(total, 0.0) * _host_ratio(layer, PROBE_EXPERTS if routed else 0)
            + max(per_parameter, 0.0) * parameter_tensors(layer) / probe_tensors())


def host_s(cache, config) -> float:
    """Host seconds of one step on its busiest rank (0 where the profile has no host measurement or the
    runtime is not torch's)."""
    from ..placement import assign_layers, layer_policies
    table = {name: tuple(x * 1e-6 for x in values) for name, *values in cache.cluster.device.host_us}
    if "eager" not in table or priced_as(cache.workload.framework) != "torch":
        return 0.0
    fsdp = wraps_in_fsdp(zero=config.zero, dp=config.dp * config.cp, tp=config.tp, pp=config.pp, ep=config.ep)
    m = config.num_microbatches
    rest = table["fsdp" if fsdp and "fsdp" in table else "eager"]
    layers, policies = cache.graph.layers, layer_policies(cache.graph, config)
    busiest = 0.0
    for chunks in assign_layers(cache.graph, config):
        total = max(m * rest[2] + rest[3], 0.0) + sum(
            block_host_s(layers[i], policies[i], m=m, fsdp=fsdp, table=table)
            for chunk in chunks for i in chunk if layers[i].is_block)
        busiest = max(busiest, total)
    return busiest


def host_bound(est, host: float):
    """``est`` with its step no shorter than ``host`` seconds: the GPU's wait for the host is the step's
    ``host_wait``, and throughput, model and hardware FLOP/s and MFU scale with the longer step."""
    from dataclasses import replace
    if host <= est.step_time_s:
        return est
    ratio = est.step_time_s / host
    return replace(est, step_time_s=host, tokens_per_s=est.tokens_per_s * ratio,
                   model_tflops_per_gpu=est.model_tflops_per_gpu * ratio, mfu=est.mfu * ratio,
                   hardware_tflops_per_gpu=est.hardware_tflops_per_gpu * ratio,
                   time=replace(est.time, host_wait=est.time.host_wait + host - est.step_time_s))
