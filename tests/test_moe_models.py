"""Mixtures of experts, latent attention and alternating windows: the zoo against published sizes, config.json
readers against transformers' own modules, the layer graph's blocks."""
import json

import pytest

from planner.errors import UserError
from planner.layers import build_layer_graph
from planner.model import ZOO, load_model

# Total and active parameters as each source states them (billions), and how close the source rounds.
PUBLISHED = {
    # Mistral AI's Mixtral 8x22B announcement: 141B total, 39B active
    "mixtral-8x22b": (141, 39, 0.01),
    # DeepSeek-V3 Technical Report (arXiv:2412.19437), abstract: 671B total, 37B activated per token
    "deepseek-v3": (671, 37, 0.015),
    # Kimi K2 (arXiv:2507.20534), abstract: 1.04 trillion total, 32 billion activated
    "kimi-k2": (1040, 32, 0.03),
    # Qwen3 Technical Report (arXiv:2505.09388), Table 2 and the model names: 30B/3B and 235B/22B
    "qwen3-30b-a3b": (30.5, 3.3, 0.02),
    "qwen3-235b-a22b": (235, 22, 0.02),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_moe_zoo_sizes_match_their_sources(name):
    total, active, rel = PUBLISHED[name]
    spec = ZOO[name]
    assert spec.num_params() / 1e9 == pytest.approx(total, rel=rel)
    assert spec.active_params() / 1e9 == pytest.approx(active, rel=0.03)
    assert build_layer_graph(spec).layers and sum(
        op.params for layer in build_layer_graph(spec).layers for op in layer.ops) == spec.num_params()


@pytest.mark.parametrize("name,total,active", [("gpt-oss-120b", 116.83, 5.13), ("gpt-oss-20b", 20.91, 3.61)])
def test_gpt_oss_sizes_match_the_model_card(name, total, active):
    """gpt-oss model card (arXiv:2508.10925) Table 1: 116.83B and 20.91B total; 5.13B and 3.61B active, counting
    the unembedding but not the embedding."""
    spec = ZOO[name]
    embedding = spec.vocab_size * spec.hidden
    assert spec.num_params() / 1e9 == pytest.approx(total, abs=0.01)
    assert (spec.active_params() - embedding) / 1e9 == pytest.approx(active, abs=0.01)


def _torch_params(config) -> int:
    """Parameters of transformers' own module for ``config``, built on the meta device."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


SMALL = {   # small configs of each model_type: the reader and transformers' module must agree on every parameter
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2, vocab_size=128,
                      mlp_only_layers=[0]),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, vocab_size=128),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=24,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, vocab_size=128,
                        n_group=1, topk_group=1),
    "deepseek_v3 full-rank q": dict(model_type="deepseek_v3", hidden_size=64, num_attention_heads=4,
                                    num_key_value_heads=4, num_hidden_layers=2, intermediate_size=96,
                                    moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=2,
                                    num_experts_per_tok=2, first_k_dense_replace=0, q_lora_rank=None,
                                    kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                    vocab_size=128, n_group=1, topk_group=1),
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_hidden_layers=4, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                    vocab_size=128, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2),
}


@pytest.mark.parametrize("case", SMALL)
def test_each_moe_reader_counts_what_transformers_builds(write_json, case):
    transformers = pytest.importorskip("transformers")
    data = SMALL[case]
    spec = load_model(write_json(data))
    config = transformers.AutoConfig.for_model(**data)
    assert spec.num_params() == _torch_params(config)
    graph = build_layer_graph(spec)
    assert sum(op.params for layer in graph.layers for op in layer.ops) == spec.num_params()


def test_the_first_dense_blocks_and_the_windows_have_their_own_signature():
    ds = build_layer_graph(ZOO["deepseek-v3"])
    blocks = [layer.signature for layer in ds.layers if layer.kind == "block"]
    assert blocks == ["block-dense"] * 3 + ["block"] * 58
    oss = build_layer_graph(ZOO["gpt-oss-120b"])
    blocks = [layer for layer in oss.layers if layer.kind == "block"]
    assert [b.signature for b in blocks[:4]] == ["block", "block-full", "block", "block-full"]
    windows = [next(op.window for op in b.ops if op.kind == "attention") for b in blocks[:2]]
    assert windows == [128, 0]


def test_latent_attention_ops_have_deepseeks_shapes():
    """DeepSeek-V3 (arXiv:2412.19437 Sec 4.2): q 7168 -> 1536 -> 128 x 192; kv 7168 -> 512 + 64, then
    512 -> 128 x (128 + 128); the core at 128 heads, q.k 192 and v 128 wide; the output 128 x 128 -> 7168."""
    graph = build_layer_graph(ZOO["deepseek-v3"])
    block = next(layer for layer in graph.layers if layer.signature == "block")
    shape = {op.name.split(".")[-1]: (op.in_features, op.out_features, op.tp) for op in block.ops if op.kind == "linear"}
    assert shape["q_down"] == (7168, 1536, "replicate") and shape["q_up"] == (1536, 128 * 192, "column")
    assert shape["kv_down"] == (7168, 576, "replicate") and shape["kv_up"] == (512, 128 * 256, "column")
    assert shape["o_proj"] == (128 * 128, 7168, "row")
    core = next(op for op in block.ops if op.kind == "attention")
    assert (core.heads, core.kv_heads, core.head_dim) == (128, 128, (192 + 128) // 2)
    experts = next(op for op in block.ops if op.name.endswith("mlp.gate_proj"))
    assert (experts.num_gemms, experts.tokens_factor, experts.out_features) == (256, 8, 2048)
    shared = next(op for op in block.ops if op.name.endswith("shared.gate_proj"))
    assert (shared.num_gemms, shared.tokens_factor, shared.out_features) == (1, 1, 2048)


@pytest.mark.parametrize("data,field", [
    (dict(SMALL["qwen2_moe"], mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(SMALL["qwen3_moe"], decoder_sparse_step=2, num_hidden_layers=4), "mlp_only_layers"),
    (dict(SMALL["gpt_oss"], layer_types=["full_attention", "sliding_attention"] * 2), "layer_types"),
    (dict(SMALL["deepseek_v3"], qk_nope_head_dim=0), "qk_nope_head_dim"),
    (dict(SMALL["deepseek_v3"], first_k_dense_replace=9), "dense_layers"),
    (dict(SMALL["deepseek_v3"], q_lora_rank=-1), "q_lora_rank"),
])
def test_moe_layouts_meshplan_cannot_express_are_refused_by_field(write_json, data, field):
    with pytest.raises(UserError) as caught:
        load_model(write_json(data))
    assert caught.value.field == field and caught.value.exit_code == 2


def test_each_reader_takes_the_router_its_config_describes(write_json):
    """DeepSeek-V3's sigmoid, group-limited router with transformers' defaults (8 groups, 4 used, scaled 2.5), one
    group read as none; Qwen-MoE's norm_topk_prob (transformers' default false); Mixtral's renormalised softmax."""
    deepseek = {k: v for k, v in SMALL["deepseek_v3"].items() if k not in ("n_group", "topk_group")}
    spec = load_model(write_json(dict(deepseek, n_routed_experts=16, num_experts_per_tok=8)))
    assert (spec.router_scores, spec.router_groups, spec.router_groups_used, spec.router_scale,
            spec.router_renormalize, spec.router_bias_rate) == ("sigmoid", 8, 4, 2.5, True, 0.001)
    spec = load_model(write_json(SMALL["deepseek_v3"]))
    assert (spec.router_groups, spec.router_groups_used) == (0, 0)
    assert not load_model(write_json(SMALL["qwen2_moe"])).router_renormalize
    assert load_model(write_json(dict(SMALL["qwen3_moe"], norm_topk_prob=True))).router_renormalize
    assert load_model(write_json(MIXTRAL_SMALL)).router_renormalize
    for data, field in ((dict(SMALL["deepseek_v3"], topk_method="greedy"), "topk_method"),
                        (dict(SMALL["deepseek_v3"], n_group=3, topk_group=1), "router_groups"),
                        (dict(SMALL["deepseek_v3"], routed_scaling_factor=0), "routed_scaling_factor")):
        with pytest.raises(UserError) as caught:
            load_model(write_json(data))
        assert caught.value.field == field


@pytest.mark.parametrize("flags,want", [
    ("", ("softmax", True, 0, 0, 1.0, 0.0)),
    ("--moe-router-pre-softmax", ("softmax", False, 0, 0, 1.0, 0.0)),
    ("--moe-router-score-function sigmoid --moe-router-num-groups 4 --moe-router-group-topk 2 "
     "--moe-router-topk-scaling-factor 2.5", ("sigmoid", True, 4, 2, 2.5, 0.0)),
    ("--moe-router-score-function sigmoid --moe-router-enable-expert-bias", ("sigmoid", True, 0, 0, 1.0, 1e-3)),
])
def test_megatrons_router_flags_read_as_its_routing(flags, want):
    """Megatron-Core's topk_routing_with_score_function (core_v0.15.0): softmax after the top-k unless pre-softmax
    (then not renormalised), sigmoid renormalised, group-limited routing, the scaling factor, the expert bias at
    --moe-router-bias-update-rate's default."""
    from planner.baseline import megatron as reader
    text = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --swiglu "
            "--num-experts 8 --moe-router-topk 4 --vocab-size 128 --seq-length 64 " + flags)
    spec = reader.model_of(reader.parse(text, "args.txt"), "args.txt").spec
    assert (spec.router_scores, spec.router_renormalize, spec.router_groups, spec.router_groups_used,
            spec.router_scale, spec.router_bias_rate) == want


@pytest.mark.parametrize("case", SMALL)
def test_a_moe_spec_maps_back_to_its_transformers_config_for_tracing(write_json, case):
    """planner/trace/zoo.py builds transformers' module of a spec (to trace a zoo model): the same parameters."""
    pytest.importorskip("transformers")
    from planner.trace.zoo import hf_config
    spec = load_model(write_json(SMALL[case]))
    assert _torch_params(hf_config(spec)) == spec.num_params()


def test_the_executor_refuses_what_its_reference_models_do_not_build():
    from dataclasses import replace

    from executor.support import check_model
    # its mixtures of experts are SwiGLU experts (executor/moe.py), with or without biases (GPT-OSS's)
    with pytest.raises(UserError) as caught:
        check_model(replace(ZOO["mixtral-8x7b"], mlp="gelu"))
    assert caught.value.field == "model.spec.mlp" and caught.value.exit_code == 2
    # latent attention, Qwen3's q/k norms, GPT-OSS's sinks, windows and biased experts: executor/models.py
    for name in ("llama3-8b", "mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-20b",
                 "gpt-oss-120b"):
        check_model(ZOO[name])


def test_a_sliding_window_shorter_than_the_sequence_is_priced_as_the_executor_runs_it():
    """Mistral-7B-v0.1's window of 4096 (its config.json): at sequences of up to 4096 every key a query sees
    causally is inside the window, so it is full causal attention, which SDPA runs (and torch eager prices it as
    the Llama block it is: planner/eager_table.py's family); at 8192 the executor writes the core out with its mask
    (executor/models.py masked_attention), so the torch runtime prices its attention unfused, torchtitan's not."""
    from dataclasses import replace

    from executor.support import check_model
    from planner.eager_bytes import layer_eager_bytes
    from planner.runtimes import unfused_core
    mistral = replace(load_model("llama3-8b"), name="mistral-7b-v0.1", sliding_window=4096, seq_len=4096)
    longer = replace(mistral, seq_len=8192)
    check_model(mistral)
    check_model(longer)
    assert not unfused_core(mistral, "torch")
    assert unfused_core(longer, "torch") and not unfused_core(longer, "torchtitan")
    assert unfused_core(ZOO["gpt-oss-20b"], "torch")        # its sinks, whatever the window
    assert layer_eager_bytes(mistral, "block") == layer_eager_bytes(replace(mistral, sliding_window=0), "block") != ()
    assert layer_eager_bytes(longer, "block") == ()


MOE_ZOO = ("mixtral-8x7b", "mixtral-8x22b", "deepseek-v3", "kimi-k2", "qwen3-30b-a3b", "qwen3-235b-a22b",
           "gpt-oss-20b", "gpt-oss-120b")


@pytest.mark.parametrize("name", MOE_ZOO)
def test_megatron_flags_of_a_moe_model_read_back_as_the_model(name):
    """The Megatron-LM export names every part of the architecture (experts and their width, shared experts,
    dense first blocks, latent attention, q/k norms, sinks, windows) and its reader reads them back."""
    from dataclasses import asdict

    from planner import api
    from planner.baseline import megatron as reader
    from planner.exports import megatron
    spec = ZOO[name]
    plan = api.plan(api.load_job(name, "h100-80g", gpus=1024, framework="megatron"), api.Knobs(), top_k=1)
    text = megatron(plan).text + f"\n--vocab-size {spec.vocab_size} --make-vocab-size-divisible-by 1\n"
    told = reader.model_of(reader.parse(text, "args.txt"), "args.txt")
    ignore = ("name", "source", "seq_len", "max_positions", "fused_qkv")
    assert {k: v for k, v in asdict(told.spec).items() if k not in ignore} == \
        {k: v for k, v in asdict(spec).items() if k not in ignore}


@pytest.mark.parametrize("flags,field", [
    ("--moe-layer-freq ([1]*2+[0]*2)", "--moe-layer-freq"),
    ("--moe-layer-freq __import__('os')", "--moe-layer-freq"),
    ("--window-size 128,4", "--window-size"),
    ("--window-size 128,0 --window-attn-skip-freq 4", "--window-attn-skip-freq"),
    ("--softmax-type sideways", "--softmax-type"),
])
def test_megatron_moe_flags_it_cannot_express_are_refused(flags, field):
    from planner.baseline import megatron as reader
    text = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --swiglu "
            "--num-experts 4 --moe-router-topk 2 --vocab-size 128 --seq-length 64 " + flags)
    with pytest.raises(UserError) as caught:
        reader.model_of(reader.parse(text, "args.txt"), "args.txt")
    assert caught.value.field == field


def test_plan_json_says_only_what_differs_from_a_dense_model_and_reads_back():
    from planner.plan import spec_json
    assert not {"num_experts", "kv_lora_rank", "attention_sinks"} & spec_json(ZOO["llama3-8b"]).keys()
    for name in ("llama3-8b", "deepseek-v3", "gpt-oss-120b"):
        written = spec_json(ZOO[name])
        assert written["source"] == ZOO[name].source and load_spec_back(written) == ZOO[name]


def load_spec_back(written: dict):
    import json

    from planner.model import ModelSpec
    return ModelSpec(**json.loads(json.dumps(written)))


def test_planning_gpt_oss_for_the_executor_prices_its_attention_as_the_executor_runs_it(cli, tmp_path):
    """GPT-OSS's sinks: `meshplan run` writes its attention core out (scores materialised), so the torch runtime's
    plan prices it --attention unfused and says so; Megatron-LM's is priced as asked (flash)."""
    out = cli("plan", "--model", "gpt-oss-20b", "--cluster", "h100-80g", "--gpus", "8", "--json")
    assert out.returncode == 0, out.stderr
    assert "priced --attention unfused" in out.stderr and "cannot train" not in out.stderr
    assert json.loads(out.stdout)["workload"]["attention"] == "unfused"
    quiet = cli("plan", "--model", "gpt-oss-20b", "--cluster", "h100-80g", "--gpus", "8", "--framework", "megatron",
                "--json")
    assert quiet.returncode == 0 and "unfused" not in quiet.stderr
    assert json.loads(quiet.stdout)["workload"]["attention"] == "flash"
    # a sweep says it once, not at each point
    sweep = cli("whatif", "--model", "gpt-oss-20b", "--cluster", "h100-80g", "--sweep", "gpus=8,16", "--out",
                str(tmp_path))
    assert sweep.returncode == 0 and sweep.stderr.count("priced --attention unfused") == 1


MIXTRAL_SMALL = dict(model_type="mixtral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=2, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                     vocab_size=128)


@pytest.mark.parametrize("case", [*SMALL, "mixtral"])
def test_a_config_json_of_each_moe_model_type_plans_with_its_experts_split(write_json, case):
    """Each listed model_type, as a config.json, plans on 8 GPUs for the Megatron-LM runtime (which runs expert
    parallelism folded onto the data and tensor-parallel ranks) with the expert-parallel degrees it allows."""
    from planner import api
    from planner.search import Knobs
    data = MIXTRAL_SMALL if case == "mixtral" else SMALL[case]
    job = api.load_job(write_json(data), "h100-80g", gpus=8, global_batch=16, seq_len=64, framework="megatron")
    experts = job.graph.num_experts
    plan = api.plan(job, Knobs(ep=2), top_k=1)
    assert plan.best.config.ep == 2 and experts % 2 == 0
    assert plan.best.estimate.time.ep_comm > 0
