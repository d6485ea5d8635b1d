"""Plans shared by the report and export tests, searched once per test session."""
import functools

from planner import api
from planner.cluster import load_cluster
from planner.config import ParallelConfig, Workload
from planner.layers import build_layer_graph
from planner.model import ZOO
from planner.plan import Plan
from planner.report.gallery import SCENARIOS, plan_for


@functools.lru_cache(maxsize=None)
def gallery_plan(name: str):
    return plan_for(next(s for s in SCENARIOS if s.name == name))


def fixed_plan(model: str, cluster_name: str, gpus: int, config: ParallelConfig, **workload) -> Plan:
    """A Plan for one fully fixed config (as `meshplan plan` with every knob given). The
    runtime defaults to Megatron-LM's (the exports' main target; ZeRO-1 with TP and the
    interleaved schedule are its everyday combination, which meshplan's own executor lacks)."""
    workload.setdefault("framework", "megatron")
    spec = ZOO[model]
    graph = build_layer_graph(spec)
    cluster = load_cluster(cluster_name, gpus)
    work = Workload(global_batch=config.dp * config.micro_batch * config.num_microbatches, seq_len=spec.seq_len,
                    **workload)
    return api.fixed_plan(api.Job(model_source=model, spec=spec, graph=graph, cluster=cluster, workload=work), config)


# Llama-3 8B (embedding, 32 blocks, norm, head) with unequal stages and per-layer recompute,
# as the stage ILP chooses them: blocks per stage 6, 8, 9, 9; recomputed 6, 4, 2, 0
UNEQUAL = ParallelConfig(dp=2, tp=2, pp=4, micro_batch=1, num_microbatches=8, schedule="1f1b", zero=1,
                         sequence_parallel=True, stage_layers=(7, 8, 9, 11),
                         recompute_layers=("none",) + ("full",) * 10 + ("none",) * 4 + ("full",) * 2
                         + ("none",) * 7 + ("none",) * 11)
UNEQUAL_BLOCKS, UNEQUAL_RECOMPUTED = [6, 8, 9, 9], [6, 4, 2, 0]
# interleaved, 2 ranks x 2 chunks, blocks per virtual stage 9, 7, 8, 8, selective recompute
INTERLEAVED_UNEQUAL = ParallelConfig(dp=2, tp=1, pp=2, micro_batch=1, num_microbatches=4,
                                     schedule="interleaved-1f1b", vpp=2, zero=1, stage_layers=(10, 7, 8, 10),
                                     recompute="selective")
INTERLEAVED_BLOCKS = [9, 7, 8, 8]
