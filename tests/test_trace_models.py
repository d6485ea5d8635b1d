"""Every model the profiler issue lists traces and gets a plan; an untraceable part plans with a warning."""
import pytest
import torch

import trace_models as tm
from planner.cluster import load_cluster
from planner.config import Workload
from planner.search import search
from planner.trace import trace_module

import transformers  # the [hf] extra, which CI installs: missing, it fails, never skips

def _hf(name):
    """Small transformers models built from configs (no weights downloaded), with example inputs."""
    ids = torch.zeros(2, 32, dtype=torch.long)
    config = tm.tiny_hf_config(name)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(config), ids
    if name == "bert":
        return transformers.BertForMaskedLM(config), ids
    if name == "vit":
        return transformers.ViTForImageClassification(config), torch.randn(2, 3, 32, 32)
    return transformers.AutoModelForCausalLM.from_config(config), ids


def _plan(graph, gpus=2, global_batch=8):
    cluster = load_cluster("a100-80g", gpus)
    result = search(graph, cluster, Workload(global_batch=global_batch, seq_len=graph.seq_len))
    assert result.best is not None and result.best.estimate.fits
    return result.best


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "mixtral", "bert", "vit"])
def test_transformers_models_trace_and_plan(name):
    module, inputs = _hf(name)
    result = trace_module(module, inputs)
    graph = result.graph
    assert graph.num_params == sum(p.numel() for p in module.parameters())     # the module's own count
    assert graph.num_blocks == 2 and len({l.signature for l in graph.layers if l.is_block}) == 1
    names = dict(module.named_modules())
    for layer in graph.layers:
        assert layer.name in names                                             # the executor splits by path
        for op in layer.ops:
            if op.kind in ("linear", "embedding") and op.params:
                assert op.name in names or op.name.rsplit(".", 1)[0] in names, op.name
    assert not result.warnings
    best = _plan(graph)
    assert best.estimate.step_time_s > 0


def test_vit_counts_patches_as_tokens():
    module, images = _hf("vit")
    graph = trace_module(module, images).graph
    assert graph.seq_len == (32 // 8) ** 2 + 1                 # 16 patches and the class token
    head = [op for op in graph.layers[-1].ops if op.kind == "linear"][0]
    assert head.tokens_factor == pytest.approx(1 / 17, rel=1e-3)  # the classifier reads the class token only


@pytest.mark.parametrize("factory", ["mlp", "cnn", "tiny_transformer", "custom_moe"])
def test_plain_modules_trace_and_plan(factory):
    module, inputs = getattr(tm, factory)()
    result = trace_module(module, inputs)
    assert result.graph.num_params == sum(p.numel() for p in module.parameters())
    _plan(result.graph)


def test_mlp_flops_by_hand():
    module, x = tm.mlp()                                       # 8 samples, 64 -> 256 -> 64 -> 10
    result = trace_module(module, x)
    assert result.fwd_flops == 2 * 8 * (64 * 256 + 256 * 64 + 64 * 10)
    assert result.tokens == 8 and result.graph.seq_len == 1     # per sample: no sequence
    linears = {op.name: (op.in_features, op.out_features) for l in result.graph.layers for op in l.ops
               if op.kind == "linear"}
    assert linears == {"fc1": (64, 256), "fc2": (256, 64), "head": (64, 10)}


def test_cnn_convolutions_as_gemms():
    module, x = tm.cnn()                                       # 4 images 3x16x16
    graph = trace_module(module, x).graph
    conv1 = next(op for l in graph.layers for op in l.ops if op.name == "conv1")
    # im2col view: k = 3 channels x 3 x 3, n = 8 filters, 16 x 16 output positions per image
    assert (conv1.in_features, conv1.out_features, conv1.tokens_factor) == (27, 8, 256)
    assert conv1.tp == "replicate"


def test_untraceable_part_plans_with_a_warning():
    module, ids = tm.untraceable()
    result = trace_module(module, ids)
    assert any(w.startswith("blocks.0.gate: cannot be traced") for w in result.warnings)
    assert [leaf.path for leaf in result.capture.opaque] == ["blocks.0.gate", "blocks.1.gate"]
    assert result.graph.num_params == sum(p.numel() for p in module.parameters())
    _plan(result.graph)


def test_untraceable_part_too_large_to_run_is_estimated():
    module, ids = tm.untraceable()
    result = trace_module(module, ids, real_budget_bytes=0)
    leaves = result.capture.opaque
    assert {leaf.how for leaf in leaves} == {"estimated"}
    assert any("estimated as 2 FLOPs per parameter" in w for w in result.warnings)
    gate = next(op for l in result.graph.layers for op in l.ops if op.name == "blocks.0.gate")
    # 2N FLOPs per row: the gate's 64x64 weight and bias over every token
    assert 2 * gate.in_features * gate.out_features * gate.tokens_factor == pytest.approx(2 * (64 * 64 + 64), rel=0.02)
    _plan(result.graph)


def test_custom_moe_runs_its_routing_for_real():
    module, ids = tm.custom_moe()
    result = trace_module(module, ids)
    assert [leaf.path for leaf in result.capture.opaque] == ["blocks.0.moe", "blocks.1.moe"]
    experts = [op for op in result.graph.layers[1].ops if op.name.startswith("blocks.0.moe.experts.")]
    first_linears = [op for op in experts if op.name.endswith(".0")]
    # top-2 routing: every token reaches two experts' first linear
    assert sum(op.tokens_factor for op in first_linears) == pytest.approx(2.0)
