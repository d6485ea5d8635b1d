# Colossal-AI HybridParallelPlugin for gpt3-175b on 1024 x a100-80g (written by meshplan)
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin

plugin = HybridParallelPlugin(
    tp_size=8,
    pp_size=8,
    precision='bf16',
    zero_stage=1,
    max_norm=1.0,
    enable_flash_attention=True,
    overlap_communication=True,
    enable_sequence_parallelism=True,
    sequence_parallelism_mode='split_gather',
    num_microbatches=48,
    pp_style='interleaved',
    num_model_chunks=12,
)
booster = Booster(plugin=plugin)
# per data-parallel rank and step: plugin.prepare_dataloader(dataset, batch_size=96)
