"""Torch-eager elementwise traffic (executor/eager_counts.py -> planner/eager_table.py ->
planner/cost/eager.py): the table is what the executor's models really run, and the cost functions
price it as stated."""
import subprocess
import sys
from types import SimpleNamespace

import pytest

from planner.cluster import load_cluster
from planner.config import ParallelConfig
from planner.cost.eager import CAST_DOWN_BYTES, eager_regime, eager_s, step_param_bytes
from planner.cost.step import grads_follow_activations
from planner.eager_bytes import layer_eager_bytes
from planner.eager_table import TABLE
from planner.estimate import Memory
from planner.model import load_model

H100 = load_cluster("profiles/measured/h100-sxm5.toml", 1).device


def test_the_committed_table_is_a_fresh_count():
    # two of the four families, one of each norm and MLP (the ones with the most parts: dropout, q/k/v
    # biases), to keep CI's time: `python -m executor.eager_counts --check` counts them all
    proc = subprocess.run([sys.executable, "-m", "executor.eager_counts", "--check",
                           "--family", "layernorm-gelu-bias-learned-dropout", "--family", "rmsnorm-swiglu-rope-qkvbias"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_a_family_check_fails_on_a_changed_coefficient(tmp_path, monkeypatch):
    from executor import eager_counts
    committed = eager_counts._committed()
    family = "rmsnorm-swiglu-rope"
    monkeypatch.setattr(eager_counts, "table", lambda families=None: {family: {**committed[family], "fp32": {
        **committed[family]["fp32"], "kernels": {**committed[family]["fp32"]["kernels"], "block_fwd": -1}}}})
    assert eager_counts.main(["--check", "--family", family]) == 1
    monkeypatch.setattr(eager_counts, "table", lambda families=None: {family: committed[family]})
    assert eager_counts.main(["--check", "--family", family]) == 0


def test_autocast_casts_the_fp32_input_of_each_linear_that_reads_the_residual_stream():
    # GPT block under autocast: q, k, v and fc1 read the fp32 LayerNorm output, each casts it to bf16
    # (read 4, write 2): 4 x 6 h bytes per token; o_proj and fc2 read bf16 (SDPA's, GELU's output)
    fwd = TABLE["layernorm-gelu-bias-learned"]["autocast"]["block_fwd"]
    assert fwd["cast_down"] == [24.0, 0.0, 0.0, 0.0, 0.0]
    # the bf16 regime has no such cast: parameters and activations are already bf16
    assert "cast_down" not in TABLE["layernorm-gelu-bias-learned"]["bf16"]["block_fwd"]


def test_the_loss_streams_the_fp32_logits():
    # head forward: the bf16 logits cast to fp32 (read 2, write 4) per vocabulary entry
    fwd = TABLE["rmsnorm-swiglu-rope"]["autocast"]["head_fwd"]
    assert fwd["cast_up"][1] == pytest.approx(6.0, abs=0.02)


def test_kernel_classes():
    from executor.eager_counts import kernel_class

    def meta(itemsize, addressed=100, storage=100):
        return SimpleNamespace(itemsize=itemsize, addressed_bytes=addressed, storage_bytes=storage)
    rec = lambda name, ins, outs: SimpleNamespace(name=name, inputs=ins, outputs=outs)   # noqa: E731
    assert kernel_class(rec("_to_copy", [meta(2)], [meta(4)])) == "cast_up"
    assert kernel_class(rec("_to_copy", [meta(4)], [meta(2)])) == "cast_down"
    assert kernel_class(rec("sum", [meta(2)], [meta(2)])) == "reduce"
    assert kernel_class(rec("mul", [meta(4, 50, 100), meta(4, 50, 50)], [meta(4, 50, 50)])) == "strided"
    assert kernel_class(rec("mul", [meta(4), meta(4)], [meta(4)])) == "stream"


def test_eager_seconds_use_each_class_bandwidth_and_the_kernel_gap():
    bw = dict(H100.eager_bytes_per_s)
    got = eager_s({"cast_up": 1e9, "stream": 2e9}, 100, H100)
    assert got == pytest.approx(1e9 / bw["cast_up"] + 2e9 / bw["stream"] + 100 * H100.kernel_gap_s)


def test_regimes_follow_the_executor():
    kw = dict(framework="torch", precision="bf16", dp=1, tp=1, pp=1)
    assert eager_regime(zero=0, **kw) == "autocast"
    assert eager_regime(zero=3, **kw) == "bf16"
    assert eager_regime(zero=0, **{**kw, "dp": 2, "tp": 2}) == "bf16"          # replicate under TP
    assert eager_regime(zero=0, **{**kw, "framework": "megatron"}) == ""
    assert eager_regime(zero=0, **{**kw, "precision": "fp32"}) == "fp32"        # eager fp32 (the CPU runs)
    assert eager_regime(zero=2, **{**kw, "precision": "fp32"}) == "fp32-fsdp"


def test_step_param_bytes():
    # autocast: one bf16 copy per step; three more micro-batches add into the fp32 gradients
    assert step_param_bytes("autocast", zero=0, num_microbatches=4) == {"cast_down": CAST_DOWN_BYTES,
                                                                       "stream": 3 * 12.0}
    # FSDP under ZeRO-3 unshards twice per micro-batch: copy-in cast (6) and copy-out (4) each time
    assert step_param_bytes("bf16", zero=3, num_microbatches=1) == {"cast_down": 12.0, "stream": 8.0}
    # fp32: no casts; FSDP2 copies the fp32 shard into the all-gather buffer and out (8 + 8 B) per
    # unshard, twice per micro-batch under ZeRO-3; micro-batches after the first accumulate (12 B)
    assert step_param_bytes("fp32", zero=0, num_microbatches=2) == {"stream": 12.0}
    assert step_param_bytes("fp32-fsdp", zero=3, num_microbatches=2) == {"stream": 4 * 16.0 + 12.0}


def test_layer_eager_bytes_of_a_config_model():
    spec = load_model("llama3-8b")
    rows = dict(layer_eager_bytes(spec, "block"))["autocast"]
    t = TABLE["rmsnorm-swiglu-rope"]["autocast"]["block_fwd"]["cast_down"]
    fwd_h = dict((c, fh) for c, fh, *_ in rows.by_class)["cast_down"]
    assert fwd_h == pytest.approx(t[0] * 4096 + t[4])
    assert layer_eager_bytes(load_model("mixtral-8x7b"), "block") == ()      # no counted family
    fp32 = dict(layer_eager_bytes(spec, "block"))["fp32"]                   # the CPU runs' regime
    t32 = TABLE["rmsnorm-swiglu-rope"]["fp32"]["block_fwd"]["stream"]
    assert dict((c, fh) for c, fh, *_ in fp32.by_class)["stream"] == pytest.approx(t32[0] * 4096 + t32[4])


def test_memory_peak_is_the_larger_of_gradients_and_activations_without_accumulation():
    m = Memory(params=10, grads=4, optimizer=20, activations=7, other=1, grads_after_activations=True)
    assert m.total == 10 + 20 + 1 + 7
    assert Memory(params=10, grads=4, optimizer=20, activations=7, other=1).total == 42
    one = ParallelConfig(dp=1, tp=1, pp=1, cp=1, zero=0, micro_batch=1, num_microbatches=1, vpp=1, schedule="1f1b",
                         recompute="none", sequence_parallel=False, optimizer_offload=False)
    assert grads_follow_activations("torch", one)
    assert not grads_follow_activations("megatron", one)
    from dataclasses import replace
    assert not grads_follow_activations("torch", replace(one, num_microbatches=2))
    assert not grads_follow_activations("torch", replace(one, dp=2))          # DDP's buckets (ZeRO-0)
    assert grads_follow_activations("torch", replace(one, dp=2, zero=1))      # sharded AdamW, no buckets
    assert grads_follow_activations("torch", replace(one, dp=2, zero=3))      # FSDP allocates in backward
