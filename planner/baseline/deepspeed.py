"""A DeepSpeed config JSON (https://www.deepspeed.ai/docs/config-json/).

The JSON holds the batch, ZeRO, offload, precision and activation-checkpointing
settings; the degrees of a Megatron-DeepSpeed job are launch flags, given here as
--tp and --pp (AutoTP's ``tensor_parallel.autotp_size`` is read too). ``"auto"`` (the
value the Hugging Face Trainer fills in) counts as not given. Batch rule from the
docs: train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x
data-parallel GPUs, any two of the three giving the third.
"""
from __future__ import annotations

import json

from ..config import ParallelConfig
from ..errors import UserError
from ..layers import LayerGraph
from .values import (Baseline, Context, FileModel, choice, data_parallel, global_batch, microbatches,
                     positive_int, schedule_of)

MODELLED = {   # dotted keys this reader models; every other key is listed as ignored
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "bf16", "bf16.enabled", "bfloat16", "bfloat16.enabled", "fp16", "fp16.enabled",
    "zero_optimization", "zero_optimization.stage", "zero_optimization.overlap_comm",
    "zero_optimization.offload_optimizer", "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_param", "zero_optimization.offload_param.device",
    "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path",
    "tensor_parallel", "tensor_parallel.autotp_size", "activation_checkpointing",
}
FLAGS = {   # meshplan's flag (as config.check_config names it) -> this format's
    "--dp/--tp/--pp/--cp": "--tp x --pp", "--tp": "--tp", "--pp": "--pp", "--ep": "--ep", "--micro-batch":
    "train_micro_batch_size_per_gpu", "num_microbatches": "gradient_accumulation_steps",
    "--zero": "zero_optimization.stage", "--optimizer-offload": "zero_optimization.offload_optimizer",
    "--param-offload": "zero_optimization.offload_param", "--nvme-offload": "zero_optimization.offload_*.device",
    "--recompute": "activation_checkpointing", "--precision": "bf16.enabled/fp16.enabled"}


def parse(text: str, source: str) -> dict:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}", source=source) from None
    if not isinstance(doc, dict):
        raise UserError(f"expected a JSON object, got {type(doc).__name__}", source=source)
    return doc


def model_of(doc: dict, source: str) -> FileModel:
    return FileModel(missing="a DeepSpeed config describes no model")


def _get(doc: dict, key: str):
    """The value at a dotted key; None when absent or "auto"."""
    value = doc
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return None if value == "auto" else value


def _keys(doc: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in doc.items():
        out.append(prefix + key)
        if isinstance(value, dict) and prefix + key in MODELLED:
            out += _keys(value, prefix + key + ".")
    return out


def _enabled(doc: dict, source: str, key: str) -> bool:
    value = _get(doc, key)
    if value is not None and not isinstance(value, bool):
        raise UserError(f"expected true or false, got {value!r}", source=source, field=key)
    return bool(value)


def read(doc: dict, source: str, ctx: Context, graph: LayerGraph) -> Baseline:
    notes = []
    autotp = _get(doc, "tensor_parallel.autotp_size")
    autotp = positive_int(source, "tensor_parallel.autotp_size", autotp, minimum=0) if autotp is not None else 0
    if ctx.tp is not None and autotp > 1 and ctx.tp != autotp:
        raise UserError(f"{autotp} but --tp is {ctx.tp}; allowed: the same degree, or one of them",
                        source=source, field="tensor_parallel.autotp_size")
    tp, pp = ctx.tp or max(autotp, 1), ctx.pp or 1
    dp = data_parallel(source, ctx.gpus, {"--tp": tp, "--pp": pp})
    micro, batch, m = _batch(doc, source, ctx, dp)
    zero = _get(doc, "zero_optimization.stage")
    zero = 0 if zero is None else int(choice(source, "zero_optimization.stage", zero, (0, 1, 2, 3)))
    device = _offload_device(doc, source, "offload_optimizer")
    # offload_param (ZeRO-Infinity): the parameter shards in host memory, stage 3 only (DeepSpeed's
    # DeepSpeedZeroOffloadParamConfig; below stage 3 the engine ignores it: deepspeed/runtime/engine.py
    # zero_offload_param() is read by the stage-3 optimizer alone)
    param_device = _offload_device(doc, source, "offload_param")
    param_offload = param_device != "none" and zero == 3
    if param_device != "none" and zero != 3:
        notes.append(f"zero_optimization.offload_param applies to ZeRO stage 3 only: at stage {zero} DeepSpeed keeps "
                     "the parameters on the GPU, and so does the estimate")
    # device nvme (ZeRO-Infinity): what is offloaded kept on the node's NVMe, stage 3 only (deepspeed/runtime/zero/
    # stage3.py builds the optimizer and parameter swappers; stage_1_and_2.py has none)
    offloaded = [d for d in (device, param_device if zero == 3 else "none") if d != "none"]
    nvme = zero == 3 and "nvme" in offloaded
    if "nvme" in offloaded and len(set(offloaded)) > 1:
        notes.append("one offload to NVMe and the other to the CPU: both are priced on NVMe")
    if zero != 3 and device == "nvme":
        notes.append(f"zero_optimization.offload_optimizer.device nvme needs ZeRO stage 3 (ZeRO-Infinity): at stage "
                     f"{zero} it is priced as offload to the CPU")
    overlap = _get(doc, "zero_optimization.overlap_comm")
    # deepspeed/runtime/zero/config.py (overlap_comm_valid): unset means on for stage 3, off otherwise
    overlap = zero == 3 if overlap is None else _enabled(doc, source, "zero_optimization.overlap_comm")
    recompute = "none"
    if "activation_checkpointing" in doc:
        recompute = "full"
        notes.append("activation_checkpointing: which blocks call deepspeed.checkpointing.checkpoint is in the "
                     "model code; every block is assumed to")
    precision, more = _precision(doc, source)
    notes += more
    notes += _auto_notes(doc, micro, batch, m, dp, ctx)
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ctx.ep or 1, zero=zero, micro_batch=micro, num_microbatches=m,
                            schedule=schedule_of(pp, 1), recompute=recompute,
                            optimizer_offload=device != "none", param_offload=param_offload, nvme_offload=nvme)
    return Baseline(source=source, format="deepspeed", runtime="deepspeed", config=config, global_batch=batch,
                    seq_len=graph.seq_len, precision=precision, overlap_grad_reduce=overlap,
                    flags=FLAGS, ignored=tuple(k for k in _keys(doc) if k not in MODELLED), notes=tuple(notes))


def _offload_device(doc: dict, source: str, what: str) -> str:
    """zero_optimization.<what>.device ("none" where unset): none, cpu or nvme, else UserError naming the key."""
    key = f"zero_optimization.{what}.device"
    device = _get(doc, key) or "none"
    choice(source, key, device, ("none", "cpu", "nvme"))
    return device


# what the Hugging Face Trainer fills in for "auto" (transformers/integrations/deepspeed.py, trainer_config_process:
# train_micro_batch_size_per_gpu <- --per_device_train_batch_size, gradient_accumulation_steps <-
# --gradient_accumulation_steps, train_batch_size <- world size x both, gradient_clipping <- --max_grad_norm)
AUTO_FROM = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
             "gradient_accumulation_steps": "--gradient_accumulation_steps",
             "train_batch_size": "the world size x the two above"}


def _auto_notes(doc: dict, micro: int, batch: int, steps: int, dp: int, ctx: Context) -> list[str]:
    """One note per batch key left "auto": what the Trainer would fill it from, and what this read took."""
    took = {"train_micro_batch_size_per_gpu": (micro, f"{batch} sequences / ({dp} data-parallel GPUs x {steps} "
                                                       "accumulation steps)"),
            "gradient_accumulation_steps": (steps, "1 unless the other two keys fix it"
                                            if doc.get("train_batch_size") == "auto" or "train_batch_size" not in doc
                                            else f"{batch} / ({dp} x {micro})"),
            "train_batch_size": (batch, "--global-batch" if ctx.global_batch else
                                 "the micro-batch x the accumulation steps x the data-parallel GPUs")}
    out = []
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if doc.get(key) == "auto":
            value, how = took[key]
            out.append(f'{key} "auto" (the Hugging Face Trainer fills it from {AUTO_FROM[key]}) is read as {value}: '
                       f"{how}")
    return out


def _batch(doc: dict, source: str, ctx: Context, dp: int) -> tuple[int, int, int]:
    """(micro-batch, global batch, accumulation steps) from any two of the three keys."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    train, micro, steps = (positive_int(source, k, _get(doc, k)) if _get(doc, k) is not None else None for k in keys)
    if micro is not None and steps is not None:
        batch = global_batch(source, "train_batch_size", train, ctx, micro * steps * dp)
        if batch != micro * steps * dp:
            raise UserError(f"{batch} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
                            f"{steps} x {dp} data-parallel GPUs (DeepSpeed asserts it); allowed: "
                            f"{micro * steps * dp}", source=source, field="train_batch_size")
        return micro, batch, steps
    batch = global_batch(source, "train_batch_size", train, ctx, micro * dp if micro is not None else None)
    if micro is None:
        steps = steps or 1
        micro = batch // (dp * steps)
        if micro < 1 or batch % (dp * steps):
            raise UserError(f"{batch} sequences do not split into {dp} data-parallel GPUs x {steps} accumulation "
                            f"steps; allowed: a multiple of {dp * steps}", source=source, field="train_batch_size")
    return micro, batch, microbatches(source, "train_batch_size", "train_micro_batch_size_per_gpu", batch, dp, micro)


def _precision(doc: dict, source: str) -> tuple[str, list[str]]:
    """The compute dtype, and a note when the Hugging Face Trainer decides it ("auto")."""
    section = doc.get("bf16")
    if isinstance(section, dict) and section.get("enabled") == "auto":
        return "bf16", ["bf16.enabled \"auto\" (the Hugging Face Trainer's --bf16 decides) is read as bf16"]
    bf16 = _enabled(doc, source, "bf16.enabled") or _enabled(doc, source, "bfloat16.enabled")
    fp16 = _enabled(doc, source, "fp16.enabled")
    if bf16 and fp16:
        raise UserError("bf16 and fp16 both enabled; allowed: one of them (or neither, for fp32)", source=source,
                        field="bf16.enabled/fp16.enabled")
    return ("bf16" if bf16 else "fp16" if fp16 else "fp32"), []
