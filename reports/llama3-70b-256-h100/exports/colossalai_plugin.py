# Colossal-AI HybridParallelPlugin for llama3-70b on 256 x h100-80g (written by meshplan)
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin
from colossalai.shardformer import PipelineGradientCheckpointConfig

checkpointing = PipelineGradientCheckpointConfig(
    num_ckpt_layers_per_stage=[2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
)

plugin = HybridParallelPlugin(
    tp_size=4,
    pp_size=4,
    precision='bf16',
    zero_stage=1,
    max_norm=1.0,
    enable_flash_attention=True,
    overlap_communication=True,
    sp_size=2,
    enable_sequence_parallelism=True,
    sequence_parallelism_mode='ring_attn',
    num_microbatches=32,
    pp_style='interleaved',
    num_model_chunks=10,
    num_layers_per_stage=[2, 2, 3, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1],
    gradient_checkpoint_config=checkpointing,
)
booster = Booster(plugin=plugin)
# per data-parallel rank and step: plugin.prepare_dataloader(dataset, batch_size=32)
