"""What Megatron-LM does to the first N layers beside one policy for every layer: offload their activations
(--cpu-offloading-num-layers N, ``Combinations.offloads_first_blocks``), searched where no recompute is fixed and
there is no pipeline, and recompute them in full on every (virtual) stage (--recompute-method block
--recompute-num-layers N, ``Combinations.recomputes_first_blocks``); each exported, read back, and refused where
Megatron-Core refuses it."""
import pytest

from planner import api
from planner.baseline import Context, read_baseline
from planner.cost.step import CostCache, peak_memory
from planner.errors import UserError
from planner.exports import megatron
from planner.placement import balanced_stage_layers
from planner.recompute import first_blocks
from planner.runtimes import config_refusals

# Megatron-Bridge's Llama 3 70B FP8 run on 64 GB200 (Megatron-FSDP, micro-batch 2 of 8192 tokens), whose recipe
# offloads 40 of the 80 layers: with no recompute its activations need about 320 GiB a GPU, with all of them
# recomputed about 56 (meshplan's numbers; the 173.3 GiB a GB200 offers)
JOB = dict(cluster="gb200-nvl72", gpus=64, global_batch=256, seq_len=8192, framework="megatron",
           precision="fp8-tensorwise", memory_headroom=0.0, grad_reduce_in_bf16=True, fp8_param_gather=True)
KNOBS = dict(tp=1, pp=1, cp=1, dp=64, micro_batch=2, zero=3)


@pytest.fixture(scope="module")
def job():
    return api.load_job("llama3-70b", **JOB)


@pytest.mark.parametrize("solver", ["uniform", "cbc"])
def test_the_search_offloads_the_fewest_first_blocks_that_fit(job, solver):
    plan = api.plan(job, api.Knobs(**KNOBS), top_k=1, solver=solver)
    c = plan.best.config
    blocks = [p for p, layer in zip(c.recompute_layers, job.graph.layers) if layer.is_block]
    n = blocks.count("activation-offload")
    assert 0 < n < 80 and blocks == ["activation-offload"] * n + ["none"] * (80 - n)   # the first n, none after
    assert plan.best.estimate.fits and plan.best.estimate.time.recompute > 0
    # one block fewer does not fit on the device
    cache = CostCache(job.graph, job.cluster, job.workload)
    fewer = c.but(recompute_layers=first_blocks(job.graph, n - 1, "activation-offload"))
    assert peak_memory(cache, fewer)[0] > cache.usable_bytes >= peak_memory(cache, c)[0]
    # it beats recomputing every block, which is what the search had before
    full = api.plan(job, api.Knobs(**KNOBS, recompute="full"), top_k=1, solver=solver)
    assert plan.best.estimate.step_time_s < full.best.estimate.step_time_s


def test_export_and_read_back(job, tmp_path):
    plan = api.plan(job, api.Knobs(**KNOBS), top_k=1, solver="uniform")
    n = plan.best.config.recompute_layers.count("activation-offload")
    text = megatron(plan).text
    flat = text.split()
    assert flat[flat.index("--cpu-offloading-num-layers") + 1] == str(n)
    assert "--recompute-granularity" not in flat
    path = tmp_path / "megatron_args.txt"
    path.write_text(text)
    baseline, _, _ = read_baseline(str(path), Context(gpus=64), "llama3-70b")
    assert baseline.config.recompute_layers == plan.best.config.recompute_layers


@pytest.mark.parametrize("flags, says", [
    ("--cpu-offloading-num-layers 32", "allowed: 0 to 31"),      # llama3-8b: 32 layers
    ("--cpu-offloading-num-layers 4 --pipeline-model-parallel-size 2", "Pipeline parallelism"),
    ("--cpu-offloading-num-layers 4 --recompute-granularity selective", "activation recomputation"),
])
def test_reader_refuses_what_megatron_core_refuses(tmp_path, flags, says):
    path = tmp_path / "args.txt"
    path.write_text("--micro-batch-size 1 --global-batch-size 16 --bf16 " + flags)
    with pytest.raises(UserError, match=says) as e:
        read_baseline(str(path), Context(gpus=8), "llama3-8b")
    assert e.value.field == "--cpu-offloading-num-layers"


def test_offload_on_every_block_or_with_a_pipeline_is_refused(job):
    with pytest.raises(UserError, match="--cpu-offloading-num-layers") as e:
        api.plan(job, api.Knobs(**KNOBS, recompute="activation-offload"), top_k=1)
    assert e.value.field == "--recompute"
    # the per-layer form: a pipeline beside it (ZeRO-1: Megatron-FSDP runs no pipeline either)
    c = api.plan(job, api.Knobs(**KNOBS), top_k=1, solver="uniform").best.config
    piped = c.but(pp=2, dp=32, zero=1)
    assert [k for k, _ in config_refusals(piped, "megatron", "cuda", num_blocks=80)] == ["pp"]
    everything = c.but(recompute_layers=first_blocks(job.graph, 80, "activation-offload"))
    assert [k for k, _ in config_refusals(everything, "megatron", "cuda", num_blocks=80)] == ["recompute"]
    assert config_refusals(c, "megatron", "cuda", num_blocks=80) == []
    # nor beside --ep-comm-overlap, whose schedule interleaves micro-batches layer by layer
    assert any("--ep-comm-overlap is not planned" in why
               for _, why in config_refusals(c, "megatron", "cuda", num_blocks=80, ep_comm_overlap=True))


# Llama 3 8B on 8 H100, 8192-token sequences, micro-batch 2 (ZeRO-1, no optimizer offload): with no recompute the
# activations do not fit, with every block recomputed they do (meshplan's numbers), so a Megatron-LM plan recomputes
# the first blocks of each stage
BLOCK_JOB = dict(cluster="h100-80g", gpus=8, global_batch=128, seq_len=8192, framework="megatron", precision="bf16",
                 memory_headroom=0.0)


@pytest.mark.parametrize("pp, vpp", [(1, 1), (2, 2)])
@pytest.mark.parametrize("solver", ["uniform", "cbc"])
def test_the_search_recomputes_the_fewest_first_blocks_of_every_stage(solver, pp, vpp):
    job = api.load_job("llama3-8b", **BLOCK_JOB)
    knobs = dict(tp=1, pp=pp, cp=1, micro_batch=2, zero=1, optimizer_offload=False, **({"vpp": vpp} if pp > 1 else {}))
    plan = api.plan(job, api.Knobs(**knobs), top_k=1, solver=solver)
    c = plan.best.config
    stages = c.stage_layers or balanced_stage_layers(job.graph, c.pp * c.vpp)
    counts, start = [], 0
    for count in stages:            # per stage: its blocks' policies, full first
        blocks = [p for p, layer in zip(c.recompute_layers[start:start + count], job.graph.layers[start:start + count])
                  if layer.is_block]
        n = blocks.count("full")
        assert blocks == ["full"] * n + ["none"] * (len(blocks) - n)
        counts.append(n)
        start += count
    k = counts[0]
    assert set(counts) == {k} and 0 < k < 32 // len(stages), counts       # the same on every stage, not all
    cache = CostCache(job.graph, job.cluster, job.workload)
    fewer = c.but(recompute_layers=first_blocks(job.graph, k - 1, "full", stages))
    assert peak_memory(cache, fewer)[0] > cache.usable_bytes >= peak_memory(cache, c)[0]
    everything = api.plan(job, api.Knobs(**knobs, recompute="full"), top_k=1, solver=solver)
    assert plan.best.estimate.step_time_s < everything.best.estimate.step_time_s


def test_block_recompute_exports_and_reads_back(tmp_path):
    job = api.load_job("llama3-8b", **BLOCK_JOB)
    plan = api.plan(job, api.Knobs(tp=1, pp=2, vpp=2, cp=1, micro_batch=2, zero=1, optimizer_offload=False), top_k=1,
                    solver="uniform")
    flat = megatron(plan).text.split()
    k = plan.best.config.recompute_layers.count("full") // 4          # 4 virtual stages
    assert flat[flat.index("--recompute-method") + 1] == "block"
    assert flat[flat.index("--recompute-num-layers") + 1] == str(k)
    path = tmp_path / "megatron_args.txt"
    path.write_text(megatron(plan).text)
    baseline, _, _ = read_baseline(str(path), Context(gpus=8), "llama3-8b")
    assert baseline.config.recompute_layers == plan.best.config.recompute_layers
