"""Exports use only what each framework documents, and say what they cannot express.

The documented lists below are copied from each framework's documentation or argument
definitions (sources named per list); an export that uses anything else fails here.
"""
import ast
import json
import re
import shlex
import tomllib

import pytest

from gallery_plans import (INTERLEAVED_BLOCKS, INTERLEAVED_UNEQUAL, UNEQUAL, UNEQUAL_BLOCKS, UNEQUAL_RECOMPUTED,
                           fixed_plan, gallery_plan)
from planner.config import ParallelConfig
from planner.exports import colossalai, deepspeed, megatron, meshplan_run, torchtitan, write_exports
from planner.report.gallery import SCENARIOS

# DeepSpeed configuration JSON, https://www.deepspeed.ai/docs/config-json/ (deepspeedai/DeepSpeed,
# docs/_pages/config-json.md): batch size parameters, bf16/fp16, gradient clipping, ZeRO
# optimizations (stage, overlap_comm, contiguous_gradients, offload_optimizer: device, pin_memory),
# Tensor Parallel (AutoTP) tensor_parallel.autotp_size, activation checkpointing.
DEEPSPEED_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "bf16", "bf16.enabled", "fp16", "fp16.enabled",
    "zero_optimization", "zero_optimization.stage", "zero_optimization.overlap_comm",
    "zero_optimization.contiguous_gradients", "zero_optimization.reduce_bucket_size",
    "zero_optimization.offload_optimizer", "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_optimizer.pin_memory",
    "tensor_parallel", "tensor_parallel.autotp_size",
    "activation_checkpointing", "activation_checkpointing.partition_activations",
    "activation_checkpointing.cpu_checkpointing", "activation_checkpointing.contiguous_memory_optimization",
    "activation_checkpointing.number_checkpoints", "activation_checkpointing.synchronize_checkpoint_boundary",
    "activation_checkpointing.profile",
}

# Megatron-LM, megatron/training/arguments.py (NVIDIA/Megatron-LM): flag -> its choices, None for a
# free value, () for a store_true switch. Groups: network size, regularization, training,
# mixed precision, distributed, data, moe.
MEGATRON_FLAGS = {
    "--num-layers": None, "--hidden-size": None, "--ffn-hidden-size": None, "--num-attention-heads": None,
    "--kv-channels": None, "--group-query-attention": (), "--num-query-groups": None,
    "--max-position-embeddings": None, "--position-embedding-type": {"learned_absolute", "rope", "mrope", "relative",
                                                                      "none"},
    "--normalization": {"LayerNorm", "RMSNorm"}, "--swiglu": (), "--untie-embeddings-and-output-weights": (),
    "--attention-backend": {"flash", "fused", "unfused", "local", "auto"},
    "--attention-dropout": None, "--hidden-dropout": None, "--disable-bias-linear": (), "--add-qkv-bias": (),
    "--micro-batch-size": None, "--global-batch-size": None, "--seq-length": None,
    "--recompute-granularity": {"full", "selective"}, "--recompute-method": {"uniform", "block"},
    "--recompute-num-layers": None, "--sequence-parallel": (), "--tp-comm-overlap": (),
    "--optimizer-cpu-offload": (), "--optimizer-offload-fraction": None,
    "--bf16": (), "--fp16": (),
    "--tensor-model-parallel-size": None, "--pipeline-model-parallel-size": None, "--context-parallel-size": None,
    "--decoder-first-pipeline-num-layers": None, "--decoder-last-pipeline-num-layers": None,
    "--pipeline-model-parallel-layout": None, "--num-layers-per-virtual-pipeline-stage": None,
    "--overlap-grad-reduce": (), "--overlap-param-gather": (), "--use-distributed-optimizer": (),
    "--use-megatron-fsdp": (), "--ckpt-format": {"torch", "torch_dist", "torch_dcp", "fsdp_dtensor"}, "--data-parallel-sharding-strategy": {"no_shard", "optim", "optim_grads",
                                                                     "optim_grads_params"},
    "--num-experts": None, "--moe-router-topk": None,
}

# Colossal-AI, colossalai/booster/plugin/hybrid_parallel_plugin.py (hpcaitech/ColossalAI):
# HybridParallelPlugin.__init__ parameters, and PipelineGradientCheckpointConfig's fields
# (colossalai/shardformer/shard/grad_ckpt_config.py).
COLOSSAL_KWARGS = {
    "tp_size", "pp_size", "sp_size", "precision", "zero_stage", "enable_all_optimization",
    "enable_fused_normalization", "enable_flash_attention", "enable_jit_fused", "enable_sequence_parallelism",
    "sequence_parallelism_mode", "enable_sequence_overlap", "parallel_output", "num_microbatches", "microbatch_size",
    "initial_scale", "min_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "max_scale",
    "max_norm", "broadcast_buffers", "ddp_bucket_cap_mb", "find_unused_parameters", "check_reduction",
    "gradient_as_bucket_view", "static_graph", "zero_bucket_size_in_m", "cpu_offload", "communication_dtype",
    "overlap_communication", "custom_policy", "pp_style", "num_model_chunks", "num_layers_per_stage",
    "gradient_checkpoint_config", "enable_metadata_cache", "make_vocab_size_divisible_by", "dp_outside",
    "overlap_p2p", "overlap_allgather",
}
COLOSSAL_CHECKPOINT_KWARGS = {"gradient_checkpointing_ratio", "num_ckpt_layers_per_stage"}

# torchtitan, torchtitan/config/job_config.py (pytorch/torchtitan): sections and their fields.
TORCHTITAN_KEYS = {
    "job": {"config_file", "dump_folder", "description", "use_for_integration_test", "print_args"},
    "model": {"name", "flavor", "tokenizer_path", "converters", "print_after_conversion"},
    "training": {"dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
                 "enable_cpu_offload", "mixed_precision_param", "mixed_precision_reduce", "compile", "gc_freq",
                 "gc_debug", "seed", "deterministic"},
    "parallelism": {"data_parallel_replicate_degree", "enable_compiled_autograd", "data_parallel_shard_degree",
                    "fsdp_reshard_after_forward", "tensor_parallel_degree", "disable_loss_parallel",
                    "enable_async_tensor_parallel", "pipeline_parallel_degree", "module_fqns_per_model_part",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size", "context_parallel_degree",
                    "context_parallel_rotate_method", "expert_parallel_degree"},
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns"},
}
# torch.distributed.pipelining schedule names (torch/distributed/pipelining/schedules.py get_schedule_class)
TORCH_SCHEDULES = {"1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"}

# meshplan's executor: `meshplan run` flags (planner/cli/run.py add_parser);
# flag -> takes a value.
MESHPLAN_RUN_FLAGS = {"--plan": True, "--model": True, "--steps": True, "--nproc": True, "--nnodes": True,
                      "--node-rank": True, "--rdzv-endpoint": True, "--seed": True, "--save": True, "--load": True,
                      "--out": True, "--json": False}

PLANS = [s.name for s in SCENARIOS]


def flatten(doc: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in doc.items():
        keys.add(prefix + k)
        if isinstance(v, dict):
            keys |= flatten(v, prefix + k + ".")
    return keys


def megatron_args(text: str) -> dict[str, list[str]]:
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            flag, *values = shlex.split(line)      # the values quoted as a shell reads them
            assert flag not in out, f"{flag} given twice"
            out[flag] = values
    return out


def layout_blocks(layout: str) -> list[int]:
    """Blocks per stage of a --pipeline-model-parallel-layout written out in letters."""
    assert re.fullmatch(r"[EtL|]+", layout), layout
    return [stage.count("t") for stage in layout.split("|")]


def colossal_calls(text: str) -> dict[str, dict]:
    tree = ast.parse(text)
    calls = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            calls[node.func.id] = {kw.arg: kw.value for kw in node.keywords}
    return calls


# -- DeepSpeed ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PLANS)
def test_deepspeed_config_uses_documented_keys(name):
    plan = gallery_plan(name)
    c = plan.best.config
    cfg = json.loads(deepspeed(plan).text)
    assert flatten(cfg) <= DEEPSPEED_KEYS, flatten(cfg) - DEEPSPEED_KEYS
    # documented: train_batch_size = micro-batch x accumulation x data-parallel GPUs
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * c.dp
    assert cfg["zero_optimization"]["stage"] == c.zero
    assert cfg.get("bf16", {}).get("enabled") is (plan.workload.precision == "bf16")


def test_deepspeed_says_what_it_cannot_split():
    ex = deepspeed(fixed_plan("llama3-8b", "h100-80g", 16, UNEQUAL))
    assert any("cannot be given exactly" in n and "[6, 8, 9 x2]" in n for n in ex.notes)
    assert any("per stage: [6, 4, 2, 0]" in n for n in ex.notes)


# -- Megatron-LM ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PLANS)
def test_megatron_args_are_documented_flags(name):
    plan = gallery_plan(name)
    c, spec = plan.best.config, plan.spec
    args = megatron_args(megatron(plan).text)
    for flag, values in args.items():
        assert flag in MEGATRON_FLAGS, flag
        kind = MEGATRON_FLAGS[flag]
        if kind == ():
            assert values == [], flag
        else:
            assert len(values) == 1, flag
            assert kind is None or values[0] in kind, (flag, values)
    assert int(args["--tensor-model-parallel-size"][0]) == c.tp
    assert int(args["--pipeline-model-parallel-size"][0]) == c.pp
    assert int(args["--num-layers"][0]) == spec.num_layers
    assert int(args["--global-batch-size"][0]) == plan.workload.global_batch
    # Megatron accepts at most one of these (validate_args)
    assert sum(f in args for f in ("--num-layers-per-virtual-pipeline-stage", "--pipeline-model-parallel-layout",
                                   "--num-virtual-stages-per-pipeline-rank")) <= 1


def test_megatron_expresses_unequal_stages_and_per_stage_recompute():
    args = megatron_args(megatron(fixed_plan("llama3-8b", "h100-80g", 16, UNEQUAL)).text)
    # first and last stage differ, the middle ones... here they differ too: the layout is needed
    assert layout_blocks(args["--pipeline-model-parallel-layout"][0]) == UNEQUAL_BLOCKS
    assert args["--pipeline-model-parallel-layout"][0].startswith("E") and args[
        "--pipeline-model-parallel-layout"][0].endswith("L")
    assert args["--recompute-method"] == ["block"] and args["--recompute-num-layers"] == [str(max(UNEQUAL_RECOMPUTED))]
    interleaved = megatron(fixed_plan("llama3-8b", "h100-80g", 4, INTERLEAVED_UNEQUAL))
    args = megatron_args(interleaved.text)
    assert layout_blocks(args["--pipeline-model-parallel-layout"][0]) == INTERLEAVED_BLOCKS
    assert args["--recompute-granularity"] == ["selective"]


def test_megatron_first_and_last_stage_flags_when_only_they_differ():
    from dataclasses import replace
    config = replace(UNEQUAL, stage_layers=(6, 9, 9, 11), recompute_layers=None, recompute="full")
    args = megatron_args(megatron(fixed_plan("llama3-8b", "h100-80g", 16, config)).text)
    assert args["--decoder-first-pipeline-num-layers"] == ["5"]
    assert args["--decoder-last-pipeline-num-layers"] == ["9"]
    assert "--pipeline-model-parallel-layout" not in args
    assert args["--recompute-method"] == ["uniform"]


def test_megatron_notes_what_block_recompute_over_recomputes():
    ex = megatron(fixed_plan("llama3-8b", "h100-80g", 16, UNEQUAL))
    assert any("[6, 4, 2, 0]" in n and "12 more block recomputes" in n for n in ex.notes)


# -- Colossal-AI --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PLANS)
def test_colossalai_plugin_uses_documented_arguments(name):
    plan = gallery_plan(name)
    c = plan.best.config
    calls = colossal_calls(colossalai(plan).text)
    kwargs = calls["HybridParallelPlugin"]
    assert set(kwargs) <= COLOSSAL_KWARGS, set(kwargs) - COLOSSAL_KWARGS
    value = {k: ast.literal_eval(v) for k, v in kwargs.items() if k != "gradient_checkpoint_config"}
    assert value["tp_size"] == c.tp and value["pp_size"] == c.pp
    assert value["precision"] in {"fp16", "bf16", "fp32"}
    assert value["zero_stage"] in ({0, 1} if c.pp > 1 else {0, 1, 2})          # the plugin's assertions
    if c.pp > 1:
        assert value["pp_style"] in {"1f1b", "interleaved"}
    if "sequence_parallelism_mode" in value:
        assert value["sequence_parallelism_mode"] in {"split_gather", "ring", "all_to_all", "ring_attn"}
    if "PipelineGradientCheckpointConfig" in calls:
        assert set(calls["PipelineGradientCheckpointConfig"]) <= COLOSSAL_CHECKPOINT_KWARGS


def test_colossalai_expresses_unequal_stages_exactly():
    calls = colossal_calls(colossalai(fixed_plan("llama3-8b", "h100-80g", 16, UNEQUAL)).text)
    assert ast.literal_eval(calls["HybridParallelPlugin"]["num_layers_per_stage"]) == UNEQUAL_BLOCKS
    assert ast.literal_eval(calls["PipelineGradientCheckpointConfig"]["num_ckpt_layers_per_stage"]) == \
        UNEQUAL_RECOMPUTED
    calls = colossal_calls(colossalai(fixed_plan("llama3-8b", "h100-80g", 4, INTERLEAVED_UNEQUAL)).text)
    # virtual stage j = chunk * pp + rank, the order PipelineGradientCheckpointConfig indexes
    assert ast.literal_eval(calls["HybridParallelPlugin"]["num_layers_per_stage"]) == INTERLEAVED_BLOCKS


# -- torchtitan ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PLANS)
def test_torchtitan_config_uses_documented_keys(name):
    plan = gallery_plan(name)
    c = plan.best.config
    doc = tomllib.loads(torchtitan(plan).text)
    for section, body in doc.items():
        assert section in TORCHTITAN_KEYS, section
        assert set(body) <= TORCHTITAN_KEYS[section], set(body) - TORCHTITAN_KEYS[section]
    par = doc["parallelism"]
    assert (par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] * par["tensor_parallel_degree"]
            * par["pipeline_parallel_degree"] * par["context_parallel_degree"]) == plan.cluster.num_gpus
    assert doc["activation_checkpoint"]["mode"] in {"selective", "full", "none"}
    if c.pp > 1:
        assert par["pipeline_parallel_schedule"] in TORCH_SCHEDULES
        parts = par["module_fqns_per_model_part"]
        assert len(parts) == c.pp * c.vpp
        modules = [name for part in parts for name in part]     # every module once, in order
        assert modules == ["tok_embeddings"] + [f"layers.{i}" for i in range(plan.graph.num_blocks)] + ["norm",
                                                                                                       "output"]
    assert doc["training"]["seq_len"] == plan.workload.seq_len


def test_torchtitan_split_points_follow_unequal_stages():
    doc = tomllib.loads(torchtitan(fixed_plan("llama3-8b", "h100-80g", 16, UNEQUAL)).text)
    # stage 0 = embed + layers.0-5, stage 1 = layers.6-13, stage 2 = layers.14-22, stage 3 the rest
    parts = doc["parallelism"]["module_fqns_per_model_part"]
    assert [part[0] for part in parts] == ["tok_embeddings", "layers.6", "layers.14", "layers.23"]
    assert parts[0][-1] == "layers.5" and parts[-1][-2:] == ["norm", "output"]


# -- meshplan run / torchrun ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", PLANS)
def test_meshplan_run_and_torchrun_lines_parse(name):
    from torch.distributed.run import get_args_parser        # torchrun's own parser

    plan = gallery_plan(name)
    text = meshplan_run(plan).text.replace("$NODE_RANK", "0").replace("$MASTER_ADDR", "host0")   # as a shell would
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    run, torchrun = shlex.split(lines[0]), shlex.split(lines[1])
    assert run[:2] == ["meshplan", "run"]
    i = 2
    while i < len(run):
        assert run[i] in MESHPLAN_RUN_FLAGS, run[i]
        i += 2 if MESHPLAN_RUN_FLAGS[run[i]] else 1
    assert torchrun[0] == "torchrun"
    parsed = get_args_parser().parse_args(torchrun[1:])
    assert parsed.module and parsed.training_script == "executor.train"
    nodes = max(1, plan.cluster.num_gpus // plan.cluster.gpus_per_node)
    assert int(parsed.nproc_per_node) * nodes == plan.cluster.num_gpus
    assert parsed.nnodes == str(nodes) or (nodes == 1 and parsed.standalone)


def test_exports_and_notes_are_written(tmp_path):
    paths = write_exports(fixed_plan("llama3-8b", "h100-80g", 16, UNEQUAL), tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["NOTES.md", "colossalai_plugin.py", "deepspeed_config.json", "megatron_args.txt",
                     "meshplan_run.sh", "meshplan_sbatch.sh", "torchtitan.toml", "torchtitan_config.py"]
    notes = (tmp_path / "NOTES.md").read_text()
    assert "cannot be given exactly" in notes and "## megatron_args.txt" in notes


def test_torchtitan_says_it_shards_over_context_parallel_ranks():
    plan = fixed_plan("llama3-8b", "h100-80g", 8, ParallelConfig(dp=4, tp=1, pp=1, cp=2, zero=0, micro_batch=1,
                                                                num_microbatches=1))
    notes = " ".join(torchtitan(plan).notes)
    assert "dp_shard_cp" in notes and "cp 2" in notes and "ZeRO-0" in notes


# -- recompute policies in each framework's words -------------------------------------------------

EIGHT = ParallelConfig(dp=8, tp=1, pp=1, zero=3, micro_batch=1, num_microbatches=1)


def torch_plan(config: ParallelConfig):
    return fixed_plan("llama3-8b", "h100-80g", 8, config, framework="torch")


def test_torchtitan_runs_op_and_every_k_exactly():
    from dataclasses import replace
    from planner.recompute import every_k_layers
    from planner.layers import build_layer_graph
    from planner.model import ZOO
    op = torchtitan(torch_plan(replace(EIGHT, recompute="op")))
    assert tomllib.loads(op.text)["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert not op.notes
    every = replace(EIGHT, recompute="every-3", recompute_layers=every_k_layers(build_layer_graph(ZOO["llama3-8b"]), 3))
    ex = torchtitan(torch_plan(every))
    assert tomllib.loads(ex.text)["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "3"}
    assert not ex.notes


def test_every_k_over_a_pipeline_is_counted_per_rank_as_torchtitan_does():
    """torchtitan's layer-wise option counts the blocks of each pipeline rank: 32 blocks on 2 stages of
    16 with every-3 over the whole model is not what it runs (the 2nd stage would start at its 1st block)."""
    from dataclasses import replace
    from planner.recompute import every_k_layers
    from planner.layers import build_layer_graph
    from planner.model import ZOO
    config = ParallelConfig(dp=4, tp=1, pp=2, zero=1, micro_batch=1, num_microbatches=4, schedule="1f1b")
    graph = build_layer_graph(ZOO["llama3-8b"])
    three = replace(config, recompute="every-3", recompute_layers=every_k_layers(graph, 3))
    ex = torchtitan(torch_plan(three))              # 16 is not a multiple of 3: only the nearest, said so
    assert any("nearest" in n and "10 of 32" in n for n in ex.notes)
    two = replace(config, recompute="every-2", recompute_layers=every_k_layers(graph, 2))
    ex = torchtitan(torch_plan(two))
    assert tomllib.loads(ex.text)["activation_checkpoint"]["selective_ac_option"] == "2"
    assert not any("recompute" in n for n in ex.notes)


def test_policies_a_framework_lacks_become_full_recompute_with_a_note():
    from dataclasses import replace
    for policy, words in (("op", "operator-level"), ("activation-offload", "offload")):
        plan = torch_plan(replace(EIGHT, recompute=policy))
        mega = megatron(plan)
        if policy == "op":
            assert megatron_args(mega.text)["--recompute-granularity"] == ["full"]
            assert any(words in n for n in mega.notes)
        else:   # Megatron-LM offloads the activations of all layers but the last (llama3-8b: 32)
            assert megatron_args(mega.text)["--cpu-offloading-num-layers"] == ["31"]
            assert "--recompute-granularity" not in megatron_args(mega.text)
            assert any("at most 31 of the 32 layers" in n for n in mega.notes)
        assert any(words in n for n in deepspeed(plan).notes)
    offload = torchtitan(torch_plan(replace(EIGHT, recompute="activation-offload")))
    assert tomllib.loads(offload.text)["activation_checkpoint"] == {"mode": "full"}
    assert any("offload" in n for n in offload.notes)


def test_the_sbatch_export_starts_meshplan_run_on_every_node(tmp_path):
    """A 2-node plan's sbatch script: bash -n accepts it, its #SBATCH lines ask for the plan's nodes and GPUs,
    and run with stand-ins for scontrol, srun (one task per node, as Slurm starts them) and meshplan, each
    node's meshplan run gets the node's rank and the first node as the rendezvous."""
    import os
    import subprocess
    from planner import api
    from planner.exports import slurm
    plan = api.plan(api.load_job("llama3-70b", "h100-80g", gpus=16))
    script = tmp_path / "meshplan_sbatch.sh"
    script.write_text(slurm(plan).text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    directives = dict((line.split()[1].lstrip("-").split("=") + [""])[:2] for line in script.read_text().splitlines()
                      if line.startswith("#SBATCH"))
    assert directives["nodes"] == "2" and directives["gpus-per-node"] == "8" and directives["ntasks-per-node"] == "1"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # a long node list after the two used here: a script that stops reading it early fails under pipefail (SIGPIPE)
    stand_ins = {"scontrol": 'printf "node-a\\nnode-b\\n"; seq 1 200000 | sed "s/^/spare-/"',
                 "srun": 'for id in 0 1; do SLURM_NODEID=$id SLURM_NNODES=2 "${@:2}"; done',
                 "meshplan": 'echo "$@" >> "$LOG"'}
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log), "SLURM_JOB_NODELIST": "node-[a-b]"}
    assert subprocess.run(["bash", str(script)], env=env, cwd=tmp_path).returncode == 0
    calls = log.read_text().splitlines()
    assert len(calls) == 2
    for rank, call in enumerate(calls):
        args = call.split()
        flags = dict(zip(args[1::2], args[2::2])) if args[0] == "run" else {}
        assert args[0] == "run" and flags["--plan"] == "plan.json" and flags["--model"] == "llama3-70b"
        assert (flags["--nproc"], flags["--nnodes"], flags["--node-rank"]) == ("8", "2", str(rank))
        assert flags["--rdzv-endpoint"] == "node-a:29500"


def test_torchtitan_compiles_the_model_where_the_plan_compiles_its_blocks(tmp_path):
    """--compile: torchtitan.toml's [compile] (torchtitan's JobConfig Compile: enable, components) compiles the
    model as meshplan run does; the loss stays eager. The reader says how it prices compiled blocks."""
    from planner.exports import torchtitan_python
    compiled = fixed_plan("llama3-8b", "h100-80g", 8, EIGHT, framework="torch", compile=True)
    doc = tomllib.loads(torchtitan(compiled).text)
    assert doc["compile"] == {"enable": True, "components": ["model"]}
    assert "compile" not in tomllib.loads(torchtitan(torch_plan(EIGHT)).text)
    assert any("compile" in note for note in torchtitan_python(compiled).notes)
    for export in (megatron, deepspeed, colossalai):      # no such setting: said, not silently dropped
        assert any("torch.compile" in note for note in export(compiled).notes)
        assert not any("torch.compile" in note for note in export(torch_plan(EIGHT)).notes)
    path = tmp_path / "torchtitan.toml"
    path.write_text(torchtitan(compiled).text)
    from conftest import run_cli
    proc = run_cli("compare", "--cluster", "h100-80g", "--gpus", "8", "--model", "llama3-8b", "--baseline", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "pointwise ops fused" in proc.stdout


@pytest.mark.parametrize("zero, strategy", [(2, "optim_grads"), (3, "optim_grads_params")])
def test_megatron_fsdp_export_reads_back_as_the_plan(tmp_path, zero, strategy):
    """ZeRO-2/3 on the megatron runtime is Megatron-FSDP: the export names its sharding strategy and checkpoint
    format, and reading the file back gives the plan's stage on the same runtime."""
    from planner import api
    from planner.baseline import Context, read_baseline
    plan = api.plan(api.load_job("llama3-8b", "h100-80g", gpus=8, framework="megatron"),
                    api.Knobs(tp=1, pp=1, dp=8, zero=zero, micro_batch=1, recompute="full"), top_k=1)
    args = megatron_args(megatron(plan).text)
    assert args["--use-megatron-fsdp"] == [] and args["--data-parallel-sharding-strategy"] == [strategy]
    assert args["--ckpt-format"] == ["fsdp_dtensor"]
    path = tmp_path / "megatron_args.txt"
    path.write_text(megatron(plan).text)
    back, _, _ = read_baseline(str(path), Context(gpus=8), "llama3-8b")
    assert (back.config.zero, back.runtime) == (zero, "megatron")
