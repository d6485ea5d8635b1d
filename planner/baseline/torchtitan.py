"""A torchtitan job config TOML: [parallelism], [training] and [activation_checkpoint]
for the knobs, [model] name and flavor for the model.

Keys and defaults as torchtitan/config/job_config.py defines them (pytorch/torchtitan,
the TOML configs up to the February 2026 refactor to Python configs); how they combine
as torchtitan applies them: FSDP over the shard and context-parallel ranks
(distributed/parallel_dims.py ``fsdp_enabled``), ``fsdp_reshard_after_forward``
"default" resharding only without a pipeline, the default stage split of
distributed/pipeline_parallel.py (``generate_llm_fqn_per_model_part``: the embedding
and the output each count as one layer), ``selective_ac_option = "n"``
checkpointing every n-th block (meshplan's every-n) and ``"op"`` its per-operator policy (meshplan's op;
distributed/activation_checkpoint.py).
"""
from __future__ import annotations

import math
import tomllib

from ..config import COMPILE_PRICED_AS, ParallelConfig
from ..errors import UserError
from ..layers import LayerGraph
from ..precision import RECIPES
from ..schedules import SCHEDULES as PIPELINE_SCHEDULES
from .values import (Baseline, Context, FileModel, choice, data_parallel, global_batch, microbatches,
                     pipeline_layers, positive_int, recompute_of, schedule_of)

MODELLED = {
    "model": {"name", "flavor", "converters"},
    "training": {"local_batch_size", "batch_size", "global_batch_size", "seq_len", "mixed_precision_param"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                    "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size", "pipeline_parallel_split_points",
                    "module_fqns_per_model_part", "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "enable_async_tensor_parallel", "enable_sequence_parallel", "expert_parallel_degree",
                    "expert_tensor_parallel_degree"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "compile": {"enable", "components"},
}
# torchao's float8 recipe names (quantize.linear.float8 recipe_name) -> --precision (planner/precision.py
# Recipe.torchao_name; MX linears are their own converter)
FP8_RECIPES = {r.torchao_name: name for name, r in RECIPES.items() if r.torchao_name and r.gemm_dtype == "fp8"}
# torchtitan's (model, flavor) -> meshplan's zoo name; Qwen3's flavors are torchtitan/models/qwen3/__init__.py's
# (v0.2.2 and b5bcd76c6, November 2026: the same dimensions as the zoo's), GPT-OSS's and DeepSeek-V3's
# torchtitan/models/gpt_oss/__init__.py (with model/args.py's defaults: dim 2880, 64 heads of 64, 8 kv heads, window
# 128, swiglu_limit 7) and deepseek_v3/__init__.py at v0.2.2 (671B: 61 layers, 3 dense, 256 experts, top 8)
ZOO = {("llama3", "8B"): "llama3-8b", ("llama3", "70B"): "llama3-70b", ("llama3", "405B"): "llama3-405b",
       ("llama2", "7B"): "llama2-7b", ("llama2", "13B"): "llama2-13b", ("llama2", "70B"): "llama2-70b",
       ("qwen3", "8B"): "qwen3-8b", ("qwen3", "32B"): "qwen3-32b", ("qwen3", "30B-A3B"): "qwen3-30b-a3b",
       ("qwen3", "235B-A22B"): "qwen3-235b-a22b", ("gpt_oss", "20b"): "gpt-oss-20b",
       ("gpt_oss", "120b"): "gpt-oss-120b", ("deepseek_v3", "671B"): "deepseek-v3"}
# torchtitan's pipeline_parallel_schedule names the torch.distributed.pipelining class (planner/schedules.py
# torch_name); the classes not among them (LoopedBFS, the zero-bubble ones, DualPipeV) all run several stages
# per rank (torch's PipelineScheduleMulti)
SCHEDULES = {s.torch_name: s.name for s in PIPELINE_SCHEDULES.values()}
SINGLE_STAGE = {s.torch_name for s in PIPELINE_SCHEDULES.values() if not s.virtual_stages}
MODULES = {"tok_embeddings": "embed", "output": "lm_head"}    # torchtitan's module names -> meshplan's layers
LOCAL_BATCH, SEQ_LEN = 8, 2048          # job_config.py Training defaults
FLAGS = {   # meshplan's flag (as config.check_config names it) -> this format's
    "--dp/--tp/--pp/--cp": "parallelism degrees", "--tp": "parallelism.tensor_parallel_degree",
    "--pp": "parallelism.pipeline_parallel_degree", "--cp": "parallelism.context_parallel_degree",
    "--ep": "parallelism.expert_parallel_degree", "--micro-batch": "parallelism.pipeline_parallel_microbatch_size", "num_microbatches": "training.global_batch_size",
    "--vpp": "parallelism.pipeline_parallel_split_points", "--schedule": "parallelism.pipeline_parallel_schedule",
    "--zero": "parallelism.data_parallel_shard_degree", "--recompute": "activation_checkpoint.mode",
    "--precision": "training.mixed_precision_param"}


def parse(text: str, source: str) -> dict:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"not valid TOML: {e}", source=source) from None
    for section in MODELLED:
        if not isinstance(doc.get(section, {}), dict):
            raise UserError("expected a table", source=source, field=f"[{section}]")
    if any(k in doc.get("training", {}) for k in TOKEN_KEYS) or "num_pp_microbatches" in doc.get("parallelism", {}):
        tokens_to_sequences(doc, source)
    return doc


# torchtitan's batch keys in tokens (pytorch/torchtitan PR 4121, August 2026; torchtitan/config/configs.py
# TrainingConfig, ParallelismConfig) and their defaults
TOKEN_KEYS = {"num_tokens_per_microbatch_per_dp_rank": 16384, "num_tokens_per_train_step": -1,
              "max_context_length": 2048}
SEQUENCE_KEYS = ("local_batch_size", "batch_size", "global_batch_size", "seq_len")


def tokens_to_sequences(doc: dict, source: str) -> None:
    """Turn the token-based batch keys into the sequence-based ones this reader models, in place:
    ``num_tokens_per_microbatch_per_dp_rank`` is one forward's tokens per data-parallel rank (the
    micro-batch), ``num_pp_microbatches`` the pipeline's micro-batches per accumulation step, and
    ``num_tokens_per_train_step`` the global batch's tokens (default: all of these x the data-parallel
    degree, which the sequence-based reader derives the same way)."""
    training, par = doc.setdefault("training", {}), doc.setdefault("parallelism", {})
    mixed = [k for k in SEQUENCE_KEYS if k in training] + (
        ["pipeline_parallel_microbatch_size"] if "pipeline_parallel_microbatch_size" in par else [])
    if mixed:
        raise UserError(f"{', '.join(mixed)} beside the token-based batch keys; allowed: one form (torchtitan "
                        "counts tokens since August 2026)", source=source, field=f"training.{mixed[0]}")
    seq = training.pop("max_context_length", TOKEN_KEYS["max_context_length"])
    seq = positive_int(source, "training.max_context_length", seq)
    tokens = positive_int(source, "training.num_tokens_per_microbatch_per_dp_rank",
                          training.pop("num_tokens_per_microbatch_per_dp_rank",
                                       TOKEN_KEYS["num_tokens_per_microbatch_per_dp_rank"]))
    if tokens % seq:
        raise UserError(f"{tokens} tokens are not whole sequences of max_context_length {seq}; allowed: a multiple "
                        f"of {seq}", source=source, field="training.num_tokens_per_microbatch_per_dp_rank")
    micro = tokens // seq
    pp = par.get("pipeline_parallel_degree", 1)
    pipeline_microbatches = positive_int(source, "parallelism.num_pp_microbatches", par.pop("num_pp_microbatches", 1))
    training["seq_len"] = seq
    training["local_batch_size"] = micro * (pipeline_microbatches if isinstance(pp, int) and pp > 1 else 1)
    if isinstance(pp, int) and pp > 1:
        par["pipeline_parallel_microbatch_size"] = micro
    step = training.pop("num_tokens_per_train_step", -1)
    if step != -1:
        step = positive_int(source, "training.num_tokens_per_train_step", step)
        if step % seq:
            raise UserError(f"{step} tokens are not whole sequences of max_context_length {seq}; allowed: a "
                            f"multiple of {seq}", source=source, field="training.num_tokens_per_train_step")
        training["global_batch_size"] = step // seq


def model_of(doc: dict, source: str) -> FileModel:
    model = doc.get("model", {})
    name = ZOO.get((model.get("name"), model.get("flavor")))
    seq = doc.get("training", {}).get("seq_len")
    return FileModel(name=name, name_flag="model.flavor", seq_len=("training.seq_len", positive_int(source, "training.seq_len", seq))
                     if seq is not None else None, seq_len_default=SEQ_LEN,
                     missing=f"[model] name {model.get('name')!r} flavor {model.get('flavor')!r} is not in "
                             "meshplan's zoo")


def _int(doc: dict, key: str, source: str, default: int, minimum: int = 1) -> int:
    section, _, name = key.partition(".")
    value = doc.get(section, {}).get(name)
    return default if value is None else positive_int(source, key, value, minimum)


def read(doc: dict, source: str, ctx: Context, graph: LayerGraph) -> Baseline:
    par, notes = doc.get("parallelism", {}), []
    tp, pp, cp = (_int(doc, f"parallelism.{k}_parallel_degree", source, 1) for k in ("tensor", "pipeline", "context"))
    replicate = _int(doc, "parallelism.data_parallel_replicate_degree", source, 1)
    shard = _shard(doc, source, ctx.gpus, tp, pp, cp, replicate)
    dp = replicate * shard
    zero = _zero(par, source, shard, cp, pp)
    if zero and replicate > 1:
        notes.append(f"HSDP (replicate {replicate} x shard {shard}): meshplan shards the states over all {dp} "
                     "data-parallel ranks, less memory than sharding over the shard group")
    micro, batch, m = _batch(doc, source, ctx, dp, pp)
    schedule_name = par.get("pipeline_parallel_schedule", "1F1B")
    blocks = _stage_blocks(doc, source, graph, pp, schedule_name) if pp > 1 else None
    vpp = len(blocks) // pp if blocks else 1
    schedule, more = _schedule(source, schedule_name, pp, vpp)
    notes += more
    per_block, more = _recompute(doc.get("activation_checkpoint"), source, graph.num_blocks, pp)
    notes += more
    if doc.get("compile", {}).get("enable"):
        notes.append(f"compile enable: {COMPILE_PRICED_AS}")
    recompute, recompute_layers = recompute_of(graph, per_block)
    # enable_cpu_offload: FSDP2's CPUOffloadPolicy (torchtitan/distributed/fsdp.py), which keeps the sharded
    # parameters, gradients and optimizer states in host memory: meshplan's optimizer offload at ZeRO-2/3
    offload = bool(doc.get("training", {}).get("enable_cpu_offload"))
    if offload and zero < 2:
        notes.append("training.enable_cpu_offload with nothing sharded (no FSDP shard degree) is not modelled: the "
                     "estimate keeps every state on the GPU")
    ep = _int(doc, "parallelism.expert_parallel_degree", source, 1)
    etp = _int(doc, "parallelism.expert_tensor_parallel_degree", source, 1)
    if etp != 1:
        raise UserError(f"{etp}: meshplan models experts whole on their rank (expert tensor parallel 1, torchtitan's "
                        "default); allowed: 1", source=source, field="parallelism.expert_tensor_parallel_degree")
    config = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, micro_batch=micro, num_microbatches=m,
                            vpp=vpp, optimizer_offload=offload and zero >= 2,
                            schedule=schedule, recompute=recompute,
                            sequence_parallel=tp > 1 and bool(par.get("enable_sequence_parallel", True)),
                            recompute_layers=recompute_layers,
                            stage_layers=pipeline_layers(source, "parallelism.pipeline_parallel_split_points", graph,
                                                         blocks))
    fp8, more = _fp8(doc, source)
    notes += more
    return Baseline(source=source, format="torchtitan", runtime="torchtitan", config=config, global_batch=batch,
                    seq_len=graph.seq_len, precision=_precision(doc, source),
                    tp_comm_overlap=bool(par.get("enable_async_tensor_parallel")), flags=FLAGS, fp8=fp8,
                    compile=bool(doc.get("compile", {}).get("enable")),
                    ignored=_ignored(doc), notes=tuple(notes))


def _fp8(doc: dict, source: str) -> tuple[str, list[str]]:
    """The recipe of the float8 or MX linear converter model.converters names (v0.2.2's keys: recipe_name of
    [quantize.linear.float8], unset meaning tensorwise; [quantize.linear.mx]); "" with neither."""
    converters = doc.get("model", {}).get("converters", [])
    if isinstance(converters, str):
        converters = [c.strip() for c in converters.split(",")]
    quantize = doc.get("quantize", {}).get("linear", {})
    if "quantize.linear.mx" in converters or "mx" in converters:
        return "mxfp8", []
    if "quantize.linear.float8" not in converters and "float8" not in converters:
        return "", []
    name = quantize.get("float8", {}).get("recipe_name") or "tensorwise"
    if name not in FP8_RECIPES:
        raise UserError(f"{name!r} is not modelled; allowed: {', '.join(FP8_RECIPES)}", source=source,
                        field="quantize.linear.float8.recipe_name")
    notes = []
    filters = quantize.get("float8", {}).get("filter_fqns", [])
    if "auto_filter_small_kn" not in filters:
        notes.append("quantize.linear.float8 without auto_filter_small_kn converts small linears too; meshplan "
                     "prices torchao's auto filter (the small ones in bf16)")
    return FP8_RECIPES[name], notes


def _ignored(doc: dict) -> tuple[str, ...]:
    out = []
    for section, body in doc.items():
        if section.startswith("_"):
            continue
        if section == "quantize" and isinstance(body, dict):     # the linear converters' recipes are read (_fp8)
            out += [f"quantize.{k}" for k in body if k != "linear"]
            out += [f"quantize.linear.{k}" for k in body.get("linear", {}) if k not in ("float8", "mx")]
            continue
        if section not in MODELLED or not isinstance(body, dict):
            out.append(f"[{section}]")
        else:
            out += [f"{section}.{key}" for key in body if key not in MODELLED[section]]
    return tuple(out)


def _shard(doc: dict, source: str, gpus: int, tp: int, pp: int, cp: int, replicate: int) -> int:
    """data_parallel_shard_degree: -1 takes the GPUs the other degrees leave (job_config.py)."""
    shard = doc.get("parallelism", {}).get("data_parallel_shard_degree", -1)
    key = "parallelism.data_parallel_shard_degree"
    degrees = {"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "context_parallel_degree": cp,
               "data_parallel_replicate_degree": replicate}
    if shard == -1:
        return data_parallel(source, gpus, degrees)
    shard = positive_int(source, key, shard)
    if math.prod(degrees.values()) * shard != gpus:
        used = " x ".join(str(v) for v in [*degrees.values(), shard])
        raise UserError(f"{used} = {math.prod(degrees.values()) * shard} GPUs but --gpus is {gpus}; allowed: degrees "
                        f"whose product is {gpus}, or -1 to take the rest", source=source, field=key)
    return shard


def _zero(par: dict, source: str, shard: int, cp: int, pp: int) -> int:
    """FSDP (over the shard and context-parallel ranks) is ZeRO-3, or ZeRO-2 when the
    parameters stay gathered after forward; plain replication is ZeRO-0."""
    if shard * cp == 1:
        return 0
    policy = choice(source, "parallelism.fsdp_reshard_after_forward", par.get("fsdp_reshard_after_forward", "default"),
                    ("default", "always", "never"))
    reshard = policy == "always" or (policy == "default" and pp == 1)
    return 3 if reshard else 2


def _batch(doc: dict, source: str, ctx: Context, dp: int, pp: int) -> tuple[int, int, int]:
    """(micro-batch, global batch, micro-batches per replica): local_batch_size per data-parallel
    rank, split into pipeline micro-batches with a pipeline; global_batch_size (default local x
    dp) a multiple of local x dp, the rest gradient accumulation."""
    training = doc.get("training", {})
    key = "training.local_batch_size" if "local_batch_size" in training or "batch_size" not in training else \
        "training.batch_size"
    local = _int(doc, key, source, LOCAL_BATCH)
    micro = _int(doc, "parallelism.pipeline_parallel_microbatch_size", source, 1) if pp > 1 else local
    if local % micro:
        raise UserError(f"{micro} does not divide {key} {local} (torchtitan raises); allowed: a divisor of it",
                        source=source, field="parallelism.pipeline_parallel_microbatch_size")
    in_file = training.get("global_batch_size", -1)
    in_file = None if in_file == -1 else positive_int(source, "training.global_batch_size", in_file)
    batch = global_batch(source, "training.global_batch_size", in_file, ctx, local * dp)
    microbatches(source, "training.global_batch_size", key, batch, dp, local)    # torchtitan asserts it
    return micro, batch, batch // (dp * micro)


def _stage_blocks(doc: dict, source: str, graph: LayerGraph, pp: int, schedule: str) -> list[int]:
    """Blocks per virtual stage: from the split points or module lists when given, else as
    torchtitan generates them (pipeline_parallel_layers_per_stage, or one stage per rank for
    single-stage schedules and two for the others)."""
    par = doc["parallelism"]
    if par.get("pipeline_parallel_split_points"):
        return _blocks_at(source, graph, par["pipeline_parallel_split_points"])
    if par.get("module_fqns_per_model_part"):
        parts = par["module_fqns_per_model_part"]
        return [sum(1 for name in part if str(name).startswith("layers.")) for part in parts]
    first = _int(doc, "parallelism.pipeline_parallel_first_stage_less_layers", source, 1, minimum=0)
    last = _int(doc, "parallelism.pipeline_parallel_last_stage_less_layers", source, 1, minimum=0)
    per = par.get("pipeline_parallel_layers_per_stage")
    if per is not None:
        per = positive_int(source, "parallelism.pipeline_parallel_layers_per_stage", per)
        stages = math.ceil((graph.num_blocks + first + last) / per)
    else:
        stages = pp * (1 if schedule in SINGLE_STAGE else 2)
    return _generated_split(source, stages, graph.num_blocks, first, last)


def _blocks_at(source: str, graph: LayerGraph, points: list) -> list[int]:
    """Blocks per stage when each split point names the module that begins a stage."""
    names = [layer.name for layer in graph.layers]
    starts = [0]
    for point in points:
        name = MODULES.get(point, point)
        if name not in names or names.index(name) <= starts[-1]:
            raise UserError(f"{point!r} is not a module after the previous split point; allowed: tok_embeddings, "
                            f"layers.0 ... layers.{graph.num_blocks - 1}, norm, output, in order", source=source,
                            field="parallelism.pipeline_parallel_split_points")
        starts.append(names.index(name))
    bounds = starts + [len(names)]
    return [sum(1 for layer in graph.layers[a:b] if layer.is_block) for a, b in zip(bounds, bounds[1:])]


def _generated_split(source: str, stages: int, layers: int, first: int, last: int) -> list[int]:
    """generate_llm_fqn_per_model_part: the embedding weighs ``first`` layers and the output
    ``last``; the effective layers are shared evenly, the extra ones to the first stages."""
    if stages == 1:
        return [layers]
    per, extra = divmod(layers + first + last, stages)
    if per == 0 or first > per or last > per:
        raise UserError(f"{stages} stages of {layers} layers (+{first} for the embedding, +{last} for the output) "
                        "leave a stage without room (torchtitan raises); allowed: fewer stages",
                        source=source, field="parallelism.pipeline_parallel_layers_per_stage")
    blocks, left = [], layers
    for s in range(stages):
        n = per + (s < extra) - (first if s == 0 else last if s == stages - 1 else 0)
        blocks.append(min(n, left))
        left -= blocks[-1]
    return blocks


def _schedule(source: str, name: str, pp: int, vpp: int) -> tuple[str, list[str]]:
    if pp == 1:
        return schedule_of(pp, vpp), []
    if name in SINGLE_STAGE and vpp != 1:
        raise UserError(f"{name} runs one stage per rank but the split gives {vpp} (torchtitan raises); allowed: "
                        "Interleaved1F1B, or one stage per rank", source=source,
                        field="parallelism.pipeline_parallel_schedule")
    if name not in SINGLE_STAGE and vpp < 2:
        raise UserError(f"{name} needs at least two stages per rank (torchtitan raises); allowed: more split "
                        "points, or 1F1B", source=source, field="parallelism.pipeline_parallel_schedule")
    if name in SCHEDULES:
        return SCHEDULES[name], []
    instead = schedule_of(pp, vpp)
    return instead, [f"pipeline schedule {name} is modelled as {PIPELINE_SCHEDULES[instead].title}"]


def _recompute(ac: dict | None, source: str, blocks: int, pp: int) -> tuple[list[str], list[str]]:
    """Policy per block from [activation_checkpoint] (absent: torchtitan's default, selective
    "2", every second block in full)."""
    ac = ac or {}
    mode = choice(source, "activation_checkpoint.mode", ac.get("mode", "selective"),
                  ("none", "selective", "full", "memory_budget"))
    notes = [] if ac else ["no [activation_checkpoint]: torchtitan's default (selective, every second block)"]
    if mode in ("none", "full"):
        return [mode] * blocks, notes
    option = str(ac.get("selective_ac_option", "2"))
    if option == "op" and mode == "selective":
        return ["op"] * blocks, notes       # torchtitan's per-op policy: meshplan's "op" (planner/recompute.py)
    if mode == "memory_budget":
        return ["op"] * blocks, notes + [
            "activation_checkpoint memory_budget (torch.compile's partitioner chooses what to save) is modelled as "
            "operator-level selective recompute (op)"]
    every = positive_int(source, "activation_checkpoint.selective_ac_option", option, minimum=0) or 1
    if pp > 1 and every > 1:
        notes.append("selective_ac_option counts blocks per pipeline rank in torchtitan; here over the whole model")
    return [("full" if (i + 1) % every == 0 else "none") for i in range(blocks)], notes


def _precision(doc: dict, source: str) -> str:
    param = choice(source, "training.mixed_precision_param",
                   doc.get("training", {}).get("mixed_precision_param", "bfloat16"), ("bfloat16", "float32"))
    return "bf16" if param == "bfloat16" else "fp32"
