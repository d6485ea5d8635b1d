"""Megatron-Core's activation offload of its first N layers (--cpu-offloading-num-layers): searched where no
recompute is fixed and there is no pipeline, exported, read back, and refused where Megatron-Core refuses it
(planner/runtimes.py ``Combinations.offloads_first_blocks``)."""
import pytest

from planner import api
from planner.baseline import Context, read_baseline
from planner.cost.step import CostCache, peak_memory
from planner.errors import UserError
from planner.exports import megatron
from planner.recompute import first_blocks_offloaded

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
    fewer = c.but(recompute_layers=first_blocks_offloaded(job.graph, n - 1))
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
    from planner.runtimes import config_refusals
    c = api.plan(job, api.Knobs(**KNOBS), top_k=1, solver="uniform").best.config
    piped = c.but(pp=2, dp=32, zero=1)
    assert [k for k, _ in config_refusals(piped, "megatron", "cuda", num_blocks=80)] == ["pp"]
    everything = c.but(recompute_layers=first_blocks_offloaded(job.graph, 80))
    assert [k for k, _ in config_refusals(everything, "megatron", "cuda", num_blocks=80)] == ["recompute"]
    assert config_refusals(c, "megatron", "cuda", num_blocks=80) == []
    # nor beside --ep-comm-overlap, whose schedule interleaves micro-batches layer by layer
    assert any("--ep-comm-overlap is not planned" in why
               for _, why in config_refusals(c, "megatron", "cuda", num_blocks=80, ep_comm_overlap=True))
