# Colossal-AI HybridParallelPlugin for llama3-405b on 16384 x h100-80g (written by meshplan)
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin
from colossalai.shardformer import PipelineGradientCheckpointConfig

checkpointing = PipelineGradientCheckpointConfig(
    num_ckpt_layers_per_stage=[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0],
)

plugin = HybridParallelPlugin(
    tp_size=4,
    pp_size=16,
    precision='bf16',
    zero_stage=1,
    max_norm=1.0,
    enable_flash_attention=True,
    overlap_communication=True,
    sp_size=2,
    enable_sequence_parallelism=True,
    sequence_parallelism_mode='ring_attn',
    num_microbatches=16,
    pp_style='interleaved',
    num_model_chunks=8,
    gradient_checkpoint_config=checkpointing,
)
booster = Booster(plugin=plugin)
# per data-parallel rank and step: plugin.prepare_dataloader(dataset, batch_size=16)
