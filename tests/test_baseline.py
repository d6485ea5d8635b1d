"""Reading a job's own configuration (`meshplan compare --baseline FILE`): real-world-shaped
files of each format, the knobs read from them (expected values worked out by hand from
each framework's documented rules), and every bad input ending in one line, exit 2,
naming the file and the flag."""
import json

import pytest

from planner.baseline import Context, read_baseline
from test_cli import one_line_error

# Megatron-LM's own launch script for GPT-3 175B, shaped as examples/gpt3/train_gpt3_175b_distributed.sh
# (NVIDIA/Megatron-LM): variables, bash arrays, comments, continuations, torchrun.
GPT3_SCRIPT = r"""#!/bin/bash
# Runs the "175B" parameter model
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
NUM_NODES=128
TP=8
CHECKPOINT_PATH=$1
VOCAB_FILE=$3 #<Specify path to file>/gpt2-vocab.json

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
)
GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto # Can use (flash/fused/unfused/local)
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --train-iters 500000
    --weight-decay 0.1
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
)
MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size $TP
	--pipeline-model-parallel-size 16
)
DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file gpt2-vocab.json
    --merge-file gpt2-merges.txt
)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    --save $CHECKPOINT_PATH
"""

# A Llama-3 8B job as Megatron-Core users write it (Megatron-LM README, Llama examples): one
# command line with GQA, SwiGLU, RMSNorm, RoPE, sequence parallel, the distributed optimizer,
# context parallel and the interleaved schedule.
LLAMA_LINE = ("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
              "--num-attention-heads 32 --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm "
              "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear "
              "--seq-length 8192 --max-position-embeddings 8192 --tensor-model-parallel-size 2 "
              "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 4 --context-parallel-size 2 "
              "--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
              "--micro-batch-size 1 --global-batch-size 64 --recompute-activations --bf16 "
              "--tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-8B\n")

# A Hugging Face Trainer ZeRO-3 config (the shape of the DeepSpeed integration docs' ds_config_zero3.json).
HF_ZERO3 = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "stage3_prefetch_bucket_size": "auto", "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": 4, "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": False,
}

# Megatron-DeepSpeed's examples_deepspeed ds_config: ZeRO-1, fp16, activation checkpointing.
MEGATRON_DEEPSPEED = {
    "train_batch_size": 512, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "prescale_gradients": False,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1},
    "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True},
    "wall_clock_breakdown": False,
}

# torchtitan's llama3_70b.toml (torchtitan/models/llama3/train_configs, the TOML era).
TORCHTITAN_70B = """# NOTE: this toml config is a preset for 64 A100 GPUs.
[job]
dump_folder = "./outputs"
description = "Llama 3 70B training"

[profiling]
enable_profiling = true

[model]
name = "llama3"
flavor = "70B"
hf_assets_path = "./assets/hf/Llama-3.1-70B"

[optimizer]
name = "AdamW"
lr = 1.5e-4

[training]
local_batch_size = 8
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 1000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 8  # 8-way TP
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false

[activation_checkpoint]
mode = "full"

[compile]
enable=false
components = ["model", "loss"]
"""

# A torchtitan pipeline job: interleaved, torchtitan's default split, a pipeline micro-batch of 2,
# selective checkpointing of every second block.
TORCHTITAN_PP = """[model]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = 16
seq_len = 8192

[parallelism]
pipeline_parallel_degree = 4
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_microbatch_size = 2

[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"
"""


def read(tmp_path, name: str, text, **ctx):
    path = tmp_path / name
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    model = ctx.pop("model", None)
    return read_baseline(str(path), Context(**ctx), model)


# -- Megatron-LM ----------------------------------------------------------------------------------

def test_megatron_launch_script(tmp_path):
    b, spec, graph = read(tmp_path, "train_gpt3_175b_distributed.sh", GPT3_SCRIPT, gpus=1024)
    c = b.config
    # 1024 GPUs / (tp 8 x pp 16) = dp 8; 1536 / (8 x 1) = 192 micro-batches; 96 blocks / 16 = 6 per stage
    assert (c.dp, c.tp, c.pp, c.cp, c.vpp, c.schedule) == (8, 8, 16, 1, 1, "1f1b")
    assert (c.micro_batch, c.num_microbatches, b.global_batch) == (1, 192, 1536)
    assert (c.zero, c.recompute, c.sequence_parallel, c.optimizer_offload, c.stage_layers) == (0, "none", False, False,
                                                                                                None)
    assert (b.format, b.runtime, b.precision, b.seq_len, b.attention, b.overlap_grad_reduce) == (
        "megatron", "megatron", "fp16", 2048, "flash", False)
    # the model from the flags: GPT-2's 50,257 tokens padded to a multiple of 128 x tp 8 = 1024: 51,200
    assert (spec.num_layers, spec.hidden, spec.num_heads, spec.ffn_hidden, spec.vocab_size) == (96, 12288, 96, 49152,
                                                                                                  51200)
    assert (spec.mlp, spec.norm, spec.max_positions, spec.tied_embeddings) == ("gelu", "layernorm", 2048, True)
    assert {"--train-iters", "--weight-decay", "--clip-grad", "--lr", "--data-path", "--save",
            "--nproc_per_node", "--nnodes"} <= set(b.ignored)
    assert "--tensor-model-parallel-size" not in b.ignored and "--fp16" not in b.ignored
    assert "--merge-file" not in b.ignored      # read: GPT-2 BPE files (the vocabulary)
    assert any("51200" in n for n in b.notes)


def test_megatron_command_line_with_every_parallelism(tmp_path):
    b, spec, _ = read(tmp_path, "llama.sh", LLAMA_LINE, gpus=16, model="llama3-8b")
    c = b.config
    # 16 / (tp 2 x pp 2 x cp 2) = dp 2; 32 blocks / pp 2 = 16 per rank, 4 per virtual stage: vpp 4
    assert (c.dp, c.tp, c.pp, c.cp, c.vpp, c.schedule) == (2, 2, 2, 2, 4, "interleaved-1f1b")
    assert (c.micro_batch, c.num_microbatches) == (1, 32)
    assert (c.zero, c.recompute, c.sequence_parallel) == (1, "selective", True)
    assert c.stage_layers is None          # 4 blocks on each of 8 virtual stages: the balanced split
    assert (b.runtime, b.precision, b.seq_len, b.overlap_grad_reduce) == ("megatron", "bf16", 8192, True)
    assert {"--overlap-param-gather", "--tokenizer-model", "--nproc-per-node"} <= set(b.ignored)


def test_megatron_uneven_first_and_last_stage(tmp_path):
    text = ("--tensor-model-parallel-size 1\n--pipeline-model-parallel-size 4\n--decoder-first-pipeline-num-layers 6\n"
            "--decoder-last-pipeline-num-layers 6\n--micro-batch-size 1\n--global-batch-size 32\n--bf16\n")
    b, _, _ = read(tmp_path, "args.txt", text, gpus=8, model="llama3-8b")
    # (32 - 6 - 6) / 2 = 10 blocks on each middle rank; the embedding joins the first stage, norm and head the last
    assert b.config.stage_layers == (7, 10, 10, 8)
    assert (b.config.dp, b.config.num_microbatches) == (2, 16)


def test_megatron_block_recompute_per_stage(tmp_path):
    text = ("--pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16 --bf16 "
            "--recompute-granularity full --recompute-method block --recompute-num-layers 3\n")
    b, _, graph = read(tmp_path, "args.txt", text, gpus=8, model="llama3-8b")
    # the first 3 blocks of each 16-block stage recompute in full; layers: embed, 32 blocks, norm, head
    expected = ("none",) + ("full",) * 3 + ("none",) * 13 + ("full",) * 3 + ("none",) * 13 + ("none", "none")
    assert b.config.recompute_layers == expected and b.config.recompute == "full"


@pytest.mark.parametrize("model, modules, policy, says", [
    # Megatron-LM's default sub-modules for selective granularity: ["core_attn"] (TransformerConfig, core_v0.15.0)
    ("llama3-8b", "", "selective", None),
    ("llama3-8b", "--recompute-modules core_attn", "selective", None),
    # the output-discarding modules are meshplan's "discard" (all of them the model has: GPT-OSS, a MoE without
    # MLA, has layernorm and moe_act; DeepSeek-V3 mla_up_proj too)
    ("gpt-oss-120b", "--recompute-modules moe_act layernorm", "discard", None),
    ("deepseek-v3", "--recompute-modules layernorm moe_act mla_up_proj", "discard", None),
    ("deepseek-v3", "--recompute-modules moe_act", "discard", "frees what all of this model's output-discarding "
                                                            "modules free (layernorm moe_act mla_up_proj)"),
    ("gpt-oss-120b", "--recompute-modules layernorm moe_act core_attn", "discard", "core_attn beside"),
    # a dense model without MLA has none of them: read as discard, which frees nothing there, and said
    ("llama3-8b", "--recompute-modules layernorm", "discard", "none: it has no MoE block and no MLA"),
    # nargs='*' with no value: an empty list, nothing recomputed
    ("llama3-8b", "--recompute-modules", "none", "without core_attn"),
    # modules meshplan does not model are named, and priced as kept
    ("llama3-8b", "--recompute-modules mlp", "none", "--recompute-modules mlp: not modelled"),
])
def test_megatron_recompute_modules(tmp_path, model, modules, policy, says):
    # every value up to the next flag belongs to --recompute-modules (argparse nargs='*')
    text = (f"--micro-batch-size 1 --recompute-granularity selective {modules} --global-batch-size 64 --bf16\n")
    b, _, _ = read(tmp_path, "args.txt", text, gpus=64 if model != "llama3-8b" else 8, model=model)
    assert b.config.recompute == policy and b.global_batch == 64
    assert "--recompute-modules" not in b.ignored
    if says:
        assert any(says in note for note in b.notes), b.notes
    else:
        assert not any("--recompute-modules" in note for note in b.notes), b.notes


def test_megatron_recompute_modules_without_selective_is_noted(tmp_path):
    text = "--micro-batch-size 1 --recompute-modules mlp --global-batch-size 16 --bf16\n"
    b, _, _ = read(tmp_path, "args.txt", text, gpus=8, model="llama3-8b")
    assert b.config.recompute == "none"
    assert any("only under selective granularity" in note for note in b.notes), b.notes


def test_megatron_pipeline_layout(tmp_path):
    text = ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*7|t*8|t*8|t*9,L "
            "--micro-batch-size 1 --global-batch-size 16 --bf16\n")
    b, _, _ = read(tmp_path, "args.txt", text, gpus=8, model="llama3-8b")
    # 4 stages on 2 ranks: vpp 2; blocks 7, 8, 8, 9 plus the embedding first and norm and head last
    assert (b.config.vpp, b.config.schedule, b.config.stage_layers) == (2, "interleaved-1f1b", (8, 8, 8, 11))


@pytest.mark.parametrize("strategy, zero", [("optim_grads", 2), ("optim_grads_params", 3), ("optim", 1), ("no_shard", 0)])
def test_megatron_fsdp_reads_as_its_zero_stage_on_the_megatron_runtime(tmp_path, strategy, zero):
    text = f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy} --micro-batch-size 2 --bf16\n"
    b, _, _ = read(tmp_path, "args.txt", text, gpus=8, model="llama3-8b")
    # no --global-batch-size: Megatron's default is micro-batch x dp = 2 x 8
    assert (b.config.zero, b.runtime, b.global_batch, b.config.num_microbatches) == (zero, "megatron", 16, 1)


# -- DeepSpeed --------------------------------------------------------------------------------------

def test_deepspeed_hugging_face_zero3(tmp_path):
    b, _, _ = read(tmp_path, "ds_config_zero3.json", HF_ZERO3, gpus=8, model="llama3-8b", global_batch=64)
    c = b.config
    # train_batch_size "auto" comes from --global-batch: 64 = 2 x 4 x 8
    assert (c.dp, c.tp, c.pp, c.zero, c.optimizer_offload, c.micro_batch, c.num_microbatches) == (8, 1, 1, 3, True, 2, 4)
    assert (b.runtime, b.precision, b.overlap_grad_reduce, c.recompute) == ("deepspeed", "bf16", True, "none")
    assert {"optimizer", "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
            "zero_optimization.sub_group_size", "zero_optimization.contiguous_gradients",
            "zero_optimization.offload_optimizer.pin_memory"} <= set(b.ignored)
    assert any("auto" in n for n in b.notes)


def test_megatron_deepspeed_degrees_from_the_command_line(tmp_path):
    b, _, _ = read(tmp_path, "ds_config.json", MEGATRON_DEEPSPEED, gpus=64, model="gpt-7.5b", tp=4, pp=2)
    c = b.config
    # dp = 64 / (4 x 2) = 8; 512 = 4 x gradient accumulation x 8: 16 micro-batches; DeepSpeed's pipeline is 1F1B
    assert (c.dp, c.tp, c.pp, c.micro_batch, c.num_microbatches, c.schedule) == (8, 4, 2, 4, 16, "1f1b")
    assert (c.zero, c.recompute, b.precision, b.overlap_grad_reduce) == (1, "full", "fp16", False)
    assert "prescale_gradients" in b.ignored and "activation_checkpointing.partition_activations" in b.ignored


# -- torchtitan ---------------------------------------------------------------------------------------

def test_torchtitan_llama3_70b_preset(tmp_path):
    b, spec, _ = read(tmp_path, "llama3_70b.toml", TORCHTITAN_70B, gpus=256)
    c = b.config
    # data_parallel_shard_degree -1 takes the rest: 256 / 8 = 32; FSDP without a pipeline reshards: ZeRO-3
    assert (c.dp, c.tp, c.pp, c.cp, c.zero, c.sequence_parallel) == (32, 8, 1, 1, 3, True)
    # global batch: torchtitan's default local 8 x dp 32 = 256, one micro-batch of 8 per replica
    assert (c.micro_batch, c.num_microbatches, b.global_batch, c.recompute) == (8, 1, 256, "full")
    assert (spec.name, b.seq_len, b.precision, b.runtime) == ("llama3-70b", 8192, "bf16", "torchtitan")
    assert {"[job]", "[profiling]", "[optimizer]", "[checkpoint]", "training.max_norm", "training.steps",
            "training.dataset", "model.hf_assets_path"} <= set(b.ignored)
    # [compile] is read: enable = false, and no FP8 converter
    assert not b.compile and not b.fp8 and "[compile]" not in b.ignored


def test_torchtitan_interleaved_default_split(tmp_path):
    b, _, _ = read(tmp_path, "pp.toml", TORCHTITAN_PP, gpus=16)
    c = b.config
    # dp shard = 16 / 4 = 4, FSDP keeps the parameters with a pipeline ("default"): ZeRO-2; 2 stages per rank
    assert (c.dp, c.pp, c.vpp, c.zero, c.schedule) == (4, 4, 2, 2, "interleaved-1f1b")
    # global 16 x 4 = 64; 64 / (4 x micro-batch 2) = 8 micro-batches per replica
    assert (c.micro_batch, c.num_microbatches, b.global_batch) == (2, 8, 64)
    # generate_llm_fqn_per_model_part(8, 32, 1, 1): 34 effective layers, 4 each and the first two 5;
    # blocks 5-1, 5, 4, 4, 4, 4, 4, 4-1 -> layers with the embedding and norm + head
    assert c.stage_layers == (5, 5, 4, 4, 4, 4, 4, 5)
    # every second block (the 2nd, 4th, ...) checkpointed in full
    blocks = [p for p, layer in zip(c.recompute_layers, range(35)) if 1 <= layer <= 32]
    assert blocks == ["none", "full"] * 16 and c.recompute == "every-2"


def test_torchtitan_split_points(tmp_path):
    text = ("[training]\nlocal_batch_size = 8\nseq_len = 8192\n[parallelism]\npipeline_parallel_degree = 2\n"
            "data_parallel_shard_degree = 1\ndata_parallel_replicate_degree = 4\n"
            'pipeline_parallel_split_points = ["layers.10"]\n[activation_checkpoint]\nmode = "none"\n')
    b, _, _ = read(tmp_path, "split.toml", text, gpus=8, model="llama3-8b")
    # DDP (replicate 4, shard 1): ZeRO-0; blocks 0-9 | 10-31
    assert (b.config.dp, b.config.zero, b.config.stage_layers, b.config.recompute) == (4, 0, (11, 24), "none")


# -- bad inputs: one line, exit 2, the file and the flag named ---------------------------------------

MEGATRON_OK = "--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 64 --bf16\n"
BAD = [   # (file name, content, extra arguments, what the line must say)
    ("args.txt", "--tensor-model-parallel-size 3 --bf16\n", ["--gpus", "24"],
     ["args.txt", "--tensor-model-parallel-size", "3", "32 attention heads", "allowed"]),
    ("args.txt", "--tensor-model-parallel-size 16 --bf16\n", ["--gpus", "8"],
     ["args.txt", "--tensor-model-parallel-size", "16", "does not divide the 8 GPUs"]),
    ("args.txt", "--pipeline-model-parallel-size 5 --bf16\n", ["--gpus", "40"],
     ["args.txt", "--pipeline-model-parallel-size", "5 stages do not divide the model's 32 layers"]),
    ("args.txt", "--micro-batch-size 3 --global-batch-size 100 --bf16\n", ["--gpus", "8"],
     ["args.txt", "--global-batch-size", "100 sequences", "multiple of 24"]),
    ("args.txt", MEGATRON_OK, ["--gpus", "8", "--global-batch", "128"],
     ["args.txt", "--global-batch-size", "64", "--global-batch is 128"]),
    ("args.txt", "--recompute-granularity full --bf16\n", ["--gpus", "8"],
     ["args.txt", "--recompute-granularity", "--recompute-method", "uniform or block"]),
    ("args.txt", "--recompute-granularity partial --bf16\n", ["--gpus", "8"],
     ["args.txt", "--recompute-granularity", "'partial'", "full or selective"]),
    ("launch.sh", "torchrun pretrain_gpt.py --tensor-model-parallel-size $TP --bf16\n", ["--gpus", "8"],
     ["launch.sh", "--tensor-model-parallel-size", "$TP", "does not set"]),
    ("args.txt", "--tensor-model-parallel-size two --bf16\n", ["--gpus", "8"],
     ["args.txt", "--tensor-model-parallel-size", "'two'", "positive integer"]),
    ("args.txt", "--bf16 --fp16\n", ["--gpus", "8"], ["args.txt", "--bf16/--fp16", "one of them"]),
    ("args.txt", "--num-layers 80 --bf16\n", ["--gpus", "8"], ["args.txt", "--num-layers", "80", "llama3-8b", "32"]),
    ("args.txt", "--sequence-parallel --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                 "--num-layers-per-virtual-pipeline-stage 3 --bf16\n", ["--gpus", "8"],
     ["args.txt", "--num-layers-per-virtual-pipeline-stage", "3", "16 layers"]),
    ("args.txt", "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|t|t|L --bf16\n", ["--gpus", "8"],
     ["args.txt", "--pipeline-model-parallel-layout", "places 3 blocks", "32"]),
    ("args.txt", "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout E|tt|L --bf16\n", ["--gpus", "8"],
     ["args.txt", "--pipeline-model-parallel-layout", "'E|tt|L'", "a multiple of the pipeline size"]),
    ("v100.txt", MEGATRON_OK, ["--gpus", "16", "--cluster", "v100-32g"],
     ["v100.txt", "--bf16", "no bf16", "fp16, fp32"]),
    ("ds.json", {"train_batch_size": 100, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
     ["--gpus", "8"], ["ds.json", "train_batch_size", "100", "allowed: 64"]),
    ("ds.json", {"train_batch_size": 64, "zero_optimization": {"stage": 4}}, ["--gpus", "8"],
     ["ds.json", "zero_optimization.stage", "4", "0, 1, 2 or 3"]),
    ("ds.json", "{\"train_batch_size\": 64,", ["--gpus", "8"], ["ds.json", "not valid JSON", "line 1"]),
    ("ds.json", {"train_batch_size": 64, "zero_optimization": {"stage": 3}}, ["--gpus", "8", "--pp", "2"],
     ["ds.json", "zero_optimization.stage", "pipeline"]),
    ("ds.json", {"zero_optimization": {"stage": 1}}, ["--gpus", "8"], ["ds.json", "train_batch_size", "--global-batch"]),
    ("ds.json", {"train_batch_size": 64}, ["--gpus", "8", "--no-model"], ["ds.json", "--model", "no model"]),
    ("tt.toml", "[parallelism]\ntensor_parallel_degree = 2\ndata_parallel_shard_degree = 2\n", ["--gpus", "8"],
     ["tt.toml", "parallelism.data_parallel_shard_degree", "2 x 1 x 1 x 1 x 2 = 4", "--gpus is 8"]),
    ("tt.toml", "[parallelism]\ntensor_parallel_degree = 3\n", ["--gpus", "8"],
     ["tt.toml", "tensor_parallel_degree", "does not divide the 8 GPUs"]),
    ("tt.toml", "[parallelism\n", ["--gpus", "8"], ["tt.toml", "not valid TOML"]),
    ("tt.toml", "[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_split_points = [\"layer.4\"]\n",
     ["--gpus", "8"], ["tt.toml", "pipeline_parallel_split_points", "'layer.4'", "layers.0"]),
    ("tt.toml", "[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = \"1F1B\"\n"
                "pipeline_parallel_split_points = [\"layers.8\", \"layers.16\", \"layers.24\"]\n", ["--gpus", "8"],
     ["tt.toml", "pipeline_parallel_schedule", "1F1B", "Interleaved1F1B"]),
    ("tt.toml", "[training]\nlocal_batch_size = 3\n[parallelism]\npipeline_parallel_degree = 2\n"
                "pipeline_parallel_microbatch_size = 2\n", ["--gpus", "8"],
     ["tt.toml", "pipeline_parallel_microbatch_size", "does not divide"]),
    ("tt.toml", "[training]\nseq_len = 4096\n", ["--gpus", "8", "--seq-len", "8192"],
     ["tt.toml", "training.seq_len", "4096", "--seq-len is 8192"]),
    ("tt.toml", "[activation_checkpoint]\nmode = \"sometimes\"\n", ["--gpus", "8"],
     ["tt.toml", "activation_checkpoint.mode", "'sometimes'", "selective"]),
    ("tt.toml", "[parallelism]\ncontext_parallel_degree = 3\n", ["--gpus", "24"],
     ["tt.toml", "parallelism.context_parallel_degree", "cp 3", "sequence length (2048)", "multiple of 2 x cp"]),
    ("args.txt", MEGATRON_OK, ["--gpus", "8", "--tp", "2"], ["--tp/--pp", "only for a DeepSpeed config"]),
    ("args.txt", "--recompute-granularity selective --recompute-modules core_attn attn\n", ["--gpus", "8"],
     ["args.txt", "--recompute-modules", "'attn'", "core_attn, moe_act"]),
    ("missing.txt", None, ["--gpus", "8"], ["missing.txt", "cannot read"]),
]


@pytest.mark.parametrize("name,text,args,says", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_baselines_exit_2_with_one_line(cli, tmp_path, name, text, args, says):
    path = tmp_path / name
    if text is not None:
        path.write_text(text if isinstance(text, str) else json.dumps(text))
    model = [] if "--no-model" in args else ["--model", "llama3-8b"]
    args = [a for a in args if a != "--no-model"]
    if "--cluster" not in args:
        args += ["--cluster", "h100-80g"]
    line = one_line_error(cli("compare", "--baseline", str(path), *model, *args))
    for text in says:
        assert text in line, (text, line)


def test_bad_plan_json(cli, tmp_path):
    out = cli("plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--dp", "4", "--tp", "2",
              "--pp", "1", "--out", str(tmp_path / "plan.json"))
    assert out.returncode == 0, out.stderr
    line = one_line_error(cli("compare", "--baseline", str(tmp_path / "plan.json"), "--gpus", "16"))
    assert "plan.json" in line and "config.dp x tp x pp x cp" in line and "4 x 2 x 1 x 1 = 8" in line
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["schema_version"] = 7
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    line = one_line_error(cli("compare", "--baseline", str(tmp_path / "plan.json"), "--gpus", "8"))
    assert "schema_version" in line and "7" in line


# -- the gallery's published layouts (reports/baselines/) read as their comments say ---------------

PUBLISHED = {   # file -> (gpus, global batch, dp, tp, pp, vpp, ZeRO, micro-batch, micro-batches, recompute)
    "gpt3-175b-1024-a100.args": (1024, 1536, 8, 8, 16, 2, 0, 1, 192, "full"),
    "llama3-8b-8-h100.toml": (8, 128, 8, 1, 1, 1, 3, 1, 16, "op"),        # selective_ac_option = "op"
    "llama3-70b-256-h100.toml": (256, 256, 32, 8, 1, 1, 3, 8, 1, "full"),
    "llama3-405b-16384-h100.toml": (16384, 2048, 128, 8, 16, 2, 2, 1, 16, "none"),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_layouts_read_as_their_sources_say(name):
    from conftest import ROOT
    gpus, batch, *want = PUBLISHED[name]
    b, _, _ = read_baseline(str(ROOT / "reports" / "baselines" / name), Context(gpus=gpus, global_batch=batch))
    c = b.config
    assert [c.dp, c.tp, c.pp, c.vpp, c.zero, c.micro_batch, c.num_microbatches, c.recompute] == want
    # Llama 3's one layer fewer on the first and last stage (126 blocks on 32 virtual stages: 3, 4 x 30, 3)
    # is also meshplan's balanced split, which keeps the extra blocks in the middle
    assert c.stage_layers is None


def test_megatron_expert_tensor_parallelism_defaults_to_the_tensor_parallel_size(tmp_path):
    """Unset, --expert-tensor-parallel-size is the tensor-parallel size in Megatron-LM, with or without expert
    parallelism (arguments.py at core_r0.14.0): Mixtral's args with tp 2 and ep 8 and no such flag run its experts
    split over the tp ranks, which meshplan does not model, so they are refused naming the flag and why (they were
    read as expert tensor parallel 1); given as 1, they read as ep 8."""
    from planner.errors import UserError
    line = ("torchrun pretrain_gpt.py --tensor-model-parallel-size 2 --expert-model-parallel-size 8 --sequence-parallel "
            "--num-experts 8 --moe-router-topk 2 --micro-batch-size 1 --global-batch-size 64 --seq-length 4096 --bf16")
    with pytest.raises(UserError) as caught:
        read(tmp_path, "mixtral.sh", line, gpus=64, model="mixtral-8x7b")
    assert caught.value.field == "--expert-tensor-parallel-size" and "Megatron-LM's default" in str(caught.value)
    b, _, _ = read(tmp_path, "mixtral.sh", line + " --expert-tensor-parallel-size 1", gpus=64, model="mixtral-8x7b")
    assert (b.config.tp, b.config.ep) == (2, 8)
