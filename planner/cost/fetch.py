"""ZeRO-3 one tensor at a time: the parameter fetches and gradient reductions of DeepSpeed v0.3.13-v0.4.2.

What the code of those versions does with its configuration defaults (deepspeed/runtime/zero/stage3.py and
partition_parameters.py, read at v0.3.16; the runtime ``deepspeed-2021`` in planner/runtimes.py), per micro-batch:

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
- Gradients, under ZeRO-3's defaults of those versions (``contiguous_gradients`` false, ``overlap_comm`` true:
  constants.py ZERO3_OPTIMIZATION_*_DEFAULT at v0.3.13-v0.4.2), are all-reduced in buckets: each gradient's
  hook adds it to a list (``reduce_independent_p_g_buckets_and_remove_grads``) until the next would take it past
  ``reduce_bucket_size`` (5e8 elements), and ``reduce_ipg_grads`` then hands the list to
  ``buffered_reduce_fallback``, whose ``allreduce_bucket`` flattens it into one tensor, divides it by the group's
  size, all-reduces it and copies the result back into each gradient (each rank then keeps its partition).
  That runs on the reduction stream, but the next tensor's fetch synchronises the device and waits for it.
  From v0.4.3 (July 2021) ``contiguous_gradients`` defaults to true and the gradients are reduce-scattered one
  tensor at a time instead (``reduce_gradients_at_owner``); meshplan does not price those versions.

So per tensor of x elements (b bytes each) gathered on a group of n ranks, at HBM rate B:

    gather  = b x / B (zeros) + n loop_g + max(n copy_launch, NCCL all-gather + 2 b x / B (the copies))

with the loop's host time per rank measured (runtime table) and the copy's launch in the cluster profile
(``[runtime] copy_launch_us``); and per bucket of y gradient elements (g bytes each)

    reduce  = 3 x 2 g y / B (flatten, divide, copy back) + NCCL all-reduce of g y bytes.

Not modelled: the first use after the forward-to-backward turn (the last sub-modules of the last layer, which
the same rule keeps), a tied output layer's second fetch of the embedding, a bucket's all-reduce beside the
backward of a sub-module that needs no fetch (one kept for backward), and two behaviours of the defaults:
``stage3_param_persistence_threshold`` (1e5 elements: biases and norms stay gathered after the first step, so
only the weights are gathered) and the prefetch of ``prefetch_next_sub_modules`` (the next tensor gathered
beside the current sub-module's compute while fewer than ``stage3_max_live_parameters`` elements, 1e9, are
gathered).
"""
from __future__ import annotations

import math
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


def layer_phases(cache, layer: Layer, policy: str, tp: int, grp, fetch: PerTensorFetch,
                 grad_bytes: float) -> tuple[float, float, float]:
    """(forward fetches, fetches before and during backward, gradient reductions) seconds of one micro-batch of
    ``layer``: nothing of them runs beside compute. Frozen parameters
    (planner/finetune.py ``Adapters.trains``) are fetched like the others and have no gradient to reduce."""
    subs = submodules(layer, tp, cache.graph.hidden)
    trains = cache.adapters.trains
    trained = subs if all(trains(op) for op in layer.ops) else \
        submodules(replace(layer, ops=tuple(op for op in layer.ops if trains(op))), tp, cache.graph.hidden)
    if not subs:
        return 0.0, 0.0, 0.0
    rerun = RECOMPUTE_POLICIES[policy].reruns_block
    kept = kept_for_backward(subs, fetch.max_reuse_distance) if rerun else [False] * len(subs)
    forward = sum(gather_s(cache, x, grp, fetch) for s in subs for x in s)
    backward = (forward if rerun else 0.0) + sum(gather_s(cache, x, grp, fetch)
                                                 for s, keep in zip(subs, kept) if not keep for x in s)
    reduce = sum(weight * all_reduce_bucket_s(cache, size, grp, grad_bytes)
                 for size, weight in gradient_buckets(backward_order(trained), fetch.reduce_bucket))
    return forward, backward, reduce


def backward_order(subs: list[tuple[float, ...]]) -> list[float]:
    """The elements of ``submodules``' tensors in the order backward makes their gradients: the forward's, reversed."""
    return [x for sub in reversed(subs) for x in reversed(sub)]


def gradient_buckets(grads: list[float], bucket: float) -> list[tuple[float, float]]:
    """(elements, share) of each gradient bucket of one layer, ``grads`` its gradients' elements in backward
    order, as ``reduce_independent_p_g_buckets_and_remove_grads`` fills them: a gradient joins the open bucket
    unless it would take it past ``bucket`` elements (``reduce_bucket_size``), which is then reduced first; a
    gradient larger than ``bucket`` goes alone. Buckets run on from layer to layer, so a layer of fewer elements
    than ``bucket`` shares its buckets with the layers beside it: the fill is played over a run of identical
    layers long enough for ten buckets, and each bucket counts ``share`` = 1 / the run's length of one call."""
    total = sum(grads)
    if total <= 0:
        return []
    copies = max(1, min(64, math.ceil(10 * bucket / total)))
    closed, filling = [], 0.0
    for x in grads * copies:
        if filling and filling + x > bucket:
            closed.append(filling)
            filling = 0.0
        filling += x
    closed.append(filling)
    return [(size, 1.0 / copies) for size in closed]


def all_reduce_bucket_s(cache, x: float, grp, grad_bytes: float) -> float:
    """One bucket of ``x`` gradient elements reduced by ``allreduce_bucket``: flattened into one tensor (a copy),
    divided by the group's size in place, all-reduced, and copied back into each gradient; three passes over
    HBM that read and write the bucket, and NCCL's all-reduce."""
    nbytes = x * grad_bytes
    return 3 * memory_bound_s(2 * nbytes, cache.cluster.device) + network.all_reduce_s(cache.cluster, nbytes, grp)


def working_set(layer: Layer, tp: int, hidden: int, fetch: PerTensorFetch) -> tuple[float, float]:
    """(parameter elements gathered at once, gradient elements held at once) at the peak of ``layer``, which the
    per-tensor fetch holds instead of a whole layer: a sub-module's tensors while it runs and the next sub-module's
    prefetched or kept beside them (released sub-modules free their tensors: ``release_sub_module``), so the two
    largest sub-modules; and while a gradient bucket is all-reduced, its gradients, their flattened copy, and the
    gradient whose arrival closed it (the bucket before it is freed as this one starts: ``reduce_ipg_grads``
    partitions the previous bucket first)."""
    subs = submodules(layer, tp, hidden)
    if not subs:
        return 0.0, 0.0
    sizes = sorted((sum(s) for s in subs), reverse=True)
    grads = backward_order(subs)
    bucket = max(size for size, _ in gradient_buckets(grads, fetch.reduce_bucket))
    return sum(sizes[:2]), 2 * bucket + max(grads)

