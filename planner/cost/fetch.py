"""ZeRO-3 one tensor at a time: the parameter fetches and gradient reductions of DeepSpeed v0.3.13-v0.5.4.

What the code of those versions does (deepspeed/runtime/zero/stage3.py and partition_parameters.py, read at
v0.3.16; the runtime ``deepspeed-2021`` in planner/runtimes.py), per micro-batch:

- Before a sub-module's forward (a Linear, a LayerNorm: a module holding parameters of its own) its
  parameters are fetched (``fetch_sub_module``) and the next sub-module's prefetched
  (``prefetch_next_sub_modules``), both through ``_allgather_param``, once per tensor: it allocates the whole
  tensor (``torch.zeros``), calls ``torch.cuda.synchronize()``, builds a list of one view per rank in a Python
  loop and calls ``torch.distributed.all_gather`` on that list. torch's NCCL process group gathers into a
  flat buffer of its own and then copies it out to the views, one ``copy_`` (a cudaMemcpyAsync) per rank
  (ProcessGroupNCCL::allgather; the copies are why ``_all_gather_base`` replaced it in v0.5.5). Every
  tensor's synchronize waits for the previous tensor's gather, so nothing of a gather runs beside compute.
- Activation checkpointing re-runs the block's forward before its backward, and with it the fetches; the
  backward fetches once more. A released sub-module's parameters stay gathered only where it is used again
  within ``stage3_max_reuse_distance`` elements of parameters (``_keep_for_later``): between a layer's
  recomputed forward and its backward that is sub-module k when twice the elements of the sub-modules after
  it are under the limit.
- Each gradient is reduce-scattered on its own (``_reduce_scatter_gradient``: a list of one view per rank,
  which torch flattens with one copy per rank before NCCL's reduce-scatter), issued from autograd's hooks on
  the host while the GPU runs the sub-module's backward, then run on the reduction stream; the next
  sub-module's fetch synchronises on it.

So per tensor of x elements (b bytes each) on a group of n ranks, at HBM rate B:

    gather  = b x / B (zeros) + n loop_g + max(n copy_launch, NCCL all-gather + 2 b x / B (the copies))
    reduce  = host n (loop_r + copy_launch), hidden behind the sub-module's backward compute where shorter,
              then 2 b x / B (the flattening copies) + NCCL reduce-scatter

with the loops' host time per rank measured (runtime table) and the copy's launch in the cluster profile
(``[runtime] copy_launch_us``). A sub-module's backward compute is its share of the layer's by parameters
(its GEMMs are the layer's work). Not modelled: the first use after the forward-to-backward turn (the last
sub-modules of the last layer, which the same rule keeps), and a tied output layer's second fetch of the
embedding; nor two behaviours of v0.3.16's defaults: ``stage3_param_persistence_threshold`` (1e5 elements:
biases and norms stay gathered after the first step, so only the weights are gathered) and the prefetch of
``prefetch_next_sub_modules`` (the next tensor gathered beside the current sub-module's compute while fewer than
``stage3_max_live_parameters`` elements, 1e9, are gathered). Priced with both, the per-rank host costs above
(the loop timed on torch 2.13, the copy launch of a 2026 stack) leave Narayanan et al.'s ZeRO-3 rows 19-85%
too fast: what one rank costs per tensor on the torch 1.8 stack of 2021 is not measured here.
"""
from __future__ import annotations

from dataclasses import replace

from ..layers import Layer
from .. import network
from ..cluster import DTYPE_BYTES
from ..recompute import RECOMPUTE_POLICIES
from ..runtimes import PerTensorFetch
from .compute import memory_bound_s


def submodules(layer: Layer, tp: int, hidden: int) -> list[tuple[float, ...]]:
    """Elements per TP rank of each parameter tensor of each of ``layer``'s sub-modules, in forward order:
    a linear's weight (one per expert) and bias, a norm's weight (and a LayerNorm's bias), an embedding table."""
    out = []
    for op in layer.ops:
        if op.params <= 0:
            continue
        if op.kind == "linear":
            weight = op.in_features * op.out_features
            bias = op.params / op.num_gemms - weight
            split = tp if op.tp != "replicate" else 1
            tensors = (weight / split,) + ((bias / (tp if op.tp == "column" else 1),) if bias > 0 else ())
            if op.fused_with_previous and out:      # k and v of a fused qkv: the same tensors, larger
                out[-1] = tuple(a + b for a, b in zip(out[-1], tensors))
                continue
            out.extend([tensors] * op.num_gemms)
        elif op.norm and op.params == 2 * hidden:
            out.append((float(hidden), float(hidden)))
        elif op.kind == "embedding":
            out.append((op.params / tp,))
        else:
            out.append((float(op.params),))
    return out


def kept_for_backward(subs: list[tuple[float, ...]], max_reuse: float) -> list[bool]:
    """Per sub-module of a recomputed layer: whether its parameters stay gathered from the recomputed forward
    to its backward (the sub-modules after it run forward and then backward in between)."""
    sizes = [sum(s) for s in subs]
    return [2 * sum(sizes[k + 1:]) < max_reuse for k in range(len(subs))]


def gather_s(cache, x: float, grp, fetch: PerTensorFetch) -> float:
    """One tensor of ``x`` elements gathered by ``_allgather_param`` (module docstring)."""
    cluster, dev = cache.cluster, cache.cluster.device
    nbytes = x * DTYPE_BYTES[cache.workload.precision]
    n = grp.size
    return memory_bound_s(nbytes, dev) + n * fetch.gather_loop_s + max(
        n * cluster.copy_launch_s, network.all_gather_s(cluster, nbytes, grp) + memory_bound_s(2 * nbytes, dev))


def layer_phases(cache, layer: Layer, policy: str, tp: int, grp, bwd_s: float, fetch: PerTensorFetch,
                 grad_bytes: float) -> tuple[float, float, float]:
    """(forward fetches, fetches before and during backward, gradient reductions beyond the backward's
    compute) seconds of one micro-batch of ``layer``: nothing of them runs beside compute. Frozen parameters
    (planner/finetune.py ``Adapters.trains``) are fetched like the others and have no gradient to reduce."""
    subs = submodules(layer, tp, cache.graph.hidden)
    trains = cache.adapters.trains
    trained = subs if all(trains(op) for op in layer.ops) else \
        submodules(replace(layer, ops=tuple(op for op in layer.ops if trains(op))), tp, cache.graph.hidden)
    if not subs:
        return 0.0, 0.0, 0.0
    cluster = cache.cluster
    n = grp.size
    rerun = RECOMPUTE_POLICIES[policy].reruns_block
    kept = kept_for_backward(subs, fetch.max_reuse_distance) if rerun else [False] * len(subs)
    forward = sum(gather_s(cache, x, grp, fetch) for s in subs for x in s)
    backward = (forward if rerun else 0.0) + sum(gather_s(cache, x, grp, fetch)
                                                 for s, keep in zip(subs, kept) if not keep for x in s)
    reduce = 0.0
    total = sum(sum(s) for s in subs)
    for s in trained:
        host = len(s) * n * (fetch.reduce_loop_s + cluster.copy_launch_s)
        reduce += max(0.0, host - bwd_s * sum(s) / total)
        reduce += sum(memory_bound_s(2 * x * grad_bytes, cluster.device)
                      + network.reduce_scatter_s(cluster, x * grad_bytes, grp) for x in s)
    return forward, backward, reduce
