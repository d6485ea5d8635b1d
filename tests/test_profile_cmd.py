"""`meshplan profile --nproc 2` on this machine: a profile --cluster accepts, every number measured.

One profile run (a few seconds with --quick) is shared by the tests of this file.
"""
import json
import tomllib

import pytest

from conftest import run_cli
from planner.cli import main
from planner.cluster import load_cluster
from planner.cost.layer import Context, layer_cost
from planner.trace.load import load_traced_model
from planner.trace.measured import attach_measured_ops, op_signature

MODEL = "tests/trace_models.py:tiny_transformer"


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "here.toml"
    proc = run_cli("profile", "--nproc", "2", "--quick", "--out", str(out), "--ops", MODEL, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.distributed
def test_the_profile_loads_as_a_cluster(profile):
    cluster = load_cluster(str(profile), 2)
    assert cluster.gpus_per_node == 2 and cluster.max_nodes == 1 and cluster.device.dtypes == ("fp32",)
    assert cluster.device.peak("fp32") > 1e9 and cluster.intra.bytes_per_s > 1e6


@pytest.mark.distributed
def test_every_number_says_it_was_measured_and_by_which_command(profile):
    data = tomllib.loads(profile.read_text())
    command = "meshplan profile --nproc 2 --device cpu --threads 1"
    assert command in data["source"]
    for table in ("gpu", "intra_node", "host"):
        assert data[table]["source"].startswith("measured: `" + command), table
    assert data["runtime"]["reserved_source"].startswith("measured: `" + command)
    # the host's CPU vendor as the OS reports it (NCCL's LL cap across nodes reads it)
    from executor.profile.device import cpu_vendor
    assert load_cluster(str(profile), 2).cpu_vendor == cpu_vendor()
    # compute lost beside a running collective: a share of the device, measured
    assert data["runtime"]["comm_sms_source"].startswith("measured: `" + command)
    assert 0.0 <= data["runtime"]["comm_sms"] <= data["gpu"]["sm_count"]
    assert load_cluster(str(profile), 2).comm_sm_fraction == pytest.approx(
        data["runtime"]["comm_sms"] / data["gpu"]["sm_count"])
    assert data["gpu"]["kernels"]["attention_efficiency_source"].startswith("measured: `" + command)
    for key in ("gemm_tile", "gemm_efficiency", "hbm_efficiency"):
        source = data["gpu"]["kernels"][key + "_source"]
        assert source.startswith("derived: the ") and "measured" in source
    # a CPU's optimizer loop, eager kernel classes and per-op dispatch, measured and loaded
    kernels, device = data["gpu"]["kernels"], load_cluster(str(profile), 2).device
    for key in ("optimizer_GBps", "eager_GBps", "kernel_gap"):
        assert kernels[key + "_source"].startswith("measured: `" + command), key
    assert device.optimizer_bytes_per_s == pytest.approx(kernels["optimizer_GBps"] * 1e9)
    assert set(kernels["eager_GBps"]) == {"stream", "cast_up", "cast_down", "strided", "reduce", "softmax", "norm"}
    assert device.eager_bandwidth("softmax") == pytest.approx(kernels["eager_GBps"]["softmax"] * 1e9)
    assert device.kernel_gap_s == pytest.approx(kernels["kernel_gap_us"] * 1e-6) and device.kernel_gap_s > 0
    # the derived fields follow from the raw measurements written beside them
    measured = data["measured"]
    # a CPU: the median over the products of transformer linears, timed with both processes computing
    # at once, in one window rotating over them all
    shapes = {(r["m"], r["n"], r["k"], r["kind"]) for r in measured["gemm_concurrent"]}
    # the head over 8192 entries at 1024 tokens and hidden 512: forward, input and weight gradient
    assert {(1024, 8192, 512, "fwd"), (1024, 512, 8192, "dgrad"), (8192, 512, 1024, "wgrad")} <= shapes
    assert "slowest of 2 processes computing at once" in data["gpu"]["source"]
    rates = sorted(r["tflops"] for r in measured["gemm_concurrent"])
    median = rates[len(rates) // 2] if len(rates) % 2 else (rates[len(rates) // 2 - 1] + rates[len(rates) // 2]) / 2
    assert data["gpu"]["peak_tflops"]["fp32"] == pytest.approx(median, rel=1e-3)
    assert all(r["window_s"] >= 6.0 and r["rounds"] >= 2 for r in measured["gemm_concurrent"])
    # the GEMM efficiency by shape: each (m, n, k) at its time-weighted rate over that median
    table = {(m, n, k): eff for m, n, k, eff in kernels["gemm_shapes"]}
    assert kernels["gemm_shapes_source"].startswith("measured: `" + command)
    head = [r["tflops"] for r in measured["gemm_concurrent"] if (r["m"], r["n"], r["k"]) == (1024, 8192, 512)]
    assert len(head) == 1 and table[(1024, 8192, 512)] == pytest.approx(head[0] / median, rel=2e-3)
    square = [r["tflops"] for r in measured["gemm_concurrent"] if (r["m"], r["n"], r["k"]) == (1024, 512, 512)]
    assert len(square) == 2        # the forward and input gradient of the 512 x 512 linear
    assert table[(1024, 512, 512)] == pytest.approx(2 / (1 / square[0] + 1 / square[1]) / median, rel=2e-3)
    assert device.shape_efficiency(1024, 8192, 512) == pytest.approx(table[(1024, 8192, 512)])
    # the host time of a tensor-parallel block, measured with the executor's own blocks
    assert kernels["tp_block_overhead_source"].startswith("measured: `" + command)
    assert device.tp_block_overhead_s == pytest.approx(tuple(x * 1e-6 for x in kernels["tp_block_overhead_us"]))
    # per block, what the sharded blocks took beyond the unsharded, less the four all-reduces of the
    # activation as the cost model charges them at this profile's latency and bandwidth (none below zero):
    # the backward can come to zero where a slow machine's measured latency is charged in full
    tp = json.loads(profile.with_name("here.kernels.json").read_text())["collectives"]["tp_block"]
    assert tp["tp_fwd_bwd_s"] > tp["plain_fwd_bwd_s"] and tp["tp_fwd_s"] > tp["plain_fwd_s"]
    link, latency = data["intra_node"]["link_GBps"] * 1e9, data["intra_node"]["latency_us"] * 1e-6
    four = 2 * (2 * latency + tp["activation_bytes"] / link)      # two ring all-reduces over 2 ranks
    fwd = (tp["tp_fwd_s"] - tp["plain_fwd_s"]) / tp["layers"] - four
    bwd = ((tp["tp_fwd_bwd_s"] - tp["tp_fwd_s"]) - (tp["plain_fwd_bwd_s"] - tp["plain_fwd_s"])) / tp["layers"] - four
    assert kernels["tp_block_overhead_us"] == pytest.approx([max(0.0, fwd) * 1e6, max(0.0, bwd) * 1e6],
                                                           rel=2e-3, abs=2.0)
    # the optimizer and the eager kernels as both processes ran them at once (the raw figures beside)
    raw = json.loads(profile.with_name("here.kernels.json").read_text())["collectives"]["kernels_concurrent"]
    assert kernels["optimizer_GBps"] == pytest.approx(raw["device_adam"]["GBps"], rel=1e-3)
    assert kernels["optimizer_GBps_source"].endswith("in each of 2 processes at once, the slowest")
    assert kernels["eager_GBps_source"].endswith("in each of 2 processes at once, the slowest")
    softmax = sorted(r["GBps"] for r in raw["eager"] if r["kernel"].startswith("log_softmax_fp32"))
    assert kernels["eager_GBps"]["softmax"] == pytest.approx(sum(softmax) / 2, rel=1e-3)
    # attention over the GEMM rate of the one process that timed it, not over the concurrent peak
    alone = sorted(r["tflops"] for r in measured["gemm"])
    half = len(alone) // 2
    alone_median = alone[half] if len(alone) % 2 else (alone[half - 1] + alone[half]) / 2
    attention = next(r for r in measured["attention"] if r["dtype"] == "fp32")
    assert data["gpu"]["kernels"]["attention_efficiency"] == pytest.approx(
        min(1.0, attention["tflops"] / alone_median), rel=1e-3)
    largest = max(measured["collectives"], key=lambda r: r["bytes"])
    assert data["intra_node"]["link_GBps"] == pytest.approx(largest["all_reduce_busbw_GBps"], rel=1e-3)
    smallest = min(measured["collectives"], key=lambda r: r["bytes"])
    assert data["intra_node"]["latency_us"] == pytest.approx(smallest["all_reduce_s"] / 2 * 1e6, rel=1e-3)
    # all-gather and reduce-scatter at their own bus bandwidth: (n-1)/n of the buffer over their time
    for name in ("all_gather", "reduce_scatter"):
        busbw = largest["bytes"] / 2 / largest[name + "_s"] / 1e9
        assert data["intra_node"][name + "_busbw_ratio"] == pytest.approx(
            busbw / largest["all_reduce_busbw_GBps"], rel=1e-3)
        assert data["intra_node"][name + "_busbw_ratio_source"].startswith("measured: `" + command)
    cluster = load_cluster(str(profile), 2)
    assert cluster.intra_reduce_scatter_ratio == pytest.approx(data["intra_node"]["reduce_scatter_busbw_ratio"])
    # ranks waiting for the slowest at a blocking collective: a measured fraction
    assert data["runtime"]["sync_wait_coefficient_source"].startswith("measured: `" + command)
    assert cluster.sync_wait_coefficient == pytest.approx(data["runtime"]["sync_wait_coefficient"])
    assert cluster.sync_wait_coefficient >= 0


@pytest.mark.distributed
def test_planning_against_the_profile_uses_the_measured_ops(profile, capsys):
    rc = main(["plan", "--model", MODEL, "--cluster", str(profile), "--gpus", "2", "--global-batch", "8", "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    graph = load_traced_model(MODEL)
    total = sum(len(layer.ops) for layer in graph.layers)
    assert f"here.ops.json: measured times for {total} of {total} ops" in captured.err
    estimate = json.loads(captured.out)["estimate"]
    assert estimate["step_time_s"] > 0 and estimate["fits"]


def test_the_cost_model_prefers_measured_times(tmp_path):
    """Hand-written measured times: each layer's forward is then exactly its ops' times x tokens."""
    graph = load_traced_model(MODEL)
    profile = tmp_path / "p.toml"
    ops = {op_signature(op): {"fwd_s_per_token": 1e-6, "bwd_s_per_token": 3e-6}
           for layer in graph.layers for op in layer.ops}
    (tmp_path / "p.ops.json").write_text(json.dumps({"schema": 1, "dtype": "float32", "seq_len": 32, "ops": ops}))
    measured = attach_measured_ops(graph, profile, "fp32", 32)
    ctx = Context(micro_batch=4, seq_len=32, tp=1, cp=1, sequence_parallel=False, precision="fp32",
                  attention="flash", framework="torch", tp_comm_overlap=False)
    cluster = load_cluster("cpu-gloo", 1)
    for layer in measured.layers:
        cost = layer_cost(layer, ctx, cluster)
        assert cost.fwd_s == pytest.approx(len(layer.ops) * 1e-6 * 128)
        assert cost.bwd_s == pytest.approx(len(layer.ops) * 3e-6 * 128)
    mismatched = attach_measured_ops(graph, profile, "bf16", 32)
    assert all(op.measured_fwd_s is None for layer in mismatched.layers for op in layer.ops)
    assert "not bfloat16 at 32" in mismatched.warnings[-1]


@pytest.mark.distributed
def test_the_collectives_measured_over_gloo(profile):
    """executor/profile/collectives.py's rows as the profile keeps them."""
    rows = tomllib.loads(profile.read_text())["measured"]["collectives"]
    assert len(rows) >= 3
    for row in rows:
        assert row["all_reduce_s"] > 0 and row["send_recv_s"] > 0 and row["all_gather_s"] > 0
        # nccl-tests' bus bandwidth of a 2-rank all-reduce: 2 (n-1)/n = 1 buffer per rank
        assert row["all_reduce_busbw_GBps"] == pytest.approx(row["bytes"] / row["all_reduce_s"] / 1e9, rel=1e-3)


def test_a_collective_time_is_the_mean_sample_on_a_cpu_and_the_best_on_a_gpu(monkeypatch):
    """executor/profile/collectives.py collective_time on a scripted clock: samples of 1, 3 and 2 ms
    (after a warm-up call) average 2 ms on a CPU; a GPU keeps the best, 1 ms."""
    import types

    import torch

    from executor.profile import collectives

    class OneRank:      # the slowest rank's time of a one-rank group: its own
        def barrier(self):
            pass

        def all_reduce(self, t, op=None):
            pass

        class ReduceOp:
            MAX = None

    fake_torch = types.SimpleNamespace(tensor=lambda v, dtype=None, device=None: torch.tensor(v, dtype=dtype),
                                       float64=torch.float64, cuda=types.SimpleNamespace(synchronize=lambda: None))
    for kind, expected in (("cpu", 2e-3), ("cuda", 1e-3)):
        clock = iter([0.0, 1e-3, 10.0, 10.003, 20.0, 20.002])      # (start, end) of each sample
        monkeypatch.setattr(collectives, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
        got = collectives.collective_time(lambda: None, OneRank(), fake_torch, types.SimpleNamespace(type=kind), 3)
        assert got == pytest.approx(expected)


def test_the_tp_block_overhead_is_the_sharded_blocks_time_beyond_the_unsharded_and_their_all_reduces():
    """executor/profile/toml.py tp_block_lines on hand-written timings: 4 blocks, 2 ranks, a
    65536-byte activation; link 1 GB/s, latency 100 us: an all-reduce is charged 2 x 100 us + 65536 B /
    1 GB/s = 265.536 us. Forward (30 - 6) ms / 4 - 2 x 0.265536 = 5.468928 ms; backward ((90 - 30) -
    (16 - 6)) ms / 4 - 2 x 0.265536 = 11.968928 ms."""
    from executor.profile.toml import tp_block_lines
    b = {"hidden": 64, "heads": 2, "ffn": 192, "layers": 4, "batch": 4, "seq": 64, "samples": 10,
         "activation_bytes": 65536, "plain_fwd_s": 0.006, "plain_fwd_bwd_s": 0.016, "tp_fwd_s": 0.030,
         "tp_fwd_bwd_s": 0.090}
    lines = tp_block_lines(b, 2, 1.0, 100.0, "measured: `x`")
    fwd, bwd = tomllib.loads("\n".join(lines))["tp_block_overhead_us"]
    assert fwd == pytest.approx(5468.928, rel=1e-3) and bwd == pytest.approx(11968.928, rel=1e-3)
    # sharding that costs less than its all-reduces: nothing below zero
    fast = {**b, "tp_fwd_s": 0.006, "tp_fwd_bwd_s": 0.016}
    assert tomllib.loads("\n".join(tp_block_lines(fast, 2, 1.0, 100.0, "measured: `x`")))["tp_block_overhead_us"] == [0, 0]


def test_the_strided_reduction_rate_comes_from_the_compiled_column_wise_cast():
    from executor.profile.toml import strided_reduce_lines
    # 8192 x 4096 bf16 (33,554,432 elements) cast column-wise in 200 us, writes at 4 TB/s: the write takes 8.39 us,
    # the amax's 2 bytes an element the other 191.61 us: 67,108,864 B / 191.61 us = 350.23 GB/s
    row = {"kernel": "cast_colwise_compiled", "tokens": 8192, "hidden": 4096, "bytes": 3 * 8192 * 4096,
           "seconds": 200e-6}
    lines = strided_reduce_lines([{"kernel": "cast_rowwise_compiled", "seconds": 1e-5}, row], {"cast_down": 4e12},
                                 "measured")
    parsed = tomllib.loads("\n".join(lines))
    assert parsed["strided_reduce_GBps"] == pytest.approx(350.23, rel=1e-4)
    assert "cast_colwise_compiled" in parsed["strided_reduce_source"]
    # not run (a CPU profile), or failed to compile: no rate; a kernel faster than its write alone: no rate
    assert strided_reduce_lines([], {"cast_down": 4e12}, "measured") == []
    assert strided_reduce_lines([{"kernel": "cast_colwise_compiled", "error": "no triton"}], {"cast_down": 4e12},
                                "measured") == []
    assert strided_reduce_lines([{**row, "seconds": 5e-6}], {"cast_down": 4e12}, "measured") == []
