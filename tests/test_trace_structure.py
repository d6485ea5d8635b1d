"""Layers, tensor-parallel roles and the operator graph of traced modules; import hygiene."""
import networkx as nx
import torch

import trace_models as tm
import planner
from conftest import ROOT
from planner.search.finish import tp_plan
from planner.config import ParallelConfig
from planner.trace import trace_module

import transformers  # the [hf] extra, which CI installs: missing, it fails, never skips


def _llama():
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(tm.tiny_hf_config("llama"))


def test_llama_layers_and_megatron_roles():
    graph = trace_module(_llama(), torch.zeros(2, 16, dtype=torch.long)).graph
    assert [(l.name, l.kind) for l in graph.layers] == [
        ("model.embed_tokens", "embedding"), ("model.rotary_emb", "embedding"), ("model.layers.0", "block"),
        ("model.layers.1", "block"), ("model.norm", "norm"), ("lm_head", "head")]
    block = graph.layers[2]
    roles = {op.name: op.tp for op in block.ops if op.kind == "linear"}
    p = "model.layers.0."
    assert roles == {p + "self_attn.q_proj": "column", p + "self_attn.k_proj": "column",
                     p + "self_attn.v_proj": "column", p + "self_attn.o_proj": "row",
                     p + "mlp.gate_proj": "column", p + "mlp.up_proj": "column", p + "mlp.down_proj": "row"}
    # Megatron: two all-reduces of the hidden width per block, forward and backward
    assert (block.tp_allreduce_fwd_elems, block.tp_allreduce_bwd_elems, block.output_elems) == (128, 128, 64)
    plan = tp_plan(graph, ParallelConfig(dp=1, tp=2, pp=1, sequence_parallel=True))
    assert plan["lm_head"] == "colwise_loss" and plan["model.embed_tokens"] == "vocab"
    assert plan[p + "input_layernorm"] == "sequence" and plan[p + "mlp.down_proj"] == "rowwise"


def test_mixtral_router_is_replicated_and_experts_are_split():
    with torch.device("meta"):
        module = transformers.MixtralForCausalLM(tm.tiny_hf_config("mixtral"))
    block = trace_module(module, torch.zeros(2, 16, dtype=torch.long)).graph.layers[2]
    roles = {op.name.rsplit(".", 2)[-2] + "." + op.name.rsplit(".", 1)[-1]: op.tp for op in block.ops
             if op.kind == "linear"}
    assert roles["mlp.gate"] == "replicate"
    assert roles["experts.gate_up_proj"] == "column" and roles["experts.down_proj"] == "row"


def test_qwen3_query_and_key_norms_keep_heads_split():
    """Qwen3 normalises queries and keys per head (RMSNorm over head_dim): that reduces within the heads
    TP splits, so q_proj and k_proj stay column-parallel with v_proj (a norm over the hidden width
    would demote them, and then v_proj with them: attention takes all three split by heads or none)."""
    with torch.device("meta"):
        module = transformers.Qwen3ForCausalLM(tm.tiny_hf_config("qwen3"))
    block = trace_module(module, torch.zeros(2, 16, dtype=torch.long)).graph.layers[2]
    roles = {op.name.split(".", 3)[-1]: op.tp for op in block.ops if op.kind == "linear"}
    assert roles == {"self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
                     "self_attn.o_proj": "row", "mlp.gate_proj": "column", "mlp.up_proj": "column",
                     "mlp.down_proj": "row"}


def test_runnable_trace_splits_only_what_torch_tp_styles_take():
    """Traced to run (auto_parallelize), GPT-2's Conv1D weights stay whole (torch's ColwiseParallel and
    RowwiseParallel take nn.Linear and nn.Embedding only); only costed, they split as Megatron's linears."""
    with torch.device("meta"):
        module = transformers.GPT2LMHeadModel(tm.tiny_hf_config("gpt2"))
    costed = trace_module(module, torch.zeros(2, 16, dtype=torch.long)).graph
    run = trace_module(module, torch.zeros(2, 16, dtype=torch.long), runnable=True).graph

    def roles(graph):
        block = next(layer for layer in graph.layers if layer.is_block)
        return {op.name.split(".", 3)[-1]: op.tp for op in block.ops if op.kind == "linear"}

    assert roles(costed) == {"attn.c_attn": "column", "attn.c_proj": "row", "mlp.c_fc": "column",
                             "mlp.c_proj": "row"}
    assert set(roles(run).values()) == {"replicate"}


def test_different_blocks_get_different_signatures():
    module = tm.TinyTransformer(layers=2)
    module.blocks.append(tm.Block(width=tm.WIDTH, heads=2))        # same weights, other head count
    graph = trace_module(module, tm.ids()).graph
    sigs = [l.signature for l in graph.layers if l.is_block]
    assert sigs[0] == sigs[1] != sigs[2]
    assert graph.num_heads == 2                                     # tp must divide the smallest


def test_operator_graph():
    module, x = tm.mlp()
    result = trace_module(module, x)
    g = result.op_graph
    assert isinstance(g, nx.DiGraph) and nx.is_directed_acyclic_graph(g)
    assert sum(d["fwd_flops"] for _, d in g.nodes(data=True)) == result.fwd_flops
    fc1 = [d for _, d in g.nodes(data=True) if d["module"] == "fc1" and d["fwd_flops"]]
    assert len(fc1) == 1 and fc1[0]["params"] == ["fc1.bias", "fc1.weight"]
    assert fc1[0]["output_shapes"] == [(8, 256)]
    # backward: fc1 only needs its weight gradient (the input needs none), fc2 both
    assert fc1[0]["bwd_flops"] == fc1[0]["fwd_flops"] == 2 * 8 * 64 * 256
    fc2 = next(d for _, d in g.nodes(data=True) if d["module"] == "fc2" and d["fwd_flops"])
    assert fc2["bwd_flops"] == 2 * fc2["fwd_flops"]
    producer = next(n for n, d in g.nodes(data=True) if d["module"] == "fc1" and d["fwd_flops"])
    # its output, 8 x 256 fp32, feeds the GELU
    assert any(g.edges[producer, v]["bytes"] == 8 * 256 * 4 and g.nodes[v]["module"] == "act"
               for v in g.successors(producer))
    assert sum(d["saved_bytes"] for _, d in g.nodes(data=True)) == result.saved_activation_bytes


def test_planner_trace_is_callable_and_meta_modules_allocate_nothing():
    graph = planner.trace(_llama(), torch.zeros(1, 8, dtype=torch.long))
    assert graph.num_blocks == 2


def test_planner_never_imports_torch_distributed():
    offenders = [str(p) for p in (ROOT / "planner").rglob("*.py")
                 if "import torch.distributed" in p.read_text() or "from torch.distributed" in p.read_text()]
    assert offenders == []
