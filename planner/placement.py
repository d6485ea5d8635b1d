"""Where a plan's layers go: their pipeline stages, and the recompute policy of each.

Plain functions of the layer graph and a ParallelConfig, below the cost model: the cost model, the
simulation, the plan, the exports and the readers of other frameworks' files all place layers the
same way. Virtual stage j runs on pipeline rank j % pp (``PipelineSchedule.placement`` "loop").
"""
from __future__ import annotations

from .config import ParallelConfig
from .layers import LayerGraph
from .schedules import SCHEDULES, rank_chunk


def balanced_stage_layers(graph: LayerGraph, stages: int) -> tuple[int, ...]:
    """Layers per virtual stage: blocks as even as possible (the extra ones in the middle
    stages), the embedding with the first stage, the final norm and head with the last."""
    blocks = graph.num_blocks
    base, extra = divmod(blocks, stages)
    order = sorted(range(stages), key=lambda s: (abs(s - (stages - 1) / 2), s))
    return stage_layers_of_blocks(graph, [base + (1 if s in order[:extra] else 0) for s in range(stages)])


def stage_layers_of_blocks(graph: LayerGraph, blocks: list[int]) -> tuple[int, ...]:
    """Layers per virtual stage from transformer blocks per virtual stage: the layers before
    the first block (the embedding) go with the first stage, those after the last block
    (the final norm and the head) with the last."""
    counts = list(blocks)
    first_block = next(i for i, layer in enumerate(graph.layers) if layer.is_block)
    last_block = max(i for i, layer in enumerate(graph.layers) if layer.is_block)
    counts[0] += first_block
    counts[-1] += len(graph.layers) - 1 - last_block
    return tuple(counts)


def assign_layers(graph: LayerGraph, config: ParallelConfig) -> list[list[list[int]]]:
    """[rank][chunk] -> layer indices. Virtual stage j runs on rank j % pp as its chunk j // pp, or in a V
    (``PipelineSchedule.placement`` "v": rank r holds stages r and 2 pp - 1 - r; ``schedules.rank_chunk``)."""
    stages = config.pp * config.vpp
    counts = config.stage_layers or balanced_stage_layers(graph, stages)
    placement = SCHEDULES[config.schedule].placement if config.pp > 1 else "loop"
    out: list[list[list[int]]] = [[[] for _ in range(config.vpp)] for _ in range(config.pp)]
    start = 0
    for j, count in enumerate(counts):
        rank, chunk = rank_chunk(placement, j, config.pp)
        out[rank][chunk] = list(range(start, start + count))
        start += count
    return out


def layer_policies(graph: LayerGraph, config: ParallelConfig) -> tuple[str, ...]:
    """Recompute policy per layer: the ILP's choice, else the uniform one on transformer blocks."""
    if config.recompute_layers is not None:
        return config.recompute_layers
    return tuple(config.recompute if layer.is_block else "none" for layer in graph.layers)


def stage_modules(graph: LayerGraph, config: ParallelConfig) -> list[list[str]]:
    """Module paths of each virtual stage, in order (what the executor splits on)."""
    placement = assign_layers(graph, config)
    where = SCHEDULES[config.schedule].placement if config.pp > 1 else "loop"
    return [[graph.layers[i].name for i in placement[rank][chunk]]
            for rank, chunk in (rank_chunk(where, j, config.pp) for j in range(config.pp * config.vpp))]


def recompute_per_layer(graph: LayerGraph, config: ParallelConfig) -> dict[str, str]:
    """Layer path -> its recompute policy."""
    return {layer.name: policy for layer, policy in zip(graph.layers, layer_policies(graph, config))}
