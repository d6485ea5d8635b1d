"""A traced nn.Module's own frozen parameters (requires_grad=False) are planned as frozen, with no flag
(planner/trace/build.py ``Op.frozen``; planner/finetune.py ``Adapters.trains``). Expected values by hand."""
import json

import pytest

import trace_models as tm
from planner import api, finetune
from planner.cli import main
from planner.cluster import load_cluster
from planner.config import ParallelConfig, Workload
from planner.cost.compute import gemm_s
from planner.cost.layer import Context, layer_cost
from planner.cost.memory import state_bytes_per_param
from planner.cost.step import CostCache, tied_bucket, tied_embedding_sync_s
from planner.trace import trace

MODELS = "tests/trace_models.py"
# TinyTransformer (width 64, vocabulary 96, 32 positions, 3 blocks): tok 6,144, pos 2,048; a block: ln1 128,
# qkv 64 x 192 + 192 = 12,480, proj 64 x 64 + 64 = 4,160, ln2 128, fc 64 x 256 + 256 = 16,640, out 256 x 64 + 64
# = 16,448 (49,984); final norm 128, head 64 x 96 = 6,144: 164,416 in all
ALL = 164_416
# frozen_transformer freezes tok, pos and each block's qkv and fc: 6,144 + 2,048 + 3 x (12,480 + 16,640) = 95,552
FROZEN = 95_552
TRAINABLE = ALL - FROZEN            # 3 x (128 + 4,160 + 128 + 16,448) + 128 + 6,144 = 68,864


def test_trace_marks_an_op_frozen_where_none_of_its_parameters_trains():
    graph = trace(*tm.frozen_transformer())
    marked = {op.name for layer in graph.layers for op in layer.ops if op.frozen}
    assert marked == {"tok", "(root):elementwise.none"} | {f"blocks.{i}.{name}" for i in range(3)
                                                          for name in ("attn.qkv", "fc")}
    assert sum(op.params for layer in graph.layers for op in layer.ops if op.frozen) == FROZEN
    assert not graph.warnings
    # a frozen weight beside a bias that trains: the op trains, all of it, and the graph says so
    model, example = tm.tiny_transformer()
    model.blocks[1].fc.weight.requires_grad_(False)
    graph = trace(model, example)
    assert not any(op.frozen for layer in graph.layers for op in layer.ops)
    assert any(w.startswith("blocks.1.fc: some of the parameters have requires_grad=False") for w in graph.warnings)


def test_meshplan_trace_counts_the_frozen_parameters(capsys):
    assert main(["trace", f"{MODELS}:frozen_transformer"]) == 0
    assert "TinyTransformer: 164.416K parameters (95.552K frozen: requires_grad=False)," in capsys.readouterr().out


def plan_json(capsys, model: str, *flags: str) -> dict:
    assert main(["plan", "--model", f"{MODELS}:{model}", "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch",
                 "4", "--tp", "1", "--pp", "1", "--micro-batch", "1", "--recompute", "none", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("zero", [0, 3])
def test_plan_holds_gradients_and_optimizer_states_of_the_trainable_parameters_only(capsys, zero):
    doc = plan_json(capsys, "frozen_transformer", "--zero", str(zero))
    assert doc["workload"]["precision"] == "fp32" and doc["config"]["dp"] == 2
    states = state_bytes_per_param(framework="torch", precision="fp32", zero=zero, shard=2, optimizer_offload=False)
    mem = doc["estimate"]["memory_per_gpu_bytes"]
    assert mem["grads"] == round(TRAINABLE * states.grads)
    assert mem["optimizer"] == round(TRAINABLE * states.optimizer)
    # the frozen ones stored at the compute dtype (fp32: 4 bytes), replicated at ZeRO-0, halved by FSDP2 at 3
    assert mem["params"] == round(TRAINABLE * states.params + FROZEN * 4 / (2 if zero == 3 else 1))
    # the same module with every parameter trainable still plans them all
    mem = plan_json(capsys, "tiny_transformer", "--zero", str(zero))["estimate"]["memory_per_gpu_bytes"]
    assert mem["grads"] == round(ALL * states.grads) and mem["params"] == round(ALL * states.params)


def test_a_frozen_linear_runs_its_input_gradient_only():
    frozen, trainable = trace(*tm.frozen_transformer()), trace(*tm.tiny_transformer())
    cluster = load_cluster("h100-80g", 1)
    ctx = Context(micro_batch=1, seq_len=32, tp=1, cp=1, sequence_parallel=False, precision="bf16",
                  attention="flash", framework="torch", tp_comm_overlap=False)
    # blocks.1: its input needs a gradient in both traces (blocks.0's proj and out train), so the two differ in
    # the weight gradients of qkv and fc alone: (in x 32 tokens) @ (32 x out)
    cold, warm = layer_cost(frozen.layers[2], ctx, cluster), layer_cost(trainable.layers[2], ctx, cluster)
    dev = cluster.device
    skipped = gemm_s(64, 192, 32, dev, "bf16") + gemm_s(64, 256, 32, dev, "bf16")
    assert warm.bwd_s - cold.bwd_s == pytest.approx(skipped)
    assert cold.wgrad_s == pytest.approx(gemm_s(64, 64, 32, dev, "bf16") + gemm_s(256, 64, 32, dev, "bf16"))
    # forward 2 x 32 tokens x (64 x 192 + 64 x 64 + 64 x 256 + 256 x 64) = 3,145,728 in both; backward twice that
    # less qkv's 786,432 and fc's 1,048,576
    assert cold.matmul_flops_fwd == warm.matmul_flops_fwd == 3_145_728 and warm.matmul_flops_bwd is None
    assert cold.matmul_flops_bwd == 2 * 3_145_728 - 786_432 - 1_048_576
    assert (cold.params, cold.frozen_params, cold.frozen_bytes) == (20_864, 29_120, 29_120 * 2)
    # model FLOPs per token: 3x a trainable linear's forward, 2x a frozen one's, attention 3 x 4 x 64 x 32 a block
    per_block = 3 * 2 * (64 * 64 + 256 * 64) + 2 * 2 * (64 * 192 + 64 * 256) + 3 * 4 * 64 * 32
    assert finetune.model_flops_per_token(frozen, 32, finetune.of("full")) == 3 * per_block + 3 * 2 * 64 * 96


def test_a_frozen_tied_table_has_no_gradient_in_the_head():
    model, example = tm.tiny_transformer()
    model.head.weight = model.tok.weight            # tied: the head multiplies by the table (96 x 64)
    model.tok.requires_grad_(False)
    graph = trace(model, example)
    assert graph.tied_embeddings and graph.tied_params == 6_144 and graph.tied_frozen
    assert next(op for op in graph.layers[-1].ops if op.name == "head").frozen
    job = api.JobInputs(model="llama3-8b", cluster="cpu-gloo", gpus=2).load()      # a workload and a cluster
    cache = CostCache(graph, job.cluster, job.workload)
    assert tied_bucket(cache, 6_144) == (0.0, 6_144 * 4)           # fp32 on cpu-gloo
    assert tied_embedding_sync_s(cache, ParallelConfig(dp=1, tp=1, pp=2, micro_batch=1, num_microbatches=2)) == 0.0
    model.tok.requires_grad_(True)
    trained = CostCache(trace(model, example), job.cluster, job.workload)
    assert tied_bucket(trained, 6_144) == (6_144, 0.0)
    assert tied_embedding_sync_s(trained, ParallelConfig(dp=1, tp=1, pp=2, micro_batch=1, num_microbatches=2)) > 0


def test_lora_on_a_traced_module_is_as_before_whatever_its_requires_grad():
    # LoRA freezes every base parameter anyway: rank 8 on q and v of 2 blocks train, 2 x 2 x 8 x (64 + 64)
    adapters = 2 * 2 * 8 * (64 + 64)
    mems = []
    for model in ("lora_named", "lora_named_frozen"):
        job = api.JobInputs(model=f"{MODELS}:{model}", cluster="cpu-gloo", gpus=2, global_batch=4,
                            finetune="lora").load()
        plan = api.plan(job, api.Knobs(tp=1, pp=1, cp=1, zero=0, micro_batch=1, recompute="none"))
        mems.append(plan.estimate.memory)
    assert mems[0].grads == mems[1].grads == adapters * 4
    assert mems[0].optimizer == mems[1].optimizer == adapters * 8
    assert mems[0].params == mems[1].params


def test_a_module_with_nothing_to_train_plans_with_a_warning():
    model, example = tm.tiny_transformer()
    model.requires_grad_(False)
    graph = trace(model, example)
    assert all(op.frozen for layer in graph.layers for op in layer.ops if op.params)
    assert any(w.startswith("no parameter has requires_grad=True: nothing trains") for w in graph.warnings)
    for zero in (0, 3):              # no gradient to reduce, no optimizer step, every parameter stored at fp32
        plan = api.plan_graph(graph, "cpu-gloo", Workload(global_batch=4, seq_len=32, precision="fp32"), gpus=2,
                              knobs=api.Knobs(tp=1, pp=1, cp=1, zero=zero, micro_batch=1, recompute="none"))
        mem = plan.estimate.memory
        assert (mem.grads, mem.optimizer, plan.estimate.time.optimizer) == (0.0, 0.0, 0.0)
        assert mem.params == ALL * 4 / (2 if zero == 3 else 1)
        assert (plan.estimate.time.dp_comm == 0.0) == (zero == 0)       # ZeRO-3 still gathers the frozen shards
