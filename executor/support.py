"""What this executor can run: plan.json checks that need no torch, so `meshplan run` refuses a
plan before it launches anything (every rank checks again when it builds the job)."""
from __future__ import annotations

from planner.errors import UserError, one_of
from planner.model import ModelSpec
from planner.config import ParallelConfig
from planner.runtimes import EXECUTOR_RUNTIME, RUNTIMES, config_refusals, unbuilt
from planner.schedules import SCHEDULES


DEFAULT_TIMEOUT_S = 300.0       # a collective waiting longer ends the job (torchtitan's comm.init_timeout_seconds)
DEFAULT_CHECKPOINT_EVERY = 100  # steps between the checkpoints of a restartable run (--checkpoint-every)


def runnable_schedule(schedule: str, num_microbatches: int, pp: int) -> str:
    """The schedule torch runs for a plan's: where the plan has fewer micro-batches than stages, the one
    its record names for that case (``fewer_microbatches_than_stages``: 1F1B is then GPipe, every
    micro-batch still in its warm-up forward when the first backward starts, the same order; torch's
    1F1B class refuses it)."""
    instead = SCHEDULES[schedule].fewer_microbatches_than_stages
    return instead if instead and num_microbatches < pp else schedule


def check_stages(stages: tuple[tuple[str, ...], ...], spec: ModelSpec, source: str) -> None:
    """Every layer exactly once, in model order across the virtual stages."""
    order = ["embed", *(f"layers.{i}" for i in range(spec.num_layers)), "norm", "lm_head"]
    flat = [path for stage in stages for path in stage]
    if flat != order:
        raise UserError(f"the stages must list {', '.join(order[:2])} ... {order[-1]} once each, in order; "
                        f"got {flat}", source=source, field="stages")
    if any(not stage for stage in stages):
        raise UserError("a stage holds no layer", source=source, field="stages")


def check_model(spec: ModelSpec, source: str = "plan.json") -> None:
    """Refuse a model spec with a part the executor's reference models (executor/models.py) do not build
    (planner/runtimes.py ``unbuilt``), naming the plan.json field."""
    for field, what in unbuilt(spec):
        raise UserError(f"{getattr(spec, field)!r}: {what} are not in meshplan's reference models yet "
                        "(`meshplan plan` prices them; `meshplan run` cannot train them); allowed: GPT, "
                        "Llama, Mistral, Qwen2, Qwen3, DeepSeek-V3 and GPT-OSS models (causal attention, multi-head "
                        "or latent, through sliding windows and with sinks), dense or with SwiGLU experts",
                        source=source,
                        field=f"model.spec.{field}")


def check_supported(config: ParallelConfig, spec: ModelSpec | None, device_kind: str, source: str = "plan.json",
                    fp8: str = "", compile: bool = False, finetune: str = "full") -> None:
    """Refuse what this executor cannot run on ``device_kind`` ("cuda" or "cpu"): the model's parts it does
    not build (``check_model``), the torch runtime's refusals in planner/runtimes.py, the table the
    planner's search space is built from, and compiled blocks (``compile``: plan.json's workload.compile)
    under a schedule that cannot run them (``PipelineSchedule.compile_refusal``), named as plan.json fields
    (of the file ``source``)."""
    if spec is not None:
        check_model(spec, source)
    kv_heads = spec.num_kv_heads if spec is not None else None
    experts = spec.num_experts if spec is not None else None
    latent = spec.is_mla if spec is not None else None
    allowed = RUNTIMES[EXECUTOR_RUNTIME].on(device_kind).fp8_recipes
    if fp8 and fp8 not in allowed:
        raise UserError(f"{fp8} does not run on {device_kind} in this executor; allowed: bf16, fp16, fp32"
                        + (f" or {one_of(allowed)}" if allowed else "") + " (plan again with that --precision)",
                        source=source, field="workload.fp8")
    refused = SCHEDULES[config.schedule].compile_refusal(compile) if config.pp > 1 else None
    if refused:
        raise UserError(f"{refused[1]} (plan again without {refused[0]}, or with another --schedule)", source=source,
                        field="workload.compile")
    for knob, why in config_refusals(config, EXECUTOR_RUNTIME, device_kind, kv_heads, experts, latent, fp8,
                                     compile=compile, finetune=finetune):
        raise UserError(why, source=source, field=f"config.{knob}")
