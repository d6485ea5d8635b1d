"""Memory-bound work as torch runs it eagerly: meshplan's executor (``--framework torch``).

Megatron-LM and DeepSpeed fuse the elementwise work of a block into a few kernels at 16-bit
activations (planner.layers prices those). torch eager runs one kernel per operator and, under
``torch.autocast``, keeps the residual stream in fp32 and casts every linear's input: several
times the bytes (counted from the executor's own models: planner/eager_bytes.py). Its
time is those bytes over the device's memory bandwidth (roofline, Williams et al. 2009).

Three precision regimes, as executor/parallelize.py chooses them (``uses_fsdp``, ``autocast_dtype``):
``autocast`` (fp32 parameters, DDP or no wrapper), ``bf16`` (FSDP2's MixedPrecisionPolicy: ZeRO-2/3,
and ZeRO-0 under TP or PP through ``replicate``), and ``fp32`` (no mixed precision: every operator
streams fp32, and FSDP2 copies the fp32 shards in and out of its all-gather buffer).

Parameter-sized work of a step, per parameter of a rank:
- autocast caches one bf16 copy of each weight per autocast region, i.e. per step: read 4, write 2;
- every micro-batch's weight gradients arrive in bf16 and are cast to the fp32 ``.grad``: read 2,
  write 4; micro-batches after the first add into it: read 4 + 4, write 4;
- FSDP2 casts the fp32 shard to bf16 into the all-gather buffer and copies it out (read 4, write 2,
  then read 2, write 2) each time it unshards (once per micro-batch; twice under ZeRO-3, which
  reshards after forward), and casts the bf16 gradient to the fp32 reduce dtype (read 2, write 4).
The counts of these kernels are visible in benchmarks/results/gpu_runs.json (``bfloat16_copy``
once per weight per step, ``direct_copy`` per weight per micro-batch).
"""
from __future__ import annotations

from ..runtimes import priced_as

CAST_DOWN_BYTES = 6.0      # fp32 -> bf16: read 4, write 2
CAST_UP_BYTES = 6.0        # bf16 -> fp32: read 2, write 4
ACCUMULATE_BYTES = 12.0    # fp32 += fp32: read 4 + 4, write 4
FSDP_UNSHARD_BYTES = 10.0  # copy-in cast (6) and copy-out (4) of the all-gather buffer
FP32_UNSHARD_BYTES = 16.0  # fp32: copy-in (read 4, write 4) and copy-out (read 4, write 4)


def wraps_in_fsdp(*, zero: int, dp: int, tp: int, pp: int, ep: int = 1) -> bool:
    """Whether executor/parallelize.py wraps the model in FSDP2 (ZeRO-2/3) or FSDP2's replicate (ZeRO-0
    with data parallelism beside TP, PP or expert parallelism: ``dp_wrapper``); ``dp``: data x context parallel."""
    return zero >= 2 or (zero == 0 and dp > 1 and (tp > 1 or pp > 1 or ep > 1))


def eager_regime(*, framework: str, precision: str, zero: int, dp: int, tp: int, pp: int, ep: int = 1) -> str:
    """'autocast', 'bf16', 'fp32' or 'fp32-fsdp' (torch eager; fp32 under FSDP2 or replicate, whose
    unshards copy the parameters), or '' (not torch: priced by the fused-kernel model)."""
    if priced_as(framework) != "torch":
        return ""
    fsdp = wraps_in_fsdp(zero=zero, dp=dp, tp=tp, pp=pp, ep=ep)
    if precision == "fp32":
        return "fp32-fsdp" if fsdp else "fp32"
    return "bf16" if fsdp else "autocast"


def layer_eager_regime(*, framework: str, precision: str, zero: int, dp: int, tp: int, pp: int, ep: int = 1) -> str:
    """The regime a layer's own elementwise work is priced in: ``eager_regime``'s, with fp32 under FSDP2 as
    fp32 (its unshard copies are the step's, ``step_param_bytes``). Under FSDP2 (ZeRO-2/3, or replicate beside
    TP, PP or experts) the layers run in bf16 and skip autocast's input casts; with DDP or no wrapper, as autocast runs
    them. Where the layout alone does not settle it (no TP, no PP), the ZeRO stage does: the stage ILP then
    prices the ZeRO stages of each regime apart (planner/search/stages.py ``regime_problems``)."""
    regime = eager_regime(framework=framework, precision=precision, zero=zero, dp=dp, tp=tp, pp=pp, ep=ep)
    return "fp32" if regime == "fp32-fsdp" else regime


def step_param_bytes(regime: str, *, zero: int, num_microbatches: int) -> dict[str, float]:
    """Bytes moved per parameter of a rank per step by the casts and accumulations above, by
    bandwidth class, but the per-micro-batch gradient cast (priced with each layer's backward)."""
    m = num_microbatches
    if regime in ("fp32", "fp32-fsdp"):
        unshards = m * (2 if zero == 3 else 1) if regime == "fp32-fsdp" else 0
        return {"stream": unshards * FP32_UNSHARD_BYTES + (m - 1) * ACCUMULATE_BYTES}
    if regime == "autocast":
        return {"cast_down": CAST_DOWN_BYTES, "stream": (m - 1) * ACCUMULATE_BYTES}
    if regime == "bf16":
        unshards = m * (2 if zero == 3 else 1)
        return {"cast_down": unshards * CAST_DOWN_BYTES,
                "stream": unshards * (FSDP_UNSHARD_BYTES - CAST_DOWN_BYTES) + (m - 1) * ACCUMULATE_BYTES}
    return {}


def eager_s(bytes_by_class: dict[str, float], kernels: float, device) -> float:
    """Seconds of eager kernels moving ``bytes_by_class``: each class at the device's measured
    bandwidth for it, plus the GPU's issue gap per kernel."""
    return sum(b / device.eager_bandwidth(c) for c, b in bytes_by_class.items() if b > 0) \
        + kernels * device.kernel_gap_s
