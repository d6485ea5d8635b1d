# Colossal-AI HybridParallelPlugin for llama3-8b on 8 x h100-80g (written by meshplan)
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin

plugin = HybridParallelPlugin(
    tp_size=1,
    pp_size=2,
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
    num_layers_per_stage=[5, 4, 4, 4, 4, 4, 4, 3],
)
booster = Booster(plugin=plugin)
# per data-parallel rank and step: plugin.prepare_dataloader(dataset, batch_size=128)
