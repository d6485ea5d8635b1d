"""Memory per GPU: model states by runtime and ZeRO stage, activations by schedule."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..runtimes import RUNTIMES

# Adam(W) keeps two fp32 moments; mixed precision adds an fp32 master copy of the
# weights: K = 12 bytes per parameter (Rajbhandari et al. 2020, ZeRO, Sec 3.1).


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes per parameter of one rank's model states, before and after sharding."""

    params: float
    grads: float
    optimizer: float
    host_optimizer: float = 0.0     # moved to host memory by optimizer offload
    host_params: float = 0.0        # sharded parameters and gradients moved with it, where the runtime
    host_grads: float = 0.0         # offloads them too (StateLayout.offload_params_grads_from)

    @property
    def host(self) -> float:
        """Bytes per parameter in host memory."""
        return self.host_params + self.host_grads + self.host_optimizer


@functools.lru_cache(maxsize=4096)       # pure: a memo of the search's most frequent call
def state_bytes_per_param(*, framework: str, precision: str, zero: int, shard: int, optimizer_offload: bool,
                          pp: int = 1, param_offload: bool = False, grads_16bit: bool = False) -> StateBytes:
    """Bytes per parameter of each model-state category on one GPU, from the runtime's layout
    (planner/runtimes.py ``StateLayout``, where each runtime's numbers name their source).

    ``shard`` is the size of the group ZeRO partitions over (data x context parallel). A
    category is divided by it from the ZeRO stage the layout shards it at; the parameters
    add the unsharded working copy the runtime holds from forward until backward at that
    stage. fp32 training has no master copy: parameters 4, gradients 4, Adam 8. Optimizer
    offload moves the optimizer states to the host, and from the layout's
    ``offload_params_grads_from`` stage the parameter and gradient shards too (the working
    copy stays on the device). Where the runtime defers a sharded stage's gradient sync under a
    pipeline (``Timing.pp_defers_sharded_dp_sync``, ``pp`` > 1), the gradients are held unsharded
    on the device until the step's one reduce-scatter, and ZeRO-3's parameters stay gathered after
    each backward as ZeRO-2's do. ``param_offload`` (a runtime's parameter offload of its own, at the ZeRO
    stages it allows: DeepSpeed's offload_param at ZeRO-3) moves the parameter shards to the host (the
    gathered working copy stays a transient of the layer that runs). ``grads_16bit``: Runtime.layout's.
    """
    layout = RUNTIMES[framework].layout(precision, grads_16bit)
    d = max(1, shard)
    deferred = pp > 1 and zero >= 2 and RUNTIMES[framework].timing.pp_defers_sharded_dp_sync

    def share(nbytes: float, sharded_from: int) -> float:
        return nbytes / (d if zero >= sharded_from else 1)

    params = share(layout.params_bytes, layout.params_sharded_from)
    held = layout.held_copy_bytes[2 if deferred else zero]
    grads = layout.grads_bytes if deferred else share(layout.grads_bytes, layout.grads_sharded_from)
    opt = share(layout.optimizer_bytes, layout.optimizer_sharded_from)
    host_params = 0.0
    if param_offload:
        host_params, params = params, 0.0
    if not optimizer_offload:
        return StateBytes(params=params + held, grads=grads, optimizer=opt, host_params=host_params)
    if zero >= layout.offload_params_grads_from:
        if deferred:        # the unsharded gradients accumulate on the device; the reduced shard goes down
            return StateBytes(params=held, grads=grads, optimizer=0.0, host_optimizer=opt, host_params=params,
                              host_grads=share(layout.grads_bytes, layout.grads_sharded_from))
        return StateBytes(params=held, grads=0.0, optimizer=0.0, host_optimizer=opt, host_params=params,
                          host_grads=grads)
    return StateBytes(params=params + held, grads=grads, optimizer=0.0, host_optimizer=opt, host_params=host_params)


def working_copy_bytes_per_param(*, framework: str, precision: str, zero: int, tp: int, pp: int) -> float:
    """A buffer of gathered parameters held from forward to backward, per parameter: the
    runtime's ``replicate_copy_bytes`` for ZeRO-0 under TP or a pipeline (meshplan's executor
    runs it through torch's replicate(); in mixed precision that copy is the bf16 one already
    counted with the parameters). Counted with the buffers ("other")."""
    if zero == 0 and (tp > 1 or pp > 1):
        return RUNTIMES[framework].layout(precision).replicate_copy_bytes
    return 0.0


@functools.lru_cache(maxsize=4096)
def resident_bytes_per_param(*, framework: str, precision: str, zero: int, shard: int, optimizer_offload: bool, tp: int,
                             pp: int, param_offload: bool = False, grads_16bit: bool = False) -> float:
    """Device bytes per parameter that scale with the parameters: the model states on the
    GPU plus the executor's working copy (``working_copy_bytes_per_param``)."""
    s = state_bytes_per_param(framework=framework, precision=precision, zero=zero, shard=shard,
                              optimizer_offload=optimizer_offload, pp=pp, param_offload=param_offload,
                              grads_16bit=grads_16bit)
    return s.params + s.grads + s.optimizer + working_copy_bytes_per_param(
        framework=framework, precision=precision, zero=zero, tp=tp, pp=pp)


def grad_comm_bytes_per_param(framework: str, precision: str, grads_16bit: bool = False) -> float:
    """Bytes per parameter of the gradient reduction: the runtime layout's ``grad_reduce_bytes``
    (torch reduces in fp32: torchtitan's MixedPrecisionPolicy(reduce_dtype=float32), DDP on fp32
    parameters; DeepSpeed and Megatron reduce 16-bit gradients by default)."""
    return RUNTIMES[framework].layout(precision, grads_16bit).grad_reduce_bytes


@functools.lru_cache(maxsize=4096)
def frozen_share(*, framework: str, precision: str, zero: int, shard: int, pp: int = 1, optimizer_offload: bool = False,
                 param_offload: bool = False) -> tuple[float, float]:
    """(device, host) bytes per byte of frozen parameters (planner/finetune.py: stored at the compute dtype or as
    NF4, no gradient, no optimizer state) on one rank. Sharded over ``shard`` ranks where the runtime shards
    parameters at this ZeRO stage (its layout's ``params_sharded_from``: FSDP2's ZeRO-2/3, DeepSpeed's ZeRO-3);
    where the runtime then holds the gathered parameters from forward to backward (ZeRO-2's
    reshard_after_forward=False, and ZeRO-3's under a pipeline that defers the sync: ``state_bytes_per_param``),
    the gathered copy of the frozen ones too (1 more). Below that stage replicated: 1 (a frozen parameter needs no
    fp32 master and no autocast copy: it is stored in the compute dtype already). Moved to the host with the
    trainable parameters' shards (parameter offload; optimizer offload from the layout's
    ``offload_params_grads_from``)."""
    runtime = RUNTIMES[framework]
    layout = runtime.layout(precision)
    if zero < layout.params_sharded_from:
        return 1.0, 0.0
    deferred = pp > 1 and zero >= 2 and runtime.timing.pp_defers_sharded_dp_sync
    held = 1.0 if layout.held_copy_bytes[2 if deferred else zero] > 0 else 0.0
    at_rest = 1.0 / max(1, shard)
    if param_offload or (optimizer_offload and zero >= layout.offload_params_grads_from):
        return held, at_rest
    return at_rest + held, 0.0
