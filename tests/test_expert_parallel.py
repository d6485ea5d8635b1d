"""Expert parallelism in the plan: the knob, each runtime's rule, the cost of routed experts (their GEMMs, the
all-to-alls, their states over the expert data-parallel ranks) and the search."""
from dataclasses import replace

import pytest

from planner import api
from planner.cluster import load_cluster
from planner.config import ParallelConfig, Workload
from planner.cost.layer import Context, layer_cost
from planner.cost.step import CostCache, estimate, rank_costs
from planner.errors import UserError
from planner.layers import build_layer_graph
from planner.model import ZOO, ModelSpec
from planner.search import Knobs, search

# a small Mixtral-style model: 8 experts of 1024, top 2, on 4 blocks
SMALL_MOE = ModelSpec(name="moe-test", num_layers=4, hidden=512, num_heads=8, num_kv_heads=8, head_dim=64,
                      ffn_hidden=1024, vocab_size=8192, seq_len=1024, max_positions=0, mlp="swiglu", norm="rmsnorm", linear_bias=False,
                      qkv_bias=False, tied_embeddings=False, dropout=False, num_experts=8, experts_per_token=2)


def _moe_block(gpus: int, **context):
    """(the first MoE block of SMALL_MOE, an H100 cluster of ``gpus``, a Megatron context at bf16 with flash
    attention, tp 1 and micro-batch 2 unless ``context`` says otherwise)."""
    block = next(layer for layer in build_layer_graph(SMALL_MOE).layers if layer.is_block)
    fields = dict(micro_batch=2, seq_len=1024, tp=1, cp=1, sequence_parallel=False, precision="bf16",
                  attention="flash", framework="megatron", tp_comm_overlap=False)
    return block, load_cluster("h100-80g", gpus), Context(**{**fields, **context})


def _estimate(config: ParallelConfig, framework="megatron", spec=SMALL_MOE, gpus=None, cluster="h100-80g"):
    graph = build_layer_graph(spec)
    machines = load_cluster(cluster, gpus or config.world_size)
    work = Workload(global_batch=config.dp * config.micro_batch * config.num_microbatches, seq_len=spec.seq_len,
                    framework=framework)
    return graph, machines, work, estimate(graph, machines, work, config)


def test_mixtral_on_64_h100_splits_its_experts_and_shows_what_it_gains():
    plan = api.plan(api.load_job("mixtral-8x7b", "h100-80g", gpus=64), top_k=5)
    assert plan.best.config.ep > 1
    assert plan.best.estimate.time.ep_comm > 0
    dense = [a for a in plan.alternatives if a.config.ep == 1]
    assert dense, "the best plan without expert parallelism is among the runners-up"
    assert dense[0].estimate.step_time_s > plan.best.estimate.step_time_s
    assert plan.best.config.to_json()["ep"] == plan.best.config.ep


@pytest.mark.parametrize("gpus", [256, 1024])
def test_deepseek_v3_plans_with_experts_split(gpus):
    plan = api.plan(api.load_job("deepseek-v3", "h100-80g", gpus=gpus, framework="megatron"), top_k=1)
    c = plan.best.config
    assert c.ep > 1 and 256 % c.ep == 0 and (c.dp * c.cp * c.tp) % c.ep == 0
    assert c.tp == 1 or c.sequence_parallel          # Megatron needs SP with TP under expert parallelism
    assert plan.best.estimate.fits


@pytest.mark.parametrize("framework,config,knob,words", [
    ("megatron", ParallelConfig(dp=2, tp=2, pp=1, ep=4, sequence_parallel=False), "sequence_parallel",
     "needs sequence parallelism"),
    ("megatron", ParallelConfig(dp=2, tp=1, pp=1, ep=3), "ep", "does not divide the model's 8 routed experts"),
    ("megatron", ParallelConfig(dp=2, tp=1, pp=2, ep=4), "ep", "must divide dp x cp x tp"),
    ("deepspeed", ParallelConfig(dp=4, tp=2, pp=1, ep=2), "ep", "allowed with ep > 1: tp 1"),
    ("deepspeed", ParallelConfig(dp=2, tp=1, pp=1, ep=4), "ep", "must divide the data-parallel size"),
    # DeepSpeed's engine asserts "MoE not supported with Stage 3" for its MoE layers (engine.py at 38327e07f)
    ("deepspeed", ParallelConfig(dp=4, tp=1, pp=1, ep=2, zero=3), "zero", "ZeRO-3 with expert parallelism"),
    # torchtitan folds experts onto dp_shard x cp x tp: ZeRO-0's data-parallel ranks are replicas, not shards
    ("torchtitan", ParallelConfig(dp=4, tp=2, pp=1, ep=8, zero=0, sequence_parallel=True), "zero",
     "leaving cp x tp = 2"),
])
def test_each_runtime_refuses_the_expert_layouts_it_does_not_run(framework, config, knob, words):
    from planner.runtimes import config_refusals
    found = config_refusals(config, framework, "cuda", 8, num_experts=8)
    assert any(k == knob and words in why for k, why in found), found


def test_torchtitan_takes_expert_ranks_from_sharded_data_parallelism_only(cli):
    """torchtitan's sparse region is dp_shard x cp x tp (parallel_dims.py ``_validate`` raises otherwise): under ZeRO-0
    its data-parallel ranks are dp_replicate and lend none, while meshplan's executor folds experts onto replicas too.
    The search keeps to that, and the same layout fixed is refused naming --zero."""
    from planner.runtimes import config_refusals
    for zero, framework, refused in ((0, "torchtitan", True), (2, "torchtitan", False), (0, "torch", False)):
        config = ParallelConfig(dp=4, tp=2, pp=1, ep=8, zero=zero, sequence_parallel=True)
        assert bool(config_refusals(config, framework, "cuda", 8, num_experts=8)) == refused, (zero, framework)
    assert not config_refusals(ParallelConfig(dp=4, tp=2, pp=1, ep=2, zero=0, sequence_parallel=True), "torchtitan",
                               "cuda", 8, num_experts=8)
    plan = api.plan(api.load_job("gpt-oss-120b", "b200", gpus=64, framework="torchtitan"), top_k=8)
    for c in (plan.best.config, *(a.config for a in plan.alternatives)):
        assert c.zero > 0 or (c.cp * c.tp) % c.ep == 0, c
    out = cli("plan", "--model", "gpt-oss-120b", "--cluster", "b200", "--gpus", "64", "--framework", "torchtitan",
              "--zero", "0", "--tp", "2", "--ep", "8")
    assert out.returncode == 2 and "--zero" in out.stderr and "Traceback" not in out.stderr


def test_ep_on_a_dense_model_is_refused_naming_the_flag(cli):
    out = cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--ep", "2")
    assert out.returncode == 2 and "--ep" in out.stderr and "has none" in out.stderr
    assert "Traceback" not in out.stderr


def test_expert_states_are_sharded_over_the_expert_data_parallel_ranks():
    """Megatron's layout (bf16 parameters 2 bytes, fp32 main gradients 4, distributed optimizer 12 sharded): the
    dense parameters' optimizer over dp = 8, the experts' over the expert data-parallel ranks, dp / ep = 2; each rank
    holds 8 / 4 = 2 experts of each MoE layer."""
    s = SMALL_MOE
    per_expert = 3 * s.hidden * s.ffn_hidden
    experts = s.num_layers * s.num_experts * per_expert
    dense = s.num_params() - experts
    local = experts / 4
    config = ParallelConfig(dp=8, tp=1, pp=1, ep=4, zero=1, micro_batch=1, num_microbatches=1)
    mem = _estimate(config)[3].memory
    assert mem.params == pytest.approx(2 * (dense + local))
    assert mem.grads == pytest.approx(4 * (dense + local))
    assert mem.optimizer == pytest.approx(12 * dense / 8 + 12 * local / 2)


def test_splitting_experts_moves_their_work_not_their_flops():
    """Under ep the rank runs E / ep whole experts on the tokens the ep group routes to them: with balanced routing
    the same matmul FLOPs per rank as without (T k 2 h f per linear), in fewer, taller GEMMs."""
    block, cluster, base = _moe_block(8)
    one, four = layer_cost(block, base, cluster), layer_cost(block, base._replace(ep=4), cluster)
    assert four.matmul_flops_fwd == pytest.approx(one.matmul_flops_fwd)
    routed = sum(op.params for op in block.ops if op.routed)
    assert one.params - four.params == pytest.approx(routed - routed / 4)
    assert four.expert_params == pytest.approx(routed / 4) and one.expert_params == 0


def test_a_moe_layer_runs_four_all_to_alls_of_its_routed_tokens():
    """Dispatch and combine in forward and their gradients in backward, each moving the top-k copies of the rank's
    tokens at hidden width (bf16): 2 x 1024 tokens x 2 x 512 x 2 bytes; and in forward the exchange of the token
    counts per expert that the uneven all-to-alls need."""
    from planner import network
    block, cluster, ctx = _moe_block(16, ep=8)
    grp = network.group(cluster, 8, 1)
    one = network.all_to_all_s(cluster, 2 * 1024 * 2 * 512 * 2, grp)
    counts = network.all_to_all_s(cluster, 8 * 8, grp)      # forward first sends 8 experts' int64 token counts
    assert layer_cost(block, ctx, cluster).ep_comm_s == pytest.approx(4 * one + counts)
    assert layer_cost(block, ctx._replace(ep=1), cluster).ep_comm_s == 0


def test_the_mlp_tensor_parallel_collectives_give_way_to_the_all_to_alls():
    """With tp 2, SP and ep 4 a block whose MLP is routed experts alone keeps attention's TP collectives only."""
    block, cluster, ctx = _moe_block(8, micro_batch=1, tp=2, sequence_parallel=True)
    dense_tp, folded = layer_cost(block, ctx, cluster), layer_cost(block, ctx._replace(ep=4), cluster)
    assert folded.tp_comm_s == pytest.approx(dense_tp.tp_comm_s / 2)


def test_the_search_covers_ep_and_the_ilp_and_the_uniform_search_agree():
    graph = build_layer_graph(SMALL_MOE)
    cluster = load_cluster("h100-80g", 8)
    work = Workload(global_batch=16, seq_len=1024, framework="megatron")
    ilp = search(graph, cluster, work, Knobs(pp=2), top_k=3, simulate=False)
    uniform = search(graph, cluster, work, Knobs(pp=2), top_k=3, solver="uniform", simulate=False)
    assert ilp.best.estimate.step_time_s <= uniform.best.estimate.step_time_s * (1 + 1e-6)
    eps = {c.config.ep for c in (ilp.best, *ilp.alternatives)}
    assert len(eps) > 1
    # the ILP's candidate re-estimated by the closed form is what it said
    again = estimate(graph, cluster, work, ilp.best.config)
    assert again.step_time_s == pytest.approx(ilp.best.estimate.step_time_s, rel=1e-6)


def test_fixed_ep_is_kept_and_a_bad_one_names_the_flag():
    job = api.load_job("mixtral-8x7b", "h100-80g", gpus=32, framework="megatron")
    plan = api.plan(job, Knobs(ep=4), top_k=1)
    assert plan.best.config.ep == 4
    with pytest.raises(UserError) as e:
        api.plan(job, Knobs(ep=16), top_k=1)
    assert e.value.field == "--ep"


def test_ranks_split_experts_hold_their_expert_buckets():
    config = ParallelConfig(dp=8, tp=1, pp=2, ep=4, zero=1, micro_batch=1, num_microbatches=4)
    graph, machines, work, _ = _estimate(config)
    ranks = rank_costs(CostCache(graph, machines, work), config)
    routed = sum(op.params for layer in graph.layers for op in layer.ops if op.routed)
    assert sum(r.expert_params for r in ranks) == pytest.approx(routed / 4)
    assert all(r.ep_comm_s > 0 for r in ranks)


def test_an_imbalance_slows_the_busiest_expert_rank_and_only_under_expert_parallelism():
    block, cluster, ctx = _moe_block(16, ep=8)
    even, skew = layer_cost(block, ctx, cluster), layer_cost(block, ctx._replace(expert_imbalance=1.5), cluster)
    assert skew.fwd_s > even.fwd_s and skew.ep_comm_s > even.ep_comm_s
    assert skew.policy("none").act_bytes > even.policy("none").act_bytes
    assert skew.params == even.params
    no_ep = ctx._replace(ep=1)
    assert layer_cost(block, no_ep._replace(expert_imbalance=1.5), cluster) == layer_cost(block, no_ep, cluster)


def test_the_imbalance_reads_back_from_plan_json_and_a_bad_one_is_refused(cli, tmp_path):
    out = cli("plan", "--model", "mixtral-8x7b", "--cluster", "h100-80g", "--gpus", "16", "--expert-imbalance", "1.3",
              "--framework", "megatron", "--out", str(tmp_path / "plan.json"), timeout=300)
    assert out.returncode == 0, out.stderr
    from planner.plan import Plan
    plan = Plan.read(tmp_path / "plan.json")
    assert plan.workload.expert_imbalance == 1.3
    bad = cli("plan", "--model", "mixtral-8x7b", "--expert-imbalance", "0.5")
    assert bad.returncode == 2 and "--expert-imbalance" in bad.stderr and "Traceback" not in bad.stderr


def test_the_allgather_dispatcher_gathers_the_group_s_tokens_once_and_runs_on_megatron_only(write_json, tmp_path):
    """Megatron-LM's allgather dispatcher moves each token once (not k times) to every rank of the ep group, with its
    routing over the E experts: with top-2 of 8 experts over 8 ranks it moves more than the all-to-all's k copies
    sent (ep - 1) / ep of the way, and it is priced as an all-gather plus a reduce-scatter each way."""
    from planner import network
    block, cluster, ctx = _moe_block(8, ep=8)
    grp = network.group(cluster, 8, 1)
    tokens, h = 2 * 1024, 512
    one_way = (network.all_gather_s(cluster, 8 * tokens * (h * 2 + 8 * 5), grp)
               + network.reduce_scatter_s(cluster, 8 * tokens * h * 2, grp))
    gathered = layer_cost(block, ctx._replace(expert_dispatcher="allgather"), cluster)
    assert gathered.ep_comm_s == pytest.approx(2 * one_way)
    assert gathered.ep_comm_s > layer_cost(block, ctx, cluster).ep_comm_s
    # meshplan's executor, torchtitan and DeepSpeed dispatch by all-to-all only
    with pytest.raises(UserError) as e:
        api.plan(api.load_job("mixtral-8x7b", "h100-80g", gpus=8, expert_dispatcher="allgather"), top_k=1)
    assert e.value.field == "--expert-dispatcher"
    plan = api.plan(api.load_job("mixtral-8x7b", "h100-80g", gpus=16, framework="megatron",
                                 expert_dispatcher="allgather"), Knobs(ep=8), top_k=1)
    from planner.exports import megatron
    text = megatron(plan).text
    assert "--moe-token-dispatcher-type allgather" in text
    from planner.baseline import Context as FileContext, read_baseline
    path = tmp_path / "megatron_args.txt"
    path.write_text(text)
    baseline, _, _ = read_baseline(str(path), FileContext(gpus=16), "mixtral-8x7b")
    assert baseline.expert_dispatcher == "allgather" and baseline.config.ep == 8


def test_expected_expert_holders_by_counting():
    """A token's k experts drawn without replacement from E spread evenly over the holders: the expected number of
    holders it reaches, from the count of the draws that miss a holder (math.comb), not the code's product."""
    import math
    from planner import network
    assert network.distinct_holders(256, 8, 4) == pytest.approx(4 * (1 - math.comb(192, 8) / math.comb(256, 8)))
    assert network.distinct_holders(128, 8, 8) == pytest.approx(8 * (1 - math.comb(112, 8) / math.comb(128, 8)))
    assert network.distinct_holders(8, 2, 8) == pytest.approx(2.0)      # one expert a rank: always 2 ranks
    assert network.distinct_holders(8, 8, 4) == 4.0 and network.distinct_holders(64, 4, 1) == 1.0
    # DeepSeek-V3's node-limited routing (8 groups of 32 experts, the top 8 from the best 4 groups): over 4 nodes
    # each holds 2 groups, j of them drawn with the hypergeometric chance, then 8 of the 4 groups' 128 experts;
    # over 32 ranks each holds a quarter of one group, drawn with its group (4 of 8)
    p = {j: math.comb(2, j) * math.comb(6, 4 - j) / math.comb(8, 4) for j in range(3)}
    nodes = 4 * (p[1] * (1 - math.comb(96, 8) / math.comb(128, 8)) + p[2] * (1 - math.comb(64, 8) / math.comb(128, 8)))
    assert network.distinct_holders(256, 8, 4, 8, 4) == pytest.approx(nodes)
    ranks = 32 * 4 / 8 * (1 - math.comb(120, 8) / math.comb(128, 8))
    assert network.distinct_holders(256, 8, 32, 8, 4) == pytest.approx(ranks)
    assert network.distinct_holders(256, 8, 4, 8, 4) < network.distinct_holders(256, 8, 4)


def test_the_flex_dispatcher_sends_a_token_once_per_gpu_and_node_and_runs_on_megatron_on_cuda(tmp_path):
    """Megatron-LM's flex dispatcher on DeepEP's normal kernels: a token crosses the network once for each remote node
    that holds any of its experts (on its GPU's rail) and NVLink once for each other GPU that holds any, the two
    domains at once; the all-to-all sends one copy per expert. 32 experts, top 4, ep 16 over 2 nodes of 8 H100 (2
    experts a rank, 16 a node), 2 x 1024 tokens of 512 bf16 a rank, forward: dispatch and combine, by hand."""
    import math
    from dataclasses import replace
    from planner import network
    spec = replace(SMALL_MOE, num_experts=32, experts_per_token=4)
    block = next(layer for layer in build_layer_graph(spec).layers if layer.is_block)
    cluster = load_cluster("h100-80g", 16)
    ctx = Context(micro_batch=2, seq_len=1024, tp=1, cp=1, sequence_parallel=False, precision="bf16",
                  attention="flash", framework="megatron", tp_comm_overlap=False, ep=16)
    f, grp = network.fabric(cluster), network.group(cluster, 16, 1)
    token = 512 * 2
    ranks = 16 * (1 - math.comb(30, 4) / math.comb(32, 4))
    nodes = 2 * (1 - math.comb(16, 4) / math.comb(32, 4))
    nvlink = 2048 * token * ranks * 7 / 8 / f.intra_bytes_per_s + f.intra_latency_s
    network_s = 2048 * token * nodes / 2 / f.net_bytes_per_s + f.net_latency_s
    counts = network.all_to_all_s(cluster, 32 * 8, grp)
    flex = layer_cost(block, ctx._replace(expert_dispatcher="flex"), cluster)
    plain = layer_cost(block, ctx, cluster)
    assert flex.ep_comm_s == pytest.approx(2 * (2 * max(nvlink, network_s)) + counts)
    # the network carries 4 x 8/16 = 2 copies of a token for the all-to-all, 0.77 for flex: less time here
    assert flex.ep_comm_s < plain.ep_comm_s
    # Megatron-LM on CUDA only (DeepEP's GPU kernels); not meshplan's executor nor Megatron on CPU
    for bad in (dict(cluster="h100-80g"), dict(cluster="cpu-gloo", framework="megatron")):
        with pytest.raises(UserError) as e:
            api.plan(api.load_job("mixtral-8x7b", **{"gpus": 8, "expert_dispatcher": "flex", **bad}), top_k=1)
        assert e.value.field == "--expert-dispatcher", bad
    # with --ep-comm-overlap (Megatron-Core overlaps alltoall and flex), exported and read back
    plan = api.plan(api.load_job("mixtral-8x7b", "h100-80g", gpus=32, framework="megatron", expert_dispatcher="flex",
                                 ep_comm_overlap=True), Knobs(ep=8), top_k=1)
    from planner.exports import megatron
    text = megatron(plan).text
    assert "--moe-token-dispatcher-type flex" in text and "--moe-flex-dispatcher-backend deepep" in text
    from planner.baseline import Context as FileContext, read_baseline
    path = tmp_path / "megatron_args.txt"
    path.write_text(text)
    baseline, _, _ = read_baseline(str(path), FileContext(gpus=32), "mixtral-8x7b")
    assert baseline.expert_dispatcher == "flex" and baseline.config.ep == 8
    path.write_text(text.replace("deepep", "ncclep"))
    with pytest.raises(UserError) as e:
        read_baseline(str(path), FileContext(gpus=32), "mixtral-8x7b")
    assert e.value.field == "--moe-flex-dispatcher-backend"


def test_the_tracer_recognises_a_modules_grouped_experts_and_router(tmp_path):
    """transformers' Mixtral (grouped expert weights, a router linear), traced: its routed experts are one grouped
    GEMM of E matrices each way on k copies of the tokens, its parameters all counted, the elementwise work inside
    the experts module on the routed tokens; ep is searched for it where the runtime can split its experts."""
    pytest.importorskip("transformers")
    source = tmp_path / "mixtral_small.py"
    source.write_text(
        "from transformers import MixtralConfig, AutoModelForCausalLM\n"
        "def build():\n"
        "    cfg = MixtralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,\n"
        "                        intermediate_size=96, num_local_experts=8, num_experts_per_tok=2, vocab_size=128)\n"
        "    return AutoModelForCausalLM.from_config(cfg)\n")
    job = api.load_job(f"{source}:build", "h100-80g", gpus=8, example_input="2x64:int64", framework="megatron")
    graph = job.graph
    assert graph.num_experts == 8
    block = next(layer for layer in graph.layers if layer.is_block)
    routed = [op for op in block.ops if op.routed]
    assert [op.num_gemms for op in routed] == [8, 8] and all(op.tokens_factor == 2 for op in routed)
    assert sum(op.params for op in routed) == 8 * 3 * 64 * 96
    router = [op for op in block.ops if op.kind == "linear" and op.out_features == 8 and not op.expert]
    assert router and router[0].tp == "replicate"
    assert block.tp_allreduce_expert_elems == 64
    assert graph.num_params == job.graph.num_params and graph.num_params == sum(
        p.numel() for p in __import__("runpy").run_path(str(source))["build"]().parameters())
    assert api.plan(job, Knobs(ep=4), top_k=1).best.config.ep == 4
    # meshplan's executor splits transformers' grouped experts too (tests/test_auto_hf_moe.py runs them)
    assert graph.splits_experts
    torch_job = replace(job, workload=replace(job.workload, framework="torch"))
    assert api.plan(torch_job, Knobs(ep=2), top_k=1).best.config.ep == 2


def test_a_grouped_gemm_fills_its_waves_with_every_experts_tiles():
    """16 experts of (4096 x 2880) @ (2880 x 2880) on an H100 (132 SMs; tiles 256 x 128, 128 x 256 or 128 x 128, a
    128 x 128 wave's math half as long; each wave also its fixed L = 2 us): one at a time each is 16 x 23 = 368 tiles
    in 3 waves (2.79 of work), 48 in all; grouped, 16 x 368 = 5,888 tiles in 45 waves (44.6); four at a time on four
    streams (TransformerEngine's GroupedLinear), each round 4 x 736 = 2,944 tiles of 128 x 128 in 23 half waves
    (11.5 T + 23 L, against 12 waves of 256 x 128, 12 T + 12 L, as long as a wave's math T = 45 us exceeds 22 L),
    46 T + 92 L in all."""
    from planner.cost.layer import grouped_gemms_s
    cluster = load_cluster("h100-80g", 8)
    dev = cluster.device
    wave = 2 * 2880 * 256 * 128 * 132 / (989.4e12 * dev.gemm_efficiency)       # T: a wave of 256 x 128 tiles
    lat = dev.gemm_wave_latency_s
    assert lat == 2e-6 and wave > 22 * lat
    one_by_one = grouped_gemms_s(16, 4096, 2880, 2880, cluster, "bf16", 1)
    four = grouped_gemms_s(16, 4096, 2880, 2880, cluster, "bf16", 4)
    grouped = grouped_gemms_s(16, 4096, 2880, 2880, cluster, "bf16", 16)
    assert grouped[0] < four[0] < one_by_one[0] and grouped[1] < four[1] < one_by_one[1]
    assert grouped[0] == pytest.approx(45 * (wave + lat), rel=1e-6)
    assert one_by_one[0] / grouped[0] == pytest.approx(48 / 45, rel=1e-9)
    assert four[0] == pytest.approx(46 * wave + 92 * lat, rel=1e-6)
    # six experts on four streams: a round of four, then one of two
    from planner.cost.compute import gemm_s
    six = grouped_gemms_s(6, 4096, 2880, 2880, cluster, "bf16", 4)[0]
    assert six == pytest.approx(gemm_s(4096, 2880, 2880, cluster.device, "bf16", 4)
                                + gemm_s(4096, 2880, 2880, cluster.device, "bf16", 2), rel=1e-12)
    from planner.runtimes import RUNTIMES
    assert RUNTIMES["torch"].on("cuda").grouped_experts and RUNTIMES["torchtitan"].on("cuda").grouped_experts
    assert not RUNTIMES["torch"].on("cpu").grouped_experts and not RUNTIMES["deepspeed"].on("cuda").grouped_experts
    # Megatron-Core's TEGroupedMLP: one cuBLAS GEMM per expert on TransformerEngine's four compute streams
    megatron = RUNTIMES["megatron"].on("cuda")
    assert not megatron.grouped_experts and megatron.expert_gemm_streams == 4


def test_overlapped_all_to_alls_hide_behind_the_other_micro_batchs_compute_phase_by_phase():
    """--ep-comm-overlap (Megatron-Core's --overlap-moe-expert-parallel-comm): forward i + 1 and backward i of a
    layer run together in three phases, each as long as the longer of its streams (model_chunk_schedule_plan.py):
    combine-backward beside attention-forward, dispatch-forward then dispatch-backward beside the experts'
    input-gradient backward then their weight gradients and forward, combine-forward beside attention-backward.
    Exchanges 3 forward (dispatch 2 with the counts, combine 1) and 2 backward (1 + 1); attention side 0.5 forward,
    1 backward; experts 1 forward, 2 backward of which 1 weight gradients: phases max(1, .5) + max(2, 1) + max(1, 2)
    + max(1, 1) = 6 against 4.5 of compute: 1.5 exposed, 3/5 of it forward."""
    from planner.cost.layer import _overlapped_exchange_s
    fwd, bwd = _overlapped_exchange_s(3.0, 2.0, 0.5, 1.0, 1.0, 2.0, 1.0)
    assert (fwd, bwd) == (pytest.approx(0.9), pytest.approx(0.6))
    # compute long enough hides all of it; none at all leaves it whole
    assert _overlapped_exchange_s(3.0, 2.0, 5.0, 5.0, 5.0, 5.0, 1.0) == (0.0, 0.0)
    assert sum(_overlapped_exchange_s(3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0)) == pytest.approx(5.0)
    # in a layer: the exchange exposed is at most what it was, and it holds one more forward (a chunk under a
    # pipeline with virtual stages: 1 / vpp of the rank's layers)
    block, cluster, ctx = _moe_block(8, ep=8)
    alone, beside = layer_cost(block, ctx, cluster), layer_cost(block, ctx._replace(ep_comm_overlap=True), cluster)
    assert beside.ep_comm_s < alone.ep_comm_s
    assert beside.fwd_s + beside.bwd_s == pytest.approx(alone.fwd_s + alone.bwd_s - alone.ep_comm_s + beside.ep_comm_s)
    from planner.cost.step import inflight_microbatches
    config = ParallelConfig(dp=8, tp=1, pp=2, ep=8, micro_batch=1, num_microbatches=8, vpp=2,
                            schedule="interleaved-1f1b")
    work = Workload(global_batch=64, seq_len=1024, framework="megatron")
    over = replace(work, ep_comm_overlap=True)
    assert inflight_microbatches(config, 0, over) == pytest.approx(inflight_microbatches(config, 0, work) + 0.5)
    flat = replace(config, pp=1, dp=16, vpp=1, schedule="1f1b")
    assert inflight_microbatches(flat, 0, over) == inflight_microbatches(flat, 0, work) + 1


def test_ep_comm_overlap_plans_what_megatron_runs_and_reads_back(tmp_path):
    """With --ep-comm-overlap the search keeps to what Megatron-Core runs with it (ep > 1, no full recompute,
    virtual stages under a pipeline), the export sets the flag with --delay-wgrad-compute, and the file reads back
    with it; elsewhere it names the flag."""
    job = api.load_job("mixtral-8x7b", "h100-80g", gpus=32, framework="megatron", ep_comm_overlap=True)
    plan = api.plan(job, top_k=3)
    assert plan.best.config.ep > 1
    for cand in (plan.best, *plan.alternatives):
        c = cand.config
        if c.ep == 1:       # the runner-up that shows what expert parallelism gains: nothing to overlap there
            continue
        assert "full" not in (c.recompute_layers or (c.recompute,))
        assert c.pp == 1 or c.schedule == "interleaved-1f1b"
    from planner.exports import megatron
    text = megatron(plan).text
    assert "--overlap-moe-expert-parallel-comm" in text and "--delay-wgrad-compute" in text
    from planner.exports import deepspeed, torchtitan
    for other in (deepspeed(plan), torchtitan(plan)):       # runtimes that do not overlap them say so
        assert any("all-to-alls beside another micro-batch" in n for n in other.notes), other.framework
    from planner.baseline import Context as FileContext, read_baseline
    path = tmp_path / "megatron_args.txt"
    path.write_text(text)
    baseline, _, _ = read_baseline(str(path), FileContext(gpus=32), "mixtral-8x7b")
    assert baseline.ep_comm_overlap and baseline.workload().ep_comm_overlap
    plan.write(tmp_path / "plan.json")
    from planner.plan import Plan
    assert Plan.read(tmp_path / "plan.json").workload.ep_comm_overlap
    with pytest.raises(UserError) as e:                         # Megatron-Core refuses full recompute with it
        api.plan(job, Knobs(recompute="full"), top_k=1)
    assert e.value.field == "--recompute"
    with pytest.raises(UserError) as e:
        api.plan(job, Knobs(ep=1), top_k=1)
    assert e.value.field == "--ep"
    for bad in (dict(framework="torch"), dict(model="llama3-8b"), dict(expert_dispatcher="allgather")):
        with pytest.raises(UserError) as e:
            api.load_job(**{"model": "mixtral-8x7b", "cluster": "h100-80g", "gpus": 32, "framework": "megatron",
                            "ep_comm_overlap": True, **bad})
        assert e.value.field == "--ep-comm-overlap", bad


def test_megatron_keeps_the_experts_input_as_fp8_and_its_fused_swiglu_keeps_its_input_alone():
    """Megatron-Core keeps less than the eager executor: its fused SwiGLU (bias_swiglu_impl, on by default) keeps its
    input alone, 2 f per token copy where eager keeps 3 f (silu's input, the product's two inputs), and under an FP8
    recipe TransformerEngine's GroupedLinear keeps its FP8 copy of the permuted tokens, 1 byte per element where
    bf16 keeps 2. SMALL_MOE (h 512, experts of f 1024, top 2) on 8 ranks at ep 8, micro-batch 2 of 1024 tokens:
    2048 tokens x 2 copies; the SwiGLU saves 2048 x 2 x 1024 x 2 bytes less, the FP8 tokens 2048 x 2 x 512 less."""
    block, cluster, ctx = _moe_block(8, ep=8)
    tokens, k, h, f = 2048, 2, 512, 1024
    megatron = layer_cost(block, ctx, cluster).by_policy["none"].act_bytes
    torch = layer_cost(block, ctx._replace(framework="torch"), cluster).by_policy["none"].act_bytes
    assert torch - megatron == pytest.approx(tokens * k * f * 2)
    fp8 = layer_cost(block, ctx._replace(fp8="fp8-tensorwise"), cluster).by_policy["none"].act_bytes
    # besides the experts' input, the linears that keep their own inputs keep them in FP8 too (TE's Linear): q's
    # (h per token) and down_proj's (f per copy)
    assert megatron - fp8 == pytest.approx(tokens * k * h * 1 + tokens * h * 1 + tokens * k * f * 1)


@pytest.mark.parametrize("model,gpus,ep,framework,want,dim", [
    # 128 experts / ep 8 = 16 a rank over efsdp 72 / 8 = 9: neither 16 nor an expert's 768 or 2048 output features
    # split 9 ways, so each rank holds ceil(16 / 9) = 2 of the 16 (FSDP2 pads the rest): 16 / 2 = 8, not 9
    ("qwen3-30b-a3b", 72, 8, "torch", 8.0, 0),
    ("qwen3-30b-a3b", 72, 8, "megatron", 9.0, 0),       # the distributed optimizer shards a flat buffer evenly
    ("qwen3-30b-a3b", 64, 8, "torch", 8.0, 0),          # 16 experts over 8 ranks: two each
    # without ep the stack of Mixtral's 8 experts over 64 ranks goes along its 14,336 and 4,096 output features
    ("mixtral-8x7b", 64, 1, "torch", 64.0, 1),
    # over 72 neither the 8 experts nor those features divide: a rank holds one whole expert of 8, as if over 8
    ("mixtral-8x7b", 72, 1, "torch", 8.0, 0),
])
def test_routed_states_are_divided_as_the_executor_shards_the_expert_stacks(model, gpus, ep, framework, want, dim):
    """What routed experts' ZeRO-2/3 states are divided by on the most loaded rank (planner/cost/step.py
    ``routed_state_shard``), and the dimension executor/zero1.py ``expert_dim`` shards a rank's stack of gate
    projections (local experts, ffn, hidden) along: hand-counted from the models' shapes."""
    from planner.cost.step import routed_state_shard
    from planner.model import load_model
    from executor.zero1 import expert_dim
    spec = load_model(model)
    cache = CostCache(build_layer_graph(spec), load_cluster("gb200-nvl72" if gpus == 72 else "h100-80g", gpus),
                      Workload(global_batch=gpus, seq_len=4096, framework=framework))
    config = ParallelConfig(dp=gpus, tp=1, pp=1, ep=ep, zero=2, micro_batch=1, num_microbatches=1)
    assert routed_state_shard(cache, config) == pytest.approx(want)
    assert expert_dim((spec.num_experts // ep, spec.expert_ffn, spec.hidden), gpus // ep) == dim


def test_the_report_s_next_knobs_try_the_runtime_s_other_dispatchers():
    """Under expert parallelism the report's one-step changes include each token dispatcher the runtime offers:
    Megatron-LM on GPUs has allgather and flex beside the all-to-all; each is the same plan priced with that
    dispatcher (the flex one no slower than the all-to-all where experts span nodes); meshplan's executor has none."""
    from planner.report.knobs import next_knobs
    from planner.simulate import simulated_estimate
    plan = api.plan(api.load_job("qwen3-30b-a3b", "h100-80g", gpus=16, framework="megatron", global_batch=64,
                                 seq_len=4096), Knobs(ep=16, tp=1, pp=1), top_k=1)
    knobs = {k.name: k for k in next_knobs(plan)}
    assert {"--expert-dispatcher flex", "--expert-dispatcher allgather"} <= set(knobs)
    from dataclasses import replace
    flex = simulated_estimate(plan.graph, plan.cluster, replace(plan.workload, expert_dispatcher="flex"),
                              plan.best.config)
    assert knobs["--expert-dispatcher flex"].step_time_s == pytest.approx(flex.step_time_s)
    assert flex.step_time_s <= plan.best.estimate.step_time_s
    torch_plan = api.plan(api.load_job("mixtral-8x7b", "h100-80g", gpus=16), Knobs(ep=8), top_k=1)
    assert not any(k.name.startswith("--expert-dispatcher") for k in next_knobs(torch_plan))
