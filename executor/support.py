"""What this executor can run: plan.json checks that need no torch, so `meshplan run` refuses a
plan before it launches anything (every rank checks again when it builds the job)."""
from __future__ import annotations

from planner.errors import UserError
from planner.model import ModelSpec

from .plan_file import RunPlan

DEFAULT_TIMEOUT_S = 300.0       # a collective waiting longer ends the job (torchtitan's comm.init_timeout_seconds)
DEFAULT_CHECKPOINT_EVERY = 100  # steps between the checkpoints of a restartable run (--checkpoint-every)


def runnable_schedule(schedule: str, num_microbatches: int, pp: int) -> str:
    """The schedule torch runs for a plan's: 1F1B with fewer micro-batches than stages is GPipe (every
    micro-batch is still in its warm-up forward when the first backward starts: the same order), and
    torch's Schedule1F1B refuses it."""
    return "gpipe" if schedule == "1f1b" and num_microbatches < pp else schedule


def check_stages(stages: tuple[tuple[str, ...], ...], spec: ModelSpec, source: str) -> None:
    """Every layer exactly once, in model order across the virtual stages."""
    order = ["embed", *(f"layers.{i}" for i in range(spec.num_layers)), "norm", "lm_head"]
    flat = [path for stage in stages for path in stage]
    if flat != order:
        raise UserError(f"the stages must list {', '.join(order[:2])} ... {order[-1]} once each, in order; "
                        f"got {flat}", source=source, field="stages")
    if any(not stage for stage in stages):
        raise UserError("a stage holds no layer", source=source, field="stages")


def check_supported(plan: RunPlan) -> None:
    """Refuse what this executor cannot run, naming the missing support."""
    c = plan.config
    if c.cp > 1:
        raise UserError(f"cp {c.cp}: context parallelism needs torch's context_parallel attention, which "
                        "runs only on CUDA flash/efficient SDPA kernels, not on this executor's CPU/gloo path; "
                        "plan with --cp 1", source=plan.source, field="config.cp")
    if c.zero == 1 and c.tp > 1:
        raise UserError("ZeRO-1 with tp > 1: ZeroRedundancyOptimizer cannot shard DTensor parameters; "
                        "use --zero 0, 2 or 3 with tensor parallelism", source=plan.source, field="config.zero")
    if c.zero == 1 and c.dp > 1 and c.pp > 1 and runnable_schedule(c.schedule, c.num_microbatches, c.pp) != "1f1b":
        raise UserError(f"ZeRO-1 with the {c.schedule} schedule: DDP under torch.distributed.pipelining fails "
                        "its first-step bucket rebuild; use --schedule 1f1b or --zero 0, 2 or 3",
                        source=plan.source, field="config.schedule")
    if c.offload != "none":
        raise UserError(f"offload {c.offload!r} is not supported by the executor; allowed: none",
                        source=plan.source, field="config.offload")
    spec = plan.spec
    if spec is not None and spec.num_kv_heads % c.tp:
        raise UserError(f"tp {c.tp} must divide the {spec.num_kv_heads} key/value heads (replicating "
                        "key/value heads is not supported)", source=plan.source, field="config.tp")
