# Colossal-AI HybridParallelPlugin for llama3-405b on 16384 x h100-80g (written by meshplan)
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin

plugin = HybridParallelPlugin(
    tp_size=8,
    pp_size=32,
    precision='bf16',
    zero_stage=1,
    max_norm=1.0,
    enable_flash_attention=True,
    overlap_communication=True,
    sp_size=4,
    enable_sequence_parallelism=True,
    sequence_parallelism_mode='ring_attn',
    num_microbatches=128,
    pp_style='interleaved',
    num_model_chunks=4,
)
booster = Booster(plugin=plugin)
# per data-parallel rank and step: plugin.prepare_dataloader(dataset, batch_size=128)
