"""FP8 training recipes (planner/precision.py): which linears convert, what their GEMMs and casts cost, which
runtimes run which recipe where, and what a plan with one writes and exports."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli
from planner import api
from planner.cluster import load_cluster
from planner.cost.compute import gemm_s
from planner.cost.layer import fp8_converts, fp8_linear_s, grouped_gemms_s
from planner.errors import UserError
from planner.layers import Op
from planner.precision import RECIPES, torchao_converts


def _linear(name: str, k: int, n: int, **kw) -> Op:
    return Op(name=name, kind="linear", params=k * n, in_features=k, out_features=n, tp="column", **kw)


def test_torchaos_auto_filter_keeps_small_linears_in_bf16():
    # torchao/float8/float8_linear_utils.py: tensorwise skips K <= 4096 and N <= 1024; rowwise skips N <= 2048,
    # K <= 1024, and N <= 4096 with K <= 2048; any dimension not a multiple of 16 always
    tw, rw = RECIPES["fp8-tensorwise"], RECIPES["fp8-rowwise"]
    assert not torchao_converts(tw, 1024, 4096) and torchao_converts(tw, 1040, 4096) and torchao_converts(tw, 1024, 4112)
    assert not torchao_converts(rw, 2048, 8192) and not torchao_converts(rw, 4096, 2048)
    assert torchao_converts(rw, 4096, 4096) and torchao_converts(rw, 14336, 4096)
    assert not torchao_converts(tw, 14336, 4100)        # 4100 is not a multiple of 16
    # the runtimes: the LM head and routers stay bf16 everywhere; TransformerEngine converts every other linear
    small = _linear("layers.0.mlp.up_proj", 768, 768)
    assert fp8_converts(small, "fp8-tensorwise", "megatron")
    assert not fp8_converts(small, "fp8-tensorwise", "torchtitan")
    assert not fp8_converts(_linear("lm_head", 4096, 128256), "fp8-tensorwise", "megatron")
    assert not fp8_converts(_linear("layers.3.moe.router", 4096, 128), "fp8-tensorwise", "megatron")


def test_an_fp8_linear_is_its_gemms_at_the_fp8_rate_plus_its_casts_at_memory_speed():
    cluster = load_cluster("h100-80g", 8)
    dev = cluster.device
    m, n, k = 16384.0, 14336.0, 4096.0
    op = _linear("layers.0.mlp.gate_proj", int(k), int(n))
    hbm = dev.hbm_bytes_per_s * dev.hbm_efficiency
    # TransformerEngine's current scaling: an amax pass (read 2 bytes) and a fused cast-transpose (read 2, write
    # 1 + 1) of the input in forward and of the output gradient in backward; the weight once per step, not here
    fwd, bwd = fp8_linear_s(op, 1, m, n, k, cluster, "fp8-tensorwise", "megatron", 1)
    assert fwd == pytest.approx(gemm_s(m, n, k, dev, "fp8") + 6 * m * k / hbm, rel=1e-9)
    assert bwd == pytest.approx(gemm_s(m, k, n, dev, "fp8") + gemm_s(k, n, m, dev, "fp8") + 6 * m * n / hbm, rel=1e-9)
    # the weight-gradient GEMM kept in bf16 (torchao's rowwise_with_gw_hp); casts of torchao's kernels by class:
    # the input's one cast (read 2: its row amax, write 1), the weight's forward cast (2 + 1), every micro-batch;
    # in backward the output gradient's row-wise cast and the weight's transpose scaled per column (its amax
    # reduces along the strided dimension: the profile's strided-reduction rate, 368 GB/s on the H100)
    red, cast = dev.eager_bandwidth("reduce"), dev.eager_bandwidth("cast_down")
    strided = dev.strided_reduce_bandwidth()
    assert strided == 368e9
    fwd, bwd = fp8_linear_s(op, 1, m, n, k, cluster, "fp8-rowwise-gw-hp", "torchtitan", 1)
    assert fwd == pytest.approx(gemm_s(m, n, k, dev, "fp8") + 2 * (m * k + k * n) / red + (m * k + k * n) / cast,
                                rel=1e-9)
    assert bwd == pytest.approx(gemm_s(m, k, n, dev, "fp8") + gemm_s(k, n, m, dev, "bf16")
                                + 2 * m * n / red + 2 * k * n / strided + (m * n + k * n) / cast, rel=1e-9)
    # rowwise, every GEMM in FP8: forward as above but the input's kernel also writes a transposed copy (2 more
    # bytes); backward each wgrad and dgrad operand scaled per column (2 bytes strided each: the input, the
    # weight, the output gradient), the output gradient's row-wise amax (2), and the writes (input 1, weight's
    # transpose and cast 2 + 2 + 1, output gradient 1 + 2 + 1)
    fwd, bwd = fp8_linear_s(op, 1, m, n, k, cluster, "fp8-rowwise", "torchtitan", 1)
    assert fwd == pytest.approx(gemm_s(m, n, k, dev, "fp8") + 2 * (m * k + k * n) / red + (3 * m * k + k * n) / cast,
                                rel=1e-9)
    assert bwd == pytest.approx(gemm_s(m, k, n, dev, "fp8") + gemm_s(k, n, m, dev, "fp8")
                                + 2 * (m * k + k * n + m * n) / strided + 2 * m * n / red
                                + (m * k + 5 * k * n + 4 * m * n) / cast, rel=1e-9)
    # a profile that has not measured the strided rate prices those bytes as any reduction
    h200 = load_cluster("h200", 8).device
    assert h200.strided_reduce_bandwidth() == h200.eager_bandwidth("reduce")
    # k and v read q's input: its cast is not paid twice
    shared = _linear("layers.0.attn.k_proj", int(k), 1024, reads_previous_input=True)
    f_shared, _ = fp8_linear_s(shared, 1, m, 1024, k, cluster, "fp8-tensorwise", "megatron", 1)
    assert f_shared == pytest.approx(gemm_s(m, 1024, k, dev, "fp8"), rel=1e-9)


def test_transformer_engines_mxfp8_swizzles_both_operands_scales_before_each_gemm():
    # TE v2.9 gemm.cpp: swizzle_scaling_factors of A and of B before every MXFP8 GEMM, a kernel each reading and
    # writing the operand's e8m0 scales (1 byte per 32 values); the casts write those scales for both layouts too
    cluster = load_cluster("b200", 8)
    dev = cluster.device
    hbm = dev.hbm_bytes_per_s * dev.hbm_efficiency
    floor = 2e-6                # torchao's least cast-kernel time (planner/precision.py CAST_KERNEL_MIN_S)
    m, n, k = 16384.0, 14336.0, 4096.0
    op = _linear("layers.0.mlp.gate_proj", int(k), int(n))
    fwd, bwd = fp8_linear_s(op, 1, m, n, k, cluster, "mxfp8", "megatron", 1)
    swizzle = lambda elems: max(elems / 16 / hbm, floor)       # noqa: E731  (2/32 bytes an element)
    assert fwd == pytest.approx(gemm_s(m, n, k, dev, "mxfp8") + (4 + 1 / 16) * m * k / hbm
                                + swizzle(m * k) + swizzle(k * n), rel=1e-9)
    assert bwd == pytest.approx(gemm_s(m, k, n, dev, "mxfp8") + gemm_s(k, n, m, dev, "mxfp8")
                                + (4 + 1 / 16) * m * n / hbm + swizzle(m * n) + swizzle(k * n)
                                + swizzle(m * k) + swizzle(m * n), rel=1e-9)
    # a small linear: each swizzle is a kernel launch's least time, 6 of them a micro-batch
    small = _linear("layers.0.mlp.up_proj", 256, 256)
    f_small, b_small = fp8_linear_s(small, 1, 64, 256, 256, cluster, "mxfp8", "megatron", 1)
    f_cs, b_cs = fp8_linear_s(small, 1, 64, 256, 256, cluster, "fp8-delayed", "megatron", 1)
    assert (f_small - f_cs, b_small - b_cs) == pytest.approx((2 * floor, 4 * floor), rel=1e-6)


def test_fp8_gemms_of_a_large_linear_run_near_twice_the_bf16_rate():
    # the FP8 peak is twice bf16's on H100 (datasheet), the operands half the bytes: a large GEMM is compute bound
    cluster = load_cluster("h100-80g", 8)
    bf16 = sum(grouped_gemms_s(1, 16384, 14336, 4096, cluster, "bf16", 1))
    fp8 = sum(grouped_gemms_s(1, 16384, 14336, 4096, cluster, "bf16", 1, ("fp8", "fp8", "fp8")))
    peaks = cluster.device.fp8_peak_flops / cluster.device.peak("bf16")      # 1978.9 / 989.4, the datasheet's
    assert peaks == pytest.approx(2.0, rel=1e-3) and 0.9 * peaks < bf16 / fp8 <= peaks
    # MXFP8 on B200 runs at the FP8 rate, reading 1/32 more operand bytes for its scales
    b200 = load_cluster("b200", 8).device
    assert gemm_s(16384, 14336, 4096, b200, "mxfp8") == pytest.approx(gemm_s(16384, 14336, 4096, b200, "fp8"),
                                                                     rel=0.02)


def _step(model: str, precision: str, framework: str = "megatron", gpus: int = 8, seq_len: int | None = None,
          **knobs) -> float:
    job = api.load_job(model, cluster="h100-80g", gpus=gpus, global_batch=gpus * 4, precision=precision,
                       framework=framework, compile=framework != "megatron", seq_len=seq_len)
    return api.plan(job, api.Knobs(**knobs), top_k=1).best.estimate.step_time_s


def test_fp8_speeds_up_a_large_model_and_slows_a_small_one(tmp_path):
    small = tmp_path / "config.json"           # a Llama of hidden 256
    small.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 256,
                                 "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 8,
                                 "vocab_size": 32000, "max_position_embeddings": 2048}))
    # Llama 3 8B: FP8 GEMMs outweigh the casts around them
    fixed = dict(dp=8, tp=1, pp=1, cp=1, zero=1, micro_batch=1, recompute="full")
    assert _step("llama3-8b", "fp8-tensorwise", **fixed) < 0.85 * _step("llama3-8b", "bf16", **fixed)
    # hidden 256, 2048 tokens per micro-batch: each GEMM takes a few microseconds and the cast kernels around it at
    # least theirs (CAST_KERNEL_MIN_S), every linear converted under TransformerEngine: FP8 is slower (pytorch/ao
    # issues 572 and 1297 report such losses)
    assert _step(str(small), "fp8-tensorwise", seq_len=2048, **fixed) > _step(str(small), "bf16", seq_len=2048,
                                                                               **fixed)
    # torchao's auto filter leaves its linears (K, N <= 768) in bf16 under torchtitan: no loss, no gain
    fsdp = {**fixed, "zero": 3}
    assert _step(str(small), "fp8-rowwise", "torchtitan", seq_len=2048, **fsdp) == pytest.approx(
        _step(str(small), "bf16", "torchtitan", seq_len=2048, **fsdp), rel=1e-9)


def test_recipes_are_refused_where_the_runtime_or_the_gpu_does_not_run_them():
    def refused(**inputs) -> str:
        with pytest.raises(UserError) as err:
            api.load_job("llama3-8b", **inputs)
        return str(err.value)
    assert "allowed" in refused(cluster="a100-80g", gpus=8, framework="megatron", precision="fp8-tensorwise")
    assert "mxfp8" in refused(cluster="h100-80g", gpus=8, framework="megatron", precision="mxfp8")
    assert "fp8-rowwise-gw-hp" in refused(cluster="b200", gpus=8, framework="torch", precision="mxfp8",
                                          compile=True)     # meshplan's executor runs torchao's float8 linears only
    assert "--compile" in refused(cluster="h100-80g", gpus=8, framework="torch", precision="fp8-rowwise")
    assert "--compile" in refused(cluster="h100-80g", gpus=8, framework="torchtitan", precision="fp8-rowwise")
    assert "fp8-rowwise" in refused(cluster="h100-80g", gpus=8, framework="megatron", precision="fp8-rowwise")
    assert "CPU" in refused(cluster="cpu-gloo", gpus=2, framework="megatron", precision="fp8-tensorwise")
    # Blackwell runs MXFP8
    assert api.load_job("llama3-8b", cluster="b200", gpus=8, framework="megatron", precision="mxfp8").workload.fp8 \
        == "mxfp8"


def test_cli_plan_json_and_exports_carry_the_recipe(tmp_path):
    out = tmp_path / "r"
    proc = run_cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--framework",
                   "megatron", "--precision", "fp8-tensorwise", "--report", str(out), "--top-k", "1")
    assert proc.returncode == 0, proc.stderr
    assert "fp8-tensorwise, megatron runtime" in proc.stdout
    plan = json.loads((out / "plan.json").read_text())
    assert plan["workload"]["fp8"] == "fp8-tensorwise" and plan["workload"]["precision"] == "bf16"
    args = (out / "exports" / "megatron_args.txt").read_text()
    assert "--fp8-format hybrid\n--fp8-recipe tensorwise" in args and "--bf16" in args
    assert "FP8" in (out / "exports" / "NOTES.md").read_text()        # DeepSpeed's config cannot say it
    proc = run_cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--framework",
                   "torchtitan", "--compile", "--precision", "fp8-rowwise", "--report", str(tmp_path / "t"),
                   "--top-k", "1")
    assert proc.returncode == 0, proc.stderr
    toml = (tmp_path / "t" / "exports" / "torchtitan.toml").read_text()
    assert 'converters = ["quantize.linear.float8"]' in toml and 'recipe_name = "rowwise"' in toml
    assert 'filter_fqns = ["output", "auto_filter_small_kn"]' in toml
    # a bad value: exit 2, the allowed ones named, no traceback
    proc = run_cli("plan", "--model", "llama3-8b", "--precision", "fp4")
    assert proc.returncode == 2 and "fp8-tensorwise" in proc.stderr and "Traceback" not in proc.stderr


def test_whatif_sweeps_the_recipes(tmp_path):
    proc = run_cli("whatif", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--framework",
                   "megatron", "--sweep", "precision=bf16,fp8-tensorwise", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {p["value"]: p for p in json.loads((tmp_path / "whatif.json").read_text())["points"]}
    assert rows["fp8-tensorwise"]["tokens_per_s"] > rows["bf16"]["tokens_per_s"]
    assert (tmp_path / "whatif.png").exists()
    proc = run_cli("whatif", "--model", "llama3-8b", "--sweep", "precision=bf16,int4", "--out", str(tmp_path))
    assert proc.returncode == 2 and "int4" in proc.stderr and "Traceback" not in proc.stderr


def test_transformer_engine_keeps_the_fp8_copy_of_a_linears_input():
    from planner.cost.layer import Context, layer_cost
    from planner.layers import build_layer_graph
    from planner.model import load_model
    spec = load_model("llama3-8b")
    block = next(layer for layer in build_layer_graph(spec).layers if layer.kind == "block")
    cluster = load_cluster("h100-80g", 8)

    def kept(fp8: str, framework: str = "megatron", cluster=cluster) -> float:
        ctx = Context(micro_batch=1, seq_len=8192, tp=1, cp=1, sequence_parallel=False, precision="bf16",
                      attention="flash", framework=framework, tp_comm_overlap=False, fp8=fp8)
        return layer_cost(block, ctx, cluster).policy("none").act_bytes
    # the inputs the block's linears keep for their weight gradients: q's (k and v share it), gate's (up shares
    # it) and down's: 2 h + f elements per token, 2 bytes each in bf16, 1 as TE's FP8 copies
    h, f, tokens = spec.hidden, spec.ffn_hidden, 8192
    assert kept("") - kept("fp8-tensorwise") == pytest.approx((2 * h + f) * tokens, rel=1e-9)
    # MXFP8 adds an e8m0 scale per 32 values; torchao keeps the bf16 inputs
    b200 = load_cluster("b200", 8)
    assert kept("", cluster=b200) - kept("mxfp8", cluster=b200) == pytest.approx((2 * h + f) * tokens * (1 - 1 / 32),
                                                                                 rel=1e-9)
    assert kept("", "torchtitan") == kept("fp8-rowwise", "torchtitan")
    # blockwise keeps an fp32 scale per 128 values beside its FP8 copy (TE v2.9 Float8BlockQuantizer)
    assert kept("") - kept("fp8-blockwise") == pytest.approx((2 * h + f) * tokens * (1 - 4 / 128), rel=1e-9)


def test_blockwise_casts_write_a_scale_per_128_values_in_each_layout():
    # TE v2.9 float8_blockwise_tensor.py: an fp32 scale_inv per 1 x 128 block of the input and of the output gradient
    # (4 / 128 bytes a value) and per 128 x 128 block of the weight, for each of the two layouts the fused cast writes;
    # delayed scaling writes the same FP8 data with one scale per tensor
    cluster = load_cluster("h100-80g", 8)
    dev = cluster.device
    hbm = dev.hbm_bytes_per_s * dev.hbm_efficiency
    m, n, k = 16384.0, 14336.0, 4096.0
    op = _linear("layers.0.mlp.gate_proj", int(k), int(n))
    fwd, bwd = fp8_linear_s(op, 1, m, n, k, cluster, "fp8-blockwise", "megatron", 1)
    f_d, b_d = fp8_linear_s(op, 1, m, n, k, cluster, "fp8-delayed", "megatron", 1)
    assert fwd - f_d == pytest.approx(2 * 4 / 128 * m * k / hbm, rel=1e-9)
    assert bwd - b_d == pytest.approx(2 * 4 / 128 * m * n / hbm, rel=1e-9)


def test_fp8_param_gather_gathers_the_converted_parameters_in_one_byte():
    from planner.cost.step import CostCache
    from planner.layers import build_layer_graph
    from planner.model import load_model
    spec = load_model("llama3-8b")
    graph = build_layer_graph(spec)
    cluster = load_cluster("h100-80g", 8)
    h, f, kv = spec.hidden, spec.ffn_hidden, spec.num_kv_heads * spec.head_dim
    linears = spec.num_layers * (2 * h * h + 2 * h * kv + 3 * h * f)     # q, o; k, v; gate, up, down
    total = sum(layer.params for layer in graph.layers)
    job = api.load_job("llama3-8b", cluster="h100-80g", gpus=8, framework="megatron", precision="fp8-tensorwise",
                       fp8_param_gather=True)
    assert CostCache(graph, cluster, job.workload).gather_bytes_per_param == pytest.approx(2 - linears / total)
    plain = api.load_job("llama3-8b", cluster="h100-80g", gpus=8, framework="megatron", precision="fp8-tensorwise")
    assert CostCache(graph, cluster, plain.workload).gather_bytes_per_param == 2
    # MXFP8's parameters are gathered in bf16 (Megatron-Core's shared parameter/gradient buffer) and quantized after
    b200 = load_cluster("b200", 8)
    mx = api.load_job("llama3-8b", cluster="b200", gpus=8, framework="megatron", precision="mxfp8",
                      fp8_param_gather=True)
    assert CostCache(graph, b200, mx.workload).gather_bytes_per_param == 2
    with pytest.raises(UserError, match="megatron"):
        api.load_job("llama3-8b", cluster="h100-80g", gpus=8, framework="megatron", fp8_param_gather=True)


def test_left_out_the_search_picks_a_recipe_where_it_pays(tmp_path):
    # Llama 3 8B under Megatron-LM on H100: an FP8 recipe, and the plan says what each precision gave
    p = api.plan_precisions(api.JobInputs(model="llama3-8b", cluster="h100-80g", gpus=8, framework="megatron"),
                            top_k=1)
    # bf16 searched, each recipe estimated on bf16's plan, the fastest there searched
    assert p.workload.fp8 and set(p.precisions["on_base_plan"]) == {"fp8-tensorwise", "fp8-delayed", "fp8-blockwise"}
    tried = p.precisions["tried"]
    assert set(tried) == {"bf16", p.workload.fp8} and tried[p.workload.fp8] < tried["bf16"]
    on_base = p.precisions["on_base_plan"]
    assert on_base[p.workload.fp8] == min(on_base.values())
    assert json.loads(json.dumps(p.to_json()))["precisions"]["chosen"] == p.workload.fp8
    # a model whose layers are too small to gain stays in bf16, the recipes tried and slower
    small = tmp_path / "config.json"
    small.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 128,
                                 "intermediate_size": 384, "num_attention_heads": 8, "num_key_value_heads": 8,
                                 "vocab_size": 32000, "max_position_embeddings": 2048}))
    p = api.plan_precisions(api.JobInputs(model=str(small), cluster="h100-80g", gpus=8, framework="megatron",
                                          seq_len=2048, global_batch=32), api.Knobs(dp=8, tp=1, pp=1, cp=1),
                            top_k=1)
    assert p.workload.precision_name == "bf16"
    assert all(s > p.precisions["tried"]["bf16"] for s in p.precisions["on_base_plan"].values())
    # the recipe searched found no plan faster than bf16's by the model's error band
    assert p.precisions["not_faster"] and "keeps its numerics" in p.precisions["why"]
    # where the runtime runs no FP8 here (torchao's recipes without compiled blocks; any runtime on A100) nothing
    # else is tried
    assert api.precision_candidates(api.JobInputs(model="llama3-8b", cluster="h100-80g", gpus=8)) == ("bf16",)
    assert api.precision_candidates(api.JobInputs(model="llama3-8b", cluster="a100-80g", gpus=8,
                                                  framework="megatron")) == ("bf16",)
    # torchao's recipes only with compiled blocks; MXFP8 on Blackwell
    assert "fp8-rowwise" not in api.precision_candidates(api.JobInputs(cluster="h100-80g", framework="torchtitan"))
    assert "fp8-rowwise" in api.precision_candidates(api.JobInputs(cluster="h100-80g", framework="torchtitan",
                                                                   compile=True))
    assert "mxfp8" in api.precision_candidates(api.JobInputs(cluster="b200", framework="megatron"))


def test_megatron_gradients_in_bf16_take_two_bytes_and_reduce_in_two():
    from planner.cost.memory import grad_comm_bytes_per_param, state_bytes_per_param
    # Megatron-LM accumulates and all-reduces bf16 training's gradients in fp32 main gradients unless
    # --grad-reduce-in-bf16 (its arguments.py); the state bytes of the gradients go from 4 to 2
    fp32 = state_bytes_per_param(framework="megatron", precision="bf16", zero=1, shard=8, optimizer_offload=False)
    bf16 = state_bytes_per_param(framework="megatron", precision="bf16", zero=1, shard=8, optimizer_offload=False,
                                 grads_16bit=True)
    assert (fp32.grads, bf16.grads) == (4.0, 2.0) and (fp32.params, fp32.optimizer) == (bf16.params, bf16.optimizer)
    assert grad_comm_bytes_per_param("megatron", "bf16", True) == 2.0

    def grads_gib(**flags) -> float:
        job = api.load_job("llama3-8b", cluster="h100-80g", gpus=8, framework="megatron", **flags)
        config = api.ParallelConfig(dp=8, tp=1, pp=1, zero=1, micro_batch=1, num_microbatches=16, recompute="full")
        return api.fixed_plan(job, config).best.estimate.memory.grads
    assert grads_gib(grad_reduce_in_bf16=True) == pytest.approx(grads_gib() / 2)
    with pytest.raises(UserError, match="megatron"):
        api.load_job("llama3-8b", cluster="h100-80g", gpus=8, grad_reduce_in_bf16=True)


def test_the_exports_read_back_with_their_recipe(tmp_path):
    """`meshplan compare` reads an FP8 plan's Megatron-LM arguments and torchtitan TOML back as the same recipe."""
    for framework, flags, export, recipe in (
            ("megatron", ["--precision", "fp8-tensorwise", "--fp8-param-gather"], "megatron_args.txt",
             "fp8-tensorwise"),
            # the TOML form cannot turn sequence parallelism off under TP (the export says so): the plan keeps it on,
            # so that the file expresses the whole plan and reads back as its step
            ("torchtitan", ["--precision", "fp8-rowwise", "--compile", "--sequence-parallel", "on"], "torchtitan.toml",
             "fp8-rowwise")):
        out = tmp_path / framework
        proc = run_cli("plan", "--model", "llama3-8b", "--cluster", "h100-80g", "--gpus", "8", "--framework", framework,
                       *flags, "--report", str(out), "--top-k", "1")
        assert proc.returncode == 0, proc.stderr
        plan = json.loads((out / "plan.json").read_text())
        proc = run_cli("compare", "--baseline", str(out / "exports" / export), "--model", "llama3-8b", "--cluster",
                       "h100-80g", "--gpus", "8", "--top-k", "1", "--json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert f"{recipe}, {framework} runtime" in run_cli(
            "compare", "--baseline", str(out / "exports" / export), "--model", "llama3-8b", "--cluster", "h100-80g",
            "--gpus", "8", "--top-k", "1").stdout
        # the baseline estimated as the plan itself: the same step
        assert doc["baseline"]["estimate"]["step_time_s"] == pytest.approx(plan["estimate"]["step_time_s"], rel=1e-6)


def test_transformer_engines_expert_casts_run_one_kernel_per_expert_four_at_a_time():
    """TransformerEngine's GroupedLinear casts each expert's input on its own (nvte_multi_tensor_quantize: expert i on
    compute stream i % 4): 16 experts of 16 tokens x 256 under current scaling are 2 kernels each (amax, cast) whose
    bytes take far less than the 2 us floor, so forward's casts are 2 x 4 rounds x 2 us on four streams, 2 x 16 x 2 us
    one after another, and 2 x 2 us for a grouped GEMM's one input."""
    from planner.precision import CAST_KERNEL_MIN_S
    cluster = load_cluster("h100-80g", 8)
    op = _linear("layers.0.mlp.experts.gate_proj", 256, 256)
    for at_once, rounds in ((1, 16), (4, 4), (16, 1)):
        fwd, _ = fp8_linear_s(op, 16, 16, 256, 256, cluster, "fp8-tensorwise", "megatron", at_once)
        gemms, _ = grouped_gemms_s(16, 16, 256, 256, cluster, "bf16", at_once, ("fp8", "fp8", "fp8"))
        assert fwd - gemms == pytest.approx(2 * rounds * CAST_KERNEL_MIN_S, rel=1e-9)
