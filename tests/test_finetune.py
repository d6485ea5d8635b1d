"""Training modes (planner/finetune.py): full, LoRA, QLoRA. Hand-computed values on a small Llama-like model."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from planner import api
from planner import finetune
from planner.cluster import load_cluster
from planner.config import ParallelConfig, Workload
from planner.cost.compute import gemm_s
from planner.cost.layer import Context, layer_cost
from planner.cost.memory import frozen_share
from planner.cost.step import CostCache, dp_phases, estimate, rank_costs
from planner.errors import UserError
from planner.layers import Layer, Op, Saved, build_layer_graph
from planner.model import ModelSpec
from planner import network
from planner.plan import Plan

# h 256, 4 heads of 64, SwiGLU MLP of 512, vocabulary 1000, 2 blocks, untied head. One block: q, k, v, o 256 x 256
# (4 x 65,536 = 262,144), gate and up 256 x 512 and down 512 x 256 (3 x 131,072 = 393,216), two RMSNorms (512):
# 655,872. The model: embedding 256,000 + 2 blocks 1,311,744 + final norm 256 + head 256,000 = 1,824,000.
SPEC = ModelSpec(name="ft-tiny", num_layers=2, hidden=256, num_heads=4, num_kv_heads=4, head_dim=64, ffn_hidden=512,
                 vocab_size=1000, seq_len=512, mlp="swiglu", norm="rmsnorm", linear_bias=False, qkv_bias=False,
                 tied_embeddings=False, max_positions=0, dropout=False)
BLOCK, MODEL = 655_872, 1_824_000
LORA_QV = 2 * 8 * (256 + 256)           # rank 8 on q and v of one block, tp 1: A (256 x 8) + B (8 x 256) each


def workload(mode: str, **kw) -> Workload:
    extra = {} if mode == "full" else {"lora_rank": 8, "lora_targets": kw.pop("targets", ("q", "v"))}
    return Workload(global_batch=2, seq_len=512, finetune=mode, **extra, **kw)


def test_nf4_bits_are_the_papers_arithmetic():
    # Dettmers et al. 2023, Sec 3: 4 + 8/64 + 32/(64 x 256) = 4.127 bits
    assert finetune.NF4_BITS_PER_WEIGHT == 4.126953125
    assert finetune.NF4_BYTES_PER_WEIGHT == 0.515869140625
    assert finetune.dequantize_bytes_per_weight(2.0) == 2.515869140625       # packed read, bf16 written


def test_block_parameters_trainable_and_frozen():
    graph = build_layer_graph(SPEC)
    assert graph.layers[1].params == BLOCK and sum(layer.params for layer in graph.layers) == MODEL
    cluster = load_cluster("h100-80g", 2)
    for mode, trainable, frozen in (
            ("full", BLOCK, 0.0),
            ("lora", LORA_QV, BLOCK * 2.0),
            # 655,360 linear weights at 0.515869140625 bytes (338,080), the norms' 512 at 2 (1,024) and the 7 weights'
            # code tables, (16 + 256) fp32 each (7,616)
            ("qlora", LORA_QV, 346_720.0)):
        w = workload(mode)
        cost = CostCache(graph, cluster, w).layer(1, CostCache(graph, cluster, w).context(
            ParallelConfig(dp=2, tp=1, pp=1, num_microbatches=1)))
        assert cost.params == trainable and cost.frozen_bytes == pytest.approx(frozen)
    # tp 2: a column-parallel base splits B (A whole): 8 x (256 + 128) per projection
    w = workload("lora")
    cache = CostCache(graph, cluster, w)
    cost = cache.layer(1, cache.context(ParallelConfig(dp=1, tp=2, pp=1, num_microbatches=2)))
    assert cost.params == 2 * 8 * (256 + 128)


@pytest.mark.parametrize("mode,params,grads,optimizer", [
    # torch, ZeRO-3 over dp 2 (FSDP2): trainable 4 (fp32) + 4 + 8 bytes, halved; frozen at rest halved
    ("full", MODEL * 4 / 2, MODEL * 4 / 2, MODEL * 8 / 2),
    # 2 x 8,192 adapters; the frozen 1,824,000 at 2 bytes, halved
    ("lora", 2 * LORA_QV * 4 / 2 + MODEL * 2 / 2, 2 * LORA_QV * 4 / 2, 2 * LORA_QV * 8 / 2),
    # frozen: 2 blocks of 346,720 bytes, embedding + final norm + head 512,256 at 2 bytes, halved
    ("qlora", 2 * LORA_QV * 4 / 2 + (2 * 346_720 + 512_256 * 2) / 2, 2 * LORA_QV * 4 / 2, 2 * LORA_QV * 8 / 2),
])
def test_state_bytes_per_rank(mode, params, grads, optimizer):
    graph = build_layer_graph(SPEC)
    cluster = load_cluster("h100-80g", 2)
    config = ParallelConfig(dp=2, tp=1, pp=1, zero=3, micro_batch=1, num_microbatches=1)
    mem = estimate(graph, cluster, workload(mode), config).memory
    assert mem.params == pytest.approx(params) and mem.grads == pytest.approx(grads)
    assert mem.optimizer == pytest.approx(optimizer)


def test_frozen_share_by_runtime_and_stage():
    kw = dict(precision="bf16", shard=4)
    assert frozen_share(framework="torch", zero=0, **kw) == (1.0, 0.0)      # replicated, no master, no autocast copy
    assert frozen_share(framework="torch", zero=3, **kw) == (0.25, 0.0)     # FSDP2 shards it
    assert frozen_share(framework="torch", zero=2, **kw) == (1.25, 0.0)     # + the gathered copy kept to backward
    assert frozen_share(framework="deepspeed", zero=2, **kw) == (1.0, 0.0)  # DeepSpeed shards parameters at 3 only
    assert frozen_share(framework="megatron", zero=1, **kw) == (1.0, 0.0)
    assert frozen_share(framework="deepspeed", zero=3, param_offload=True, **kw) == (0.0, 0.25)


def one_linear_layer(name: str, saved=True) -> Layer:
    op = Op(name=name, kind="linear", params=256 * 256, in_features=256, out_features=256, tp="column",
            saved=(Saved(elems=256, split="sp", gathered_input=True),) if saved else ())
    return Layer(name="layers.0", kind="block", signature="one", ops=(op,), output_elems=256)


def context(mode: str, targets=("q",)) -> Context:
    return Context(micro_batch=1, seq_len=512, tp=1, cp=1, sequence_parallel=False, precision="bf16",
                   attention="flash", framework="megatron", tp_comm_overlap=False, finetune=mode,
                   lora_rank=8 if mode != "full" else 0, lora_targets=targets if mode != "full" else ())


def test_frozen_linear_backward_is_its_input_gradient_only():
    cluster = load_cluster("h100-80g", 1)
    dev = cluster.device
    m, n, k = 512, 256, 256
    full = layer_cost(one_linear_layer("layers.0.attn.q_proj"), context("full"), cluster)
    frozen = layer_cost(one_linear_layer("layers.0.attn.q_proj"), context("lora", ("down",)), cluster)
    assert full.bwd_s == pytest.approx(gemm_s(m, k, n, dev, "bf16") + gemm_s(k, n, m, dev, "bf16"))
    assert frozen.bwd_s == pytest.approx(gemm_s(m, k, n, dev, "bf16"))      # dgrad: (m x n) @ (n x k)
    assert frozen.wgrad_s == 0.0 and frozen.params == 0.0
    assert frozen.matmul_flops_fwd == 2 * 512 * 256 * 256 == 67_108_864
    assert frozen.matmul_flops_bwd == 67_108_864                            # dgrad only, not 2x
    # its input is not kept for a weight gradient: 256 x 512 tokens x 2 bytes less
    assert full.policy("none").act_bytes - frozen.policy("none").act_bytes == 256 * 512 * 2


def frozen(layer: Layer) -> Layer:
    """``layer`` with every op's parameters frozen, as a traced module's ``requires_grad_(False)`` leaves them."""
    return replace(layer, ops=tuple(replace(op, frozen=True) for op in layer.ops))


def bwd_flops(cost) -> float:
    """A LayerCost's backward matmul FLOPs (``matmul_flops_bwd``; None: twice the forward's)."""
    return 2 * cost.matmul_flops_fwd if cost.matmul_flops_bwd is None else cost.matmul_flops_bwd


def test_a_frozen_op_under_full_training_is_priced_as_the_frozen_base_of_lora():
    cluster = load_cluster("h100-80g", 1)
    full = layer_cost(one_linear_layer("layers.0.attn.q_proj"), context("full"), cluster)
    cost = layer_cost(frozen(one_linear_layer("layers.0.attn.q_proj")), context("full"), cluster)
    assert cost.bwd_s == pytest.approx(gemm_s(512, 256, 256, cluster.device, "bf16"))     # dgrad alone
    assert cost.wgrad_s == 0.0 and cost.params == 0.0
    assert (cost.frozen_params, cost.frozen_bytes) == (65_536, 65_536 * 2)                 # stored at bf16
    assert cost.matmul_flops_bwd == 67_108_864                                              # not 2 x
    assert full.policy("none").act_bytes - cost.policy("none").act_bytes == 256 * 512 * 2  # its input not kept
    # the layers LoRA puts no adapter in (embedding, final norm, head): frozen by the module or by the mode alike
    graph = build_layer_graph(SPEC)
    for i in (0, 3, 4):
        by_op = layer_cost(frozen(graph.layers[i]), context("full"), cluster)
        by_mode = layer_cost(graph.layers[i], context("lora"), cluster)
        for field in ("fwd_s", "bwd_s", "wgrad_s", "params", "frozen_params", "frozen_bytes", "matmul_flops_fwd"):
            assert getattr(by_op, field) == getattr(by_mode, field), (graph.layers[i].name, field)
        assert bwd_flops(by_op) == bwd_flops(by_mode)
        assert by_op.policy("none").act_bytes == by_mode.policy("none").act_bytes
    assert layer_cost(frozen(graph.layers[0]), context("full"), cluster).bwd_s == 0.0    # a frozen table: none


def test_a_partly_frozen_layer_splits_its_parameters_op_by_op():
    cluster = load_cluster("h100-80g", 2)
    norm = Op(name="layers.0.mlp_norm", kind="elementwise", params=256, bytes_fwd=1024, bytes_bwd=1536, split="sp",
              norm=True, frozen=True)
    up = Op(name="layers.0.mlp.up_proj", kind="linear", params=256 * 512, in_features=256, out_features=512,
            tp="column", frozen=True)
    down = Op(name="layers.0.mlp.down_proj", kind="linear", params=512 * 256 + 256, in_features=512, out_features=256,
              tp="row")
    # replicated under tp: the norm's 256 and the row-parallel bias's 256
    layer = Layer(name="layers.0", kind="block", signature="mixed", ops=(norm, up, down), output_elems=256,
                  params_replicated=512)
    ctx = context("full")._replace(tp=2)
    cost = layer_cost(layer, ctx, cluster)
    # trains: down's weight over 2 ranks (65,536) and its bias whole (256); frozen: up's weight over 2 (65,536)
    # and the norm whole (256), 2 bytes each
    assert cost.params == 65_536 + 256
    assert cost.frozen_params == 65_536 + 256 and cost.frozen_bytes == (65_536 + 256) * 2
    # one weight gradient: down's, (256 x 512 tokens) @ (512 x 256) on each rank
    assert cost.wgrad_s == pytest.approx(gemm_s(256, 256, 512, cluster.device, "bf16"))
    # forward 2 x 512 x (256 x 256 + 256 x 256) per rank; backward: up's dgrad, down's dgrad and wgrad
    assert cost.matmul_flops_fwd == 2 * 512 * 2 * 65_536
    assert cost.matmul_flops_bwd == 2 * 512 * 65_536 * 3


def test_a_model_with_nothing_to_train_prices_no_gradient_optimizer_or_reduction():
    graph = build_layer_graph(SPEC)
    graph = replace(graph, layers=tuple(frozen(layer) for layer in graph.layers))
    cluster = load_cluster("h100-80g", 4)
    w = replace(workload("full"), global_batch=8)
    for zero, pp in ((0, 1), (1, 1), (3, 1), (0, 2), (3, 2)):
        config = ParallelConfig(dp=4 // pp, tp=1, pp=pp, zero=zero, micro_batch=1, num_microbatches=2 * pp)
        est = estimate(graph, cluster, w, config)
        assert est.memory.grads == 0.0 and est.memory.optimizer == 0.0 and est.time.optimizer == 0.0
        if zero < 3:                 # nothing gathered, nothing reduced
            assert est.time.dp_comm == 0.0
        if (zero, pp) == (0, 1):     # every parameter stored at bf16 on every rank
            assert est.memory.params == MODEL * 2
    # linears 2x their forward (no weight gradient), attention 3x (test_model_flops_of_lora's numbers)
    linears = 2 * 2 * (4 * 65_536 + 3 * 131_072) + 2 * 256 * 1000
    assert finetune.model_flops_per_token(graph, 512, finetune.of("full")) == 2 * linears + 3 * 2 * 4 * 4 * 64 * 512


def test_lora_adds_two_thin_gemms_each_way():
    cluster = load_cluster("h100-80g", 1)
    cost = layer_cost(one_linear_layer("layers.0.attn.q_proj"), context("lora", ("q",)), cluster)
    # forward: base 2 x 512 x 256 x 256 plus the adapter 2 x 512 x 8 x (256 + 256) = 4,194,304
    assert cost.matmul_flops_fwd == 67_108_864 + 4_194_304
    # backward: the base's input gradient, the adapter's input and weight gradients
    assert cost.matmul_flops_bwd == 67_108_864 + 2 * 4_194_304
    assert cost.params == 8 * (256 + 256)
    # kept: the input (for A's weight gradient) and B's 8-wide input: (256 + 8) x 512 tokens x 2 bytes
    assert cost.policy("none").act_bytes == (256 + 8) * 512 * 2


def test_model_flops_of_lora():
    graph = build_layer_graph(SPEC)
    full = graph.model_flops_per_token(512)
    attention = 3 * 2 * 4 * 4 * 64 * 512            # 3 x (4 heads x 64 x 512 x 4) per block, 2 blocks
    linears = 2 * 2 * (4 * 65_536 + 3 * 131_072) + 2 * 256 * 1000       # forward matmuls per token
    assert full == 3 * linears + attention
    adapters = 3 * 2 * 2 * 8 * (256 + 256) * 2      # 3 passes x 2 FLOPs x r (in + out), q and v, 2 blocks
    assert finetune.model_flops_per_token(graph, 512, finetune.of("lora", 8, ("q", "v"))) == \
        2 * linears + attention + adapters


def test_data_parallel_reduces_only_trainable_parameters():
    graph = build_layer_graph(SPEC)
    cluster = load_cluster("h100-80g", 2)
    cache = CostCache(graph, cluster, workload("lora"))
    config = ParallelConfig(dp=2, tp=1, pp=1, zero=0, micro_batch=1, num_microbatches=1)
    (rank,) = rank_costs(cache, config)
    assert ((LORA_QV, BLOCK * 2.0), 2) in rank.buckets     # (trainable, frozen bytes), 2 blocks
    grp = network.group(cluster, 2, 1)
    # ZeRO-0: the all-reduce of 8,192 fp32 gradients (torch reduces in fp32): 32,768 bytes, no gather
    assert dp_phases(cache, config, LORA_QV, frozen_bytes=BLOCK * 2.0) == \
        (0.0, 0.0, network.all_reduce_s(cluster, 32_768, grp))
    # ZeRO-3: the gathers carry the frozen bytes too (8,192 x 2 + 1,311,744), the reduction the trainable alone
    z3 = config.but(zero=3)
    gather = network.all_gather_s(cluster, LORA_QV * 2 + BLOCK * 2.0, grp)
    assert dp_phases(cache, z3, LORA_QV, frozen_bytes=BLOCK * 2.0) == \
        (gather, gather, network.reduce_scatter_s(cluster, 32_768, grp))
    # a layer with nothing trainable (the head, the embedding) reduces nothing
    assert dp_phases(cache, config, 0.0, frozen_bytes=512_000.0) == (0.0, 0.0, 0.0)


def test_qlora_dequantizes_each_use():
    cluster = load_cluster("h100-80g", 1)
    lora = layer_cost(one_linear_layer("layers.0.attn.q_proj"), context("lora", ("down",)), cluster)
    qlora = layer_cost(one_linear_layer("layers.0.attn.q_proj"), context("qlora", ("down",)), cluster)
    from planner.cost.compute import memory_bound_s
    dq = memory_bound_s(65_536 * 2.515869140625, cluster.device)
    assert qlora.fwd_s == pytest.approx(lora.fwd_s + dq) and qlora.bwd_s == pytest.approx(lora.bwd_s + dq)


def test_runtime_table_says_who_runs_which_mode():
    with pytest.raises(UserError, match="torchtitan runtime does not run lora") as e:
        api.load_job("llama3-8b", "h100-80g", gpus=8, framework="torchtitan", finetune="lora")
    assert e.value.field == "--finetune"
    with pytest.raises(UserError, match="megatron runtime does not run qlora"):
        api.load_job("llama3-8b", "h100-80g", gpus=8, framework="megatron", finetune="qlora")
    api.load_job("llama3-8b", "h100-80g", gpus=8, framework="deepspeed", finetune="qlora")
    with pytest.raises(UserError, match="--finetune lora or qlora") as e:
        api.load_job("llama3-8b", "h100-80g", gpus=8, lora_rank=16)
    assert e.value.field == "--lora-rank"


def test_defaults_are_the_runtimes_lora():
    job = api.load_job("llama3-8b", "h100-80g", gpus=8, finetune="lora")
    assert (job.workload.lora_rank, job.workload.lora_targets) == (8, ("q", "v"))            # PEFT's
    job = api.load_job("llama3-8b", "h100-80g", gpus=8, finetune="lora", framework="megatron")
    assert (job.workload.lora_rank, job.workload.lora_targets) == \
        (32, ("q", "k", "v", "o", "gate", "up", "down"))                                       # Megatron-Bridge's
    job = api.load_job("llama3-8b", "h100-80g", gpus=8, finetune="lora", framework="megatron", lora_rank=16,
                       lora_targets=("q", "k", "v"))
    assert (job.workload.lora_rank, job.workload.lora_targets) == (16, ("q", "k", "v"))


EVERY_LINEAR = ("q", "k", "v", "o", "gate", "up", "down")


def test_megatron_bridge_lora_puts_one_adapter_on_each_fused_module():
    # SPEC's block: q, k, v 256 -> 256 (Megatron-Core's linear_qkv), o 256 -> 256, gate and up 256 -> 512
    # (linear_fc1), down 512 -> 256. Megatron-Bridge's performant LoRA: one adapter a module, B as wide as its outputs
    ops = build_layer_graph(SPEC).layers[1].ops
    at = {op.name.rsplit(".", 1)[-1]: i for i, op in enumerate(ops) if op.kind == "linear"}
    assert finetune.of("lora", 8, EVERY_LINEAR, "megatron-bridge").adapters(ops) == {
        at["q_proj"]: (256, 768), at["o_proj"]: (256, 256), at["gate_proj"]: (256, 1024), at["down_proj"]: (512, 256)}
    # PEFT: one a projection
    assert finetune.of("lora", 8, EVERY_LINEAR).adapters(ops) == {
        i: (ops[i].in_features, ops[i].out_features) for i in at.values()}
    # a module named in part is adapted projection by projection, as Megatron-Bridge's CanonicalLoRA does
    assert finetune.of("lora", 8, ("q", "v", "gate", "up"), "megatron-bridge").adapters(ops) == {
        at["q_proj"]: (256, 256), at["v_proj"]: (256, 256), at["gate_proj"]: (256, 1024)}


def test_fused_adapters_in_the_layer_cost():
    layer = build_layer_graph(SPEC).layers[1]
    cluster = load_cluster("h100-80g", 1)
    ctx = context("lora", EVERY_LINEAR)
    bridge, peft = layer_cost(layer, ctx, cluster), layer_cost(layer, ctx._replace(framework="torch"), cluster)
    # rank 8 x (in + out): PEFT 4 x 512 + 2 x 768 + 768 = 4,352; Megatron-Bridge 1,024 + 512 + 1,280 + 768 = 3,584
    assert (peft.params, bridge.params) == (8 * 4_352, 8 * 3_584)
    # the adapters' forward matmuls, 2 x 512 tokens x r x (in + out), the base's the same under both
    assert peft.matmul_flops_fwd - bridge.matmul_flops_fwd == 2 * 512 * 8 * (4_352 - 3_584)
    assert finetune.model_flops_per_token(build_layer_graph(SPEC), 512, finetune.of("lora", 8, EVERY_LINEAR)) - \
        finetune.model_flops_per_token(build_layer_graph(SPEC), 512, finetune.of("lora", 8, EVERY_LINEAR,
                                                                                  "megatron-bridge")) == \
        3 * 2 * 8 * (4_352 - 3_584) * 2         # 3 passes, 2 blocks


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True)


def test_cli_errors_name_the_flag_and_the_allowed_values():
    out = run_cli("plan", "--model", "llama3-8b", "--finetune", "adapters")
    assert out.returncode == 2 and "--finetune" in out.stderr and "qlora" in out.stderr
    out = run_cli("plan", "--model", "llama3-8b", "--finetune", "lora", "--lora-targets", "q,x")
    assert out.returncode == 2 and "--lora-targets" in out.stderr and "gate" in out.stderr


def test_plan_json_round_trip_keeps_the_mode(tmp_path):
    job = api.load_job("llama3-8b", "h100-80g", gpus=8, finetune="qlora", lora_rank=16, lora_targets=("q", "k", "v"))
    plan = api.plan(job, api.Knobs(tp=1, pp=1, cp=1, zero=0, micro_batch=1, recompute="full"))
    doc = json.loads(json.dumps(plan.to_json()))
    assert doc["workload"]["finetune"] == "qlora" and doc["workload"]["lora_targets"] == ["q", "k", "v"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    back = Plan.from_json(json.loads(path.read_text()), str(path))
    assert back.workload == job.workload
    doc["workload"]["finetune"] = "dora"
    with pytest.raises(UserError) as e:
        Plan.from_json(doc, "plan.json")
    assert e.value.field == "workload.finetune"
