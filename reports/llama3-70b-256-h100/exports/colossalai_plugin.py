# Colossal-AI HybridParallelPlugin for llama3-70b on 256 x h100-80g (written by meshplan)
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin

plugin = HybridParallelPlugin(
    tp_size=1,
    pp_size=1,
    precision='bf16',
    zero_stage=2,
    microbatch_size=1,
    max_norm=1.0,
    enable_flash_attention=True,
    overlap_communication=True,
)
booster = Booster(plugin=plugin)
# per data-parallel rank and step: plugin.prepare_dataloader(dataset, batch_size=1)
