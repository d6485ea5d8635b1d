"""meshplan's own plan.json, read by its one reader (``planner.plan.Plan.from_json``): the config and
workload as they were planned, the model's architecture, and the fingerprint of the model it was made
for. Everything else in the file (estimate, stages, runners-up) is the planner's output, not a setting."""
from __future__ import annotations

from ..errors import UserError
from ..fingerprint import model_fingerprint
from ..layers import LayerGraph
from ..plan import Plan
from ..trace.load import is_traced_source
from .deepspeed import parse as parse_json
from .values import Baseline, Context, FileModel, global_batch

FLAGS = {"--dp/--tp/--pp/--cp": "config.dp x tp x pp x cp", "--tp": "config.tp", "--pp": "config.pp",
         "--cp": "config.cp", "--micro-batch": "config.micro_batch", "num_microbatches": "config.num_microbatches",
         "--vpp": "config.vpp", "--schedule": "config.schedule", "--zero": "config.zero",
         "--recompute": "config.recompute", "--sequence-parallel": "config.sequence_parallel",
         "--optimizer-offload": "config.optimizer_offload", "--precision": "workload.precision"}


def parse(text: str, source: str) -> Plan:
    return Plan.from_json(parse_json(text, source), source)


def model_of(plan: Plan, source: str) -> FileModel:
    seq_len = ("workload.seq_len", plan.workload.seq_len)
    if plan.spec is not None:
        return FileModel(spec=plan.spec, name_flag="model.spec", seq_len=seq_len)
    named = plan.model_source
    return FileModel(name=None if not named or is_traced_source(named) else named, name_flag="model.source",
                     seq_len=seq_len, missing=f"model {named!r} is a traced module, which a plan.json does not "
                                              "describe")


def read(plan: Plan, source: str, ctx: Context, graph: LayerGraph) -> Baseline:
    config, w = plan.config, plan.workload
    if config.world_size != ctx.gpus:
        raise UserError(f"{config.dp} x {config.tp} x {config.pp} x {config.cp} = {config.world_size} GPUs but --gpus "
                        f"is {ctx.gpus}; allowed: the plan's own {config.world_size}", source=source,
                        field="config.dp x tp x pp x cp")
    if plan.fingerprints.model != model_fingerprint(graph):
        raise UserError(f"the plan was made for another model than {graph.name} (fingerprint "
                        f"{plan.fingerprints.model}); allowed: the model it was planned for", source=source,
                        field="fingerprints.model")
    batch = global_batch(source, "workload.global_batch", w.global_batch, ctx, None)
    return Baseline(source=source, format="plan.json", runtime=w.framework, config=config, global_batch=batch,
                    seq_len=graph.seq_len, precision=w.precision, attention=w.attention,
                    overlap_grad_reduce=w.overlap_grad_reduce, tp_comm_overlap=w.tp_comm_overlap, flags=FLAGS,
                    ep_comm_overlap=w.ep_comm_overlap,
                    expert_dispatcher=w.expert_dispatcher, expert_imbalance=w.expert_imbalance, fp8=w.fp8,
                    fp8_param_gather=w.fp8_param_gather, grad_reduce_in_bf16=w.grad_reduce_in_bf16, compile=w.compile,
                    finetune=w.finetune, lora_rank=w.lora_rank, lora_targets=w.lora_targets)
