"""torchtitan config for llama3-70b on 256 x h100-80g (written by meshplan): the Python form
torchtitan reads since February 2026 (torchtitan/config/configs.py). Run with --module <this module> --config meshplan_plan;
set the dataset, tokenizer and steps for your run. The TOML form of torchtitan v0.2.2 and earlier is torchtitan.toml."""
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer


def meshplan_plan() -> Trainer.Config:
    return Trainer.Config(
        model_spec=model_registry('70B'),
        training=TrainingConfig(
            num_tokens_per_microbatch_per_dp_rank=8192,
            num_tokens_per_train_step=2097152,
            max_context_length=8192,
            max_norm=1.0,
            mixed_precision_param='bfloat16',
            mixed_precision_reduce='float32',
        ),
        parallelism=ParallelismConfig(
            tensor_parallel_degree=1,
            pipeline_parallel_degree=1,
            context_parallel_degree=1,
            data_parallel_shard_degree=256,
            data_parallel_replicate_degree=1,
            fsdp_reshard_after_forward='always',
        ),
        activation_checkpoint=FullAC.Config(),
    )
