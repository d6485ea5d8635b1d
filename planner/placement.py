"""Where a plan's layers go: their pipeline stages, and the recompute policy of each.

Plain functions of the layer graph and a ParallelConfig, below the cost model: the cost model, the
simulation, the plan, the exports and the readers of other frameworks' files all place layers the
same way. Virtual stage j runs on pipeline rank j % pp (``PipelineSchedule.placement`` "loop"), or in a V
(placement "v": rank r holds stages r and 2 pp - 1 - r).
"""
from __future__ import annotations

from .config import ParallelConfig
from .layers import LayerGraph
from .schedules import SCHEDULES, rank_chunk, stage_of


def placement_of(config: ParallelConfig) -> str:
    """How ``config``'s virtual stages sit on its pipeline ranks (``PipelineSchedule.placement``)."""
    return SCHEDULES[config.schedule].placement if config.pp > 1 else "loop"


def rank_stages(placement: str, rank: int, pp: int, vpp: int) -> list[int]:
    """The virtual stages pipeline rank ``rank`` runs, chunk by chunk."""
    return [stage_of(placement, rank, chunk, pp) for chunk in range(vpp)]


def last_stage_rank(config: ParallelConfig) -> int:
    """The pipeline rank of the last virtual stage (the final norm and the head): pp - 1 in a loop, 0 in a V."""
    return rank_chunk(placement_of(config), config.pp * config.vpp - 1, config.pp)[0]


def holds_head_copy(graph: LayerGraph, config: ParallelConfig, rank: int) -> bool:
    """Whether pipeline rank ``rank`` holds the head's own copy of a tied embedding: the rank of the last stage
    under a pipeline (Shoeybi et al. 2019, Sec 3: the first and the last stage each hold the table). In a V that
    is rank 0, which then holds both copies as two stages' modules."""
    return graph.tied_embeddings and config.pp > 1 and rank == last_stage_rank(config)


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
    placement = placement_of(config)
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
    where = placement_of(config)
    return [[graph.layers[i].name for i in placement[rank][chunk]]
            for rank, chunk in (rank_chunk(where, j, config.pp) for j in range(config.pp * config.vpp))]


def recompute_per_layer(graph: LayerGraph, config: ParallelConfig) -> dict[str, str]:
    """Layer path -> its recompute policy."""
    return {layer.name: policy for layer, policy in zip(graph.layers, layer_policies(graph, config))}
