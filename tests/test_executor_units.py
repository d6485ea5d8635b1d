"""The executor's pure parts, without processes: plan.json checks, degrees, stage split, model
shape, and refusals that name what is missing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from executor_support import TINY_GPT, TINY_LLAMA, write_plan
from planner.errors import UserError


def _plan_doc(tmp_path, spec=TINY_LLAMA, **knobs) -> dict:
    return json.loads(Path(write_plan(tmp_path, spec, **knobs)).read_text())


@pytest.mark.parametrize("spec", [TINY_GPT, TINY_LLAMA], ids=["gpt", "llama"])
def test_reference_models_have_the_planner_module_paths_and_parameter_count(spec):
    from executor.models import build_model
    from planner.layers import build_layer_graph
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    modules = dict(model.named_modules())
    graph = build_layer_graph(spec)
    with_params = [op.name for layer in graph.layers for op in layer.ops if op.params]
    assert with_params and all(name in modules for name in with_params)
    assert [layer.name for layer in graph.layers] == ["embed", *(f"layers.{i}" for i in range(4)), "norm", "lm_head"]


def test_initial_weights_depend_on_name_and_seed_only():
    import torch
    from executor.models import full_init
    a = full_init("layers.0.attn.q_proj.weight", torch.Size([8, 8]), TINY_GPT, seed=0)
    assert torch.equal(a, full_init("layers.0.attn.q_proj.weight", torch.Size([8, 8]), TINY_GPT, seed=0))
    assert not torch.equal(a, full_init("layers.1.attn.q_proj.weight", torch.Size([8, 8]), TINY_GPT, seed=0))
    assert not torch.equal(a, full_init("layers.0.attn.q_proj.weight", torch.Size([8, 8]), TINY_GPT, seed=1))
    head = full_init("lm_head.weight", torch.Size([128, 64]), TINY_GPT, seed=0)       # tied: the embedding
    assert torch.equal(head, full_init("embed.tokens.weight", torch.Size([128, 64]), TINY_GPT, seed=0))


def test_pipeline_stages_keep_whole_model_paths(tmp_path):
    from executor.pipeline import build_stage_model
    from executor.support import check_stages
    from planner.plan import Plan
    plan = Plan.from_json(_plan_doc(tmp_path, gpus=2, pp=2, vpp=2, schedule="interleaved-1f1b", micro_batch=2))
    check_stages(plan.stages, plan.spec, plan.source)
    parts = [build_stage_model(plan.spec, stage) for stage in plan.stages]
    names = [name for part in parts for name, _ in part.named_parameters()]
    assert len(names) == len(set(names))
    assert sum(p.numel() for part in parts for p in part.parameters()) == TINY_LLAMA.num_params()
    assert parts[0].embed is not None and parts[0].lm_head is None and parts[-1].lm_head is not None


def test_stages_out_of_order_are_refused(tmp_path):
    from executor.support import check_stages
    from planner.plan import Plan
    plan = Plan.from_json(_plan_doc(tmp_path, gpus=2, pp=2, schedule="1f1b", micro_batch=2))
    swapped = (plan.stages[1], plan.stages[0])
    with pytest.raises(UserError, match="stages: the stages must list embed, layers.0 ... lm_head once each"):
        check_stages(swapped, plan.spec, "plan.json")


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(schema_version=9), "schema_version: unsupported schema version 9"),
    (lambda d: d["tp_plan"].update({"layers.0.attn.q_proj": "diagonal"}), "tp_plan: 'diagonal' for"),
    (lambda d: d["recompute_per_layer"].update({"layers.0": "some"}), "recompute_per_layer: 'some'"),
    (lambda d: d.pop("stages"), "stages: missing"),
    (lambda d: d["config"].update(wings=2), r"config: unknown field\(s\) wings"),
])
def test_bad_plan_json_names_the_field(tmp_path, change, message):
    from planner.plan import Plan
    doc = _plan_doc(tmp_path, gpus=2, tp=2)
    change(doc)
    with pytest.raises(UserError, match=message):
        Plan.from_json(doc, "p.json")


def test_degrees_must_multiply_to_the_world():
    from executor.mesh import ParallelDims
    with pytest.raises(UserError, match="= 4 but the job has 2 processes"):
        ParallelDims(pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=2, world_size=2)
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, world_size=4)
    assert dims.dp == 2 and dims.shape == (1, 1, 2, 1, 2)


@pytest.mark.parametrize("own", [True, False], ids=["own-model", "user-module"])
def test_data_parallel_wrapper_by_zero_stage(own):
    """One rule for meshplan's own models and a user's module (executor/parallelize.py ``dp_wrapper``):
    they differ only where ZeRO-2/3 has one data-parallel rank to shard over."""
    from types import SimpleNamespace

    from executor.mesh import ParallelDims
    from executor.parallelize import dp_wrapper, uses_fsdp

    def wrapper(zero: int, dp: int, tp: int = 1, pp: int = 1, cp: int = 1):
        plan = SimpleNamespace(config=SimpleNamespace(zero=zero, pp=pp), spec=TINY_LLAMA if own else None)
        sharded = zero >= 2
        dims = ParallelDims(pp=pp, dp_replicate=1 if sharded else dp, dp_shard=dp if sharded else 1, cp=cp, tp=tp,
                            world_size=pp * dp * cp * tp)
        assert uses_fsdp(plan, dims) == (dp_wrapper(plan, dims) in ("fsdp", "replicate"))
        return dp_wrapper(plan, dims)

    assert wrapper(3, dp=2) == wrapper(2, dp=2) == wrapper(3, dp=1, cp=2) == "fsdp"
    assert wrapper(3, dp=1, tp=2) == ("fsdp" if own else None)     # a user's module: nothing to shard over
    assert wrapper(0, dp=2, tp=2) == wrapper(0, dp=2, pp=2) == "replicate"
    assert wrapper(0, dp=2) == "ddp"
    assert wrapper(1, dp=2) is wrapper(0, dp=1, tp=2) is None


def test_cost_model_prices_layers_in_the_precision_the_wrapper_runs_them_in():
    """bf16 layers (FSDP2's MixedPrecisionPolicy, no autocast) exactly where the executor's FSDP2 or replicate
    manages a plan's mixed precision, autocast's where DDP or no wrapper does (ZeRO-1 under a pipeline included):
    planner/cost/step.py ``CostCache.regime`` against executor/parallelize.py ``uses_fsdp``, on meshplan's own
    model."""
    from types import SimpleNamespace

    from executor.mesh import ParallelDims
    from executor.parallelize import uses_fsdp
    from planner.cluster import load_cluster
    from planner.config import ParallelConfig, Workload
    from planner.cost.step import CostCache
    from planner.layers import build_layer_graph

    cache = CostCache(build_layer_graph(TINY_LLAMA), load_cluster("h100-80g", 8),
                      Workload(global_batch=8, seq_len=TINY_LLAMA.seq_len, precision="bf16"))
    seen = set()
    for zero in (0, 1, 2, 3):
        for dp, tp, pp, ep in ((1, 1, 1, 1), (2, 1, 1, 1), (8, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (1, 2, 2, 1),
                               (4, 2, 1, 1), (2, 1, 1, 2), (4, 1, 1, 2)):
            plan = SimpleNamespace(config=SimpleNamespace(zero=zero, pp=pp), spec=TINY_LLAMA)
            sharded = zero >= 2
            dims = ParallelDims(pp=pp, dp_replicate=1 if sharded else dp, dp_shard=dp if sharded else 1, cp=1,
                                tp=tp, world_size=pp * dp * tp, ep=ep)
            config = ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero)
            regime = cache.regime(config)
            assert regime == ("bf16" if uses_fsdp(plan, dims) else "autocast"), (zero, dp, tp, pp, ep)
            assert cache.context(config).eager_regime == regime
            seen.add((zero, regime, ep))
    assert {(1, "autocast", 1), (1, "bf16", 1)} & seen == {(1, "autocast", 1)}    # ZeRO-1: the executor's own
    assert {(0, "autocast", 1), (0, "bf16", 1), (0, "bf16", 2), (3, "bf16", 1)} <= seen     # replicate beside ep


@pytest.mark.parametrize("spec", [TINY_LLAMA, TINY_GPT], ids=["rmsnorm", "layernorm"])
def test_autocast_runs_the_residual_stream_in_fp32_and_the_norms_save_it(spec):
    """What planner/cost/layer.py RESIDUAL_AUTOCAST_BYTES prices: under autocast (fp32 parameters, the executor with
    DDP or no wrapper) the embedding's output and every block's output stay fp32, and the block's first norm saves
    that fp32 input for backward; with bf16 parameters (FSDP2's regime) the same tensor is bf16."""
    import torch

    from executor import models

    for dtype, autocast in ((torch.float32, True), (torch.bfloat16, False)):
        model = models.build_model(spec, device="cpu").to(dtype)
        block = next(iter(model.layers.values()))
        x = torch.randn(1, spec.seq_len, spec.hidden, dtype=dtype, requires_grad=True)
        saved = []

        def pack(t):
            saved.append(t)
            return t
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = block(x)
        assert y.dtype == dtype                             # the residual stream keeps the parameters' dtype
        # the norm keeps the block's input itself: fp32 under autocast (on the CPU, torch decomposes RMSNorm and
        # upcasts a bf16 input inside, so the bf16 side is checked on LayerNorm, whose kernel saves it as CUDA's do)
        if autocast or spec.norm == "layernorm":
            assert any(t.data_ptr() == x.data_ptr() and t.dtype == dtype for t in saved)


def test_tp_styles_for_a_vocabulary_parallel_loss_or_whole_tensors():
    from torch.distributed.tensor import Replicate, Shard

    from executor.parallelize import tp_style
    head = tp_style("colwise_loss", False)
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output       # meshplan's loss_parallel
    assert tp_style("colwise_loss", False, loss_parallel=False).output_layouts == (Replicate(),)
    assert tp_style("colwise", False).output_layouts == (Shard(-1),)
    assert tp_style("colwise", False, gather_output=True).output_layouts == (Replicate(),)
    assert tp_style("rowwise", True).output_layouts == (Shard(1),)                 # SP: reduce-scattered


def test_a_column_linear_gathers_its_output_unless_a_row_linear_of_its_layer_takes_it_next():
    from executor.parallelize import _gathers_output
    layers = ["embed", "blocks.0", "blocks.1", "head"]
    entries = [("embed", "vocab"), ("blocks.0.q", "colwise"), ("blocks.0.k", "colwise"), ("blocks.0.o", "rowwise"),
               ("blocks.1.up", "colwise"), ("blocks.1.gate", "colwise"), ("head", "colwise")]
    assert [_gathers_output(entries, i, layers) for i in (1, 2, 4, 5, 6)] == [False, False, True, True, True]


def test_replicated_key_value_heads_are_refused(tmp_path):
    from executor.support import check_supported
    from planner.plan import Plan
    # planned for Megatron-LM's runtime (which replicates key/value heads), then given to meshplan run
    plan = Plan.from_json(_plan_doc(tmp_path, gpus=4, tp=4, framework="megatron", micro_batch=8), "p.json")
    with pytest.raises(UserError, match="p.json: config.tp: tp 4 must divide the 2 key/value heads on the torch "
                                        "runtime on cuda"):
        check_supported(plan.config, plan.spec, "cuda", plan.source)


def test_torchrun_command_standalone_or_rendezvous():
    from executor.launch import Launch
    assert Launch(nproc=2).torchrun_args()[-3:] == ["--nproc-per-node", "2", "--standalone"]
    multi = Launch(nproc=8, nnodes=2, node_rank=1, rdzv_endpoint="host0:29500").torchrun_args()
    assert multi[-8:] == ["--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          "host0:29500"]
    with pytest.raises(UserError, match="--rdzv-endpoint: several nodes need a rendezvous endpoint"):
        Launch(nproc=8, nnodes=2).torchrun_args()


def test_importing_the_executor_package_and_the_cli_does_not_import_torch():
    import subprocess
    import sys
    code = "import sys, executor, planner.cli; print('torch' in sys.modules)"
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={"PYTHONPATH": root, "PATH": ""})
    assert out.stdout.strip() == "False", out.stderr


def test_context_parallel_ranks_hold_an_early_and_a_late_chunk():
    """Llama 3's load balancing: 16 tokens in 2 x cp = 4 chunks of 4; rank i holds chunks i and 3 - i."""
    from executor.models import SequenceLayout
    assert SequenceLayout(cp=2, rank=0).positions(8, "cpu").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert SequenceLayout(cp=2, rank=1).positions(8, "cpu").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # each run of queries attends to the keys up to its own end
    assert SequenceLayout(cp=2, rank=0).query_blocks(8) == [(0, 4, 4), (4, 8, 16)]
    assert SequenceLayout(cp=2, rank=1).query_blocks(8) == [(0, 4, 8), (4, 8, 12)]
    assert SequenceLayout().positions(5, "cpu").tolist() == [0, 1, 2, 3, 4]


def test_attention_of_a_late_query_chunk_against_the_keys_before_it_is_causal():
    """The core's mask for L queries against S > L keys is causal aligned to the last query
    (what a rank's late chunk needs), equal to the rows of full causal attention."""
    import torch
    from executor.models import sdpa
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)   # GQA: 4 heads, 2 kv
    full = sdpa(q, k, v, 0.0)                                          # (1, 4, 12, 8)
    torch.testing.assert_close(sdpa(q[:, :, 8:], k, v, 0.0), full[:, :, 8:])
    torch.testing.assert_close(sdpa(q[:, :, 4:8], k[:, :, :8], v[:, :, :8], 0.0), full[:, :, 4:8])
