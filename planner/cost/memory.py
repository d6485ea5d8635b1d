"""Memory per GPU: model states by runtime and ZeRO stage, activations by schedule."""
from __future__ import annotations

from dataclasses import dataclass

# Adam(W) keeps two fp32 moments; mixed precision adds an fp32 master copy of the
# weights: K = 12 bytes per parameter (Rajbhandari et al. 2020, ZeRO, Sec 3.1).


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes per parameter of one rank's model states, before and after sharding."""

    params: float
    grads: float
    optimizer: float
    host_optimizer: float = 0.0     # moved to host memory by optimizer offload


def state_bytes_per_param(*, framework: str, precision: str, zero: int, shard: int, offload: str) -> StateBytes:
    """Bytes per parameter of each model-state category on one GPU.

    ``shard`` is the size of the group ZeRO partitions over (data x context parallel).

    deepspeed: the ZeRO paper's layout (Rajbhandari et al. 2020, Sec 5.1, Table 1):
        fp16 parameters 2, fp16 gradients 2, optimizer K = 12; stage 1 shards the
        optimizer, stage 2 also the gradients, stage 3 also the parameters.
    megatron: bf16 parameters 2, fp32 main gradients 4, fp32 master + Adam 12
        (18 bytes; Megatron-LM docs, 'distributed optimizer'); ZeRO-1 is its
        distributed optimizer, which shards the 12 (6 + 12/d bytes).
    torch: what meshplan's executor runs. ZeRO-0/1: DDP on fp32 parameters with
        autocast, whose bf16 weight copies live from forward until backward (+2);
        fp32 gradients 4; Adam 8 (ZeRO-1: ZeroRedundancyOptimizer shards it).
        ZeRO-2/3: FSDP2 fully_shard with MixedPrecisionPolicy(bf16 params, fp32
        reduce): sharded fp32 parameters, gradients and Adam (16/d); ZeRO-2 keeps
        the unsharded bf16 parameters between forward and backward
        (reshard_after_forward=False, +2); ZeRO-3 holds only a layer or two of them
        (counted with the communication buffers).
    fp32 training has no master copy: parameters 4, gradients 4, Adam 8.
    """
    mixed = precision != "fp32"
    d = max(1, shard)
    if framework == "deepspeed":
        p, g, o = (2.0, 2.0, 12.0) if mixed else (4.0, 4.0, 8.0)
        params, grads, opt = p / (d if zero >= 3 else 1), g / (d if zero >= 2 else 1), o / (d if zero >= 1 else 1)
    elif framework == "megatron":
        p, g, o = (2.0, 4.0, 12.0) if mixed else (4.0, 4.0, 8.0)
        params, grads, opt = p, g, o / (d if zero >= 1 else 1)
    else:
        working = 2.0 if mixed else 0.0
        if zero <= 1:
            params, grads, opt = 4.0 + working, 4.0, 8.0 / (d if zero == 1 else 1)
        else:
            unsharded = (working or 4.0) if zero == 2 else 0.0
            params, grads, opt = 4.0 / d + unsharded, 4.0 / d, 8.0 / d
    if offload == "optimizer":
        return StateBytes(params=params, grads=grads, optimizer=0.0, host_optimizer=opt)
    return StateBytes(params=params, grads=grads, optimizer=opt)


def working_copy_bytes_per_param(*, framework: str, precision: str, zero: int, tp: int, pp: int) -> float:
    """A buffer of gathered parameters held from forward to backward, per parameter.

    Under TP or a pipeline meshplan's executor runs ZeRO-0 through torch's
    replicate(), which gathers a working copy of the parameters for forward and keeps
    it until backward. In mixed precision that copy is the bf16 one already counted
    with the parameters; in fp32 it is 4 more bytes (measured on cpu-gloo,
    tests/test_executor_plans.py). Counted with the buffers ("other")."""
    if framework == "torch" and zero == 0 and precision == "fp32" and (tp > 1 or pp > 1):
        return 4.0
    return 0.0


def resident_bytes_per_param(*, framework: str, precision: str, zero: int, shard: int, offload: str, tp: int,
                             pp: int) -> float:
    """Device bytes per parameter that scale with the parameters: the model states on the
    GPU plus the executor's working copy (``working_copy_bytes_per_param``)."""
    s = state_bytes_per_param(framework=framework, precision=precision, zero=zero, shard=shard, offload=offload)
    return s.params + s.grads + s.optimizer + working_copy_bytes_per_param(
        framework=framework, precision=precision, zero=zero, tp=tp, pp=pp)


def grad_comm_bytes_per_param(framework: str, precision: str) -> float:
    """Dtype of the gradient reduction: torch reduces in fp32 (torchtitan's
    MixedPrecisionPolicy(reduce_dtype=float32); DDP on fp32 parameters); DeepSpeed
    and Megatron reduce 16-bit gradients by default."""
    if precision == "fp32" or framework == "torch":
        return 4.0
    return 2.0


def inflight_microbatches(schedule: str, *, rank: int, pp: int, vpp: int, num_microbatches: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of the
    rank's whole set of layers.

    GPipe keeps all m (Huang et al. 2019). 1F1B keeps p - rank (Narayanan et al. 2021,
    Sec 2.2.1). Interleaved 1F1B with v chunks: rank r runs 2(p - r - 1) + (v - 1) p
    warm-up chunk-micro-batches plus one in flight, each 1/v of the rank's layers
    (Megatron-LM schedules.py); for rank 0 that is 1 + (p - 1)/(p v) of p micro-
    batches (Korthikanti et al. 2022, Sec 4.2.3). Without a pipeline, one.
    """
    m = num_microbatches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved-1f1b":
        chunks = min(m * vpp, 2 * (pp - rank - 1) + (vpp - 1) * pp + 1)
        return chunks / vpp
    return float(min(m, pp - rank))
