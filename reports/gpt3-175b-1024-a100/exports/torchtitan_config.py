"""torchtitan config for gpt3-175b on 1024 x a100-80g (written by meshplan): the Python form
torchtitan reads since February 2026 (torchtitan/config/configs.py). Run with --module <this module> --config meshplan_plan;
set the dataset, tokenizer and steps for your run. The TOML form of torchtitan v0.2.2 and earlier is torchtitan.toml."""
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC
from torchtitan.models.llama3 import model_registry   # set your model's module
from torchtitan.trainer import Trainer


def meshplan_plan() -> Trainer.Config:
    return Trainer.Config(
        model_spec=model_registry('FLAVOR'),
        training=TrainingConfig(
            num_tokens_per_microbatch_per_dp_rank=4096,
            num_tokens_per_train_step=3145728,
            max_context_length=2048,
            max_norm=1.0,
            mixed_precision_param='bfloat16',
            mixed_precision_reduce='float32',
        ),
        parallelism=ParallelismConfig(
            tensor_parallel_degree=8,
            pipeline_parallel_degree=8,
            context_parallel_degree=1,
            data_parallel_shard_degree=16,
            data_parallel_replicate_degree=1,
            fsdp_reshard_after_forward='never',
            pipeline_parallel_schedule='Interleaved1F1B',
            module_fqns_per_model_part=[['tok_embeddings', 'layers.0'], ['layers.1'], ['layers.2'], ['layers.3'], ['layers.4'], ['layers.5'], ['layers.6'], ['layers.7'], ['layers.8'], ['layers.9'], ['layers.10'], ['layers.11'], ['layers.12'], ['layers.13'], ['layers.14'], ['layers.15'], ['layers.16'], ['layers.17'], ['layers.18'], ['layers.19'], ['layers.20'], ['layers.21'], ['layers.22'], ['layers.23'], ['layers.24'], ['layers.25'], ['layers.26'], ['layers.27'], ['layers.28'], ['layers.29'], ['layers.30'], ['layers.31'], ['layers.32'], ['layers.33'], ['layers.34'], ['layers.35'], ['layers.36'], ['layers.37'], ['layers.38'], ['layers.39'], ['layers.40'], ['layers.41'], ['layers.42'], ['layers.43'], ['layers.44'], ['layers.45'], ['layers.46'], ['layers.47'], ['layers.48'], ['layers.49'], ['layers.50'], ['layers.51'], ['layers.52'], ['layers.53'], ['layers.54'], ['layers.55'], ['layers.56'], ['layers.57'], ['layers.58'], ['layers.59'], ['layers.60'], ['layers.61'], ['layers.62'], ['layers.63'], ['layers.64'], ['layers.65'], ['layers.66'], ['layers.67'], ['layers.68'], ['layers.69'], ['layers.70'], ['layers.71'], ['layers.72'], ['layers.73'], ['layers.74'], ['layers.75'], ['layers.76'], ['layers.77'], ['layers.78'], ['layers.79'], ['layers.80'], ['layers.81'], ['layers.82'], ['layers.83'], ['layers.84'], ['layers.85'], ['layers.86'], ['layers.87'], ['layers.88'], ['layers.89'], ['layers.90'], ['layers.91'], ['layers.92'], ['layers.93'], ['layers.94'], ['layers.95', 'norm', 'output']],
            num_pp_microbatches=48,
            enable_sequence_parallel=True,
        ),
        activation_checkpoint=None,
    )
