"""The kernel measurements behind `meshplan profile` (executor/profile/kernels.py), on the CPU:
every path runs and reports what the cost model reads; the GPU figures are in
profiles/measured/*.kernels.json."""
import json
import subprocess
import sys

import pytest

from executor.profile import kernels as pk


class _FakeClock:
    """A clock that only moves when the timed function runs: exactly 1 ms per call."""
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_time_per_call_times_back_to_back_calls(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(pk, "time", clock)
    calls = []

    def fn():
        calls.append(clock.now)
        clock.now += 1e-3
    t = pk.time_per_call(fn, "cpu", repeat=2, min_s=5e-3)
    assert t == pytest.approx(1e-3)
    # one warm-up, one calibration call, then 2 timings of 5 calls each (5 ms / 1 ms)
    assert len(calls) == 2 + 2 * 5


def test_time_per_call_keeps_the_fastest_of_its_timings(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(pk, "time", clock)
    costs = iter([1e-3, 1e-3] + [3e-3] * 5 + [2e-3] * 5)

    def fn():
        clock.now += next(costs)
    assert pk.time_per_call(fn, "cpu", repeat=2, min_s=5e-3) == pytest.approx(2e-3)



def test_eager_kernels_on_a_cpu_take_the_median_over_passes(monkeypatch):
    """Each kernel is timed once per pass over all of them, and its figure is the median of its
    passes: a kernel that ran slow in two of five passes keeps its typical time."""
    seen: dict[int, int] = {}
    slow_passes = {1, 3}

    def fake_time_per_call(fn, device, repeat, min_s=2e-3, graph=False):
        n = seen[id(fn)] = seen.get(id(fn), 0) + 1
        return 4e-3 if n - 1 in slow_passes else 1e-3
    monkeypatch.setattr(pk, "time_per_call", fake_time_per_call)
    monkeypatch.setattr(pk, "CPU_EAGER_PASSES", 5)
    rows = pk.eager_kernels("cpu", tokens=128, hidden=128, vocab=64)
    cast = next(r for r in rows if r["kernel"] == "cast_up")
    assert cast["seconds"] == 1e-3 and cast["GBps"] == pytest.approx(128 * 128 * 6 / 1e-3 / 1e9)
    assert all(r["seconds"] == 1e-3 for r in rows if "_bwd" not in r["kernel"])

def test_gemm_sweep_times_the_three_gemms_of_a_linear():
    rows = pk.gemm_sweep("cpu", "fp32", [16], [(8, 24)], repeat=1)
    assert [r["kind"] for r in rows] == ["fwd", "dgrad", "wgrad"]
    for r in rows:
        assert (r["m"], r["k"], r["n"]) == (16, 8, 24)
        assert r["tflops"] == pytest.approx(2 * 16 * 24 * 8 / r["seconds"] / 1e12)


def test_attention_backends_record_a_refusal_instead_of_skipping_it():
    rows = pk.attention_backends("cpu", "fp32", [(1, 4, 2, 32, 8)], repeat=1)
    by = {r["backend"]: r for r in rows}
    assert set(by) == {"default", "cudnn", "flash", "efficient", "math"}
    assert by["math"]["fwd_bwd_s"] > 0 and "error" not in by["math"]
    assert "error" in by["cudnn"]            # a CUDA-only kernel on the CPU: said, not dropped
    # causal FLOPs as the cost model counts them: half of 4 b h s^2 d
    assert by["math"]["flops_fwd"] == 4 * 1 * 4 * 32 * 32 * 8 / 2


def test_dispatch_overhead_and_adam_variants():
    d = pk.dispatch_overhead("cpu", ops=10, repeat=1)
    assert 0 < d["op_s"] < 1e-3 and 0 < d["autograd_op_s"] < 1e-2
    rows = pk.adam_variants("cpu", tensors=3, params_per_tensor=64, repeat=1)
    assert [r["foreach"] for r in rows] == [False, True]
    assert all(r["params"] == 192 and r["extra_peak_bytes"] is None for r in rows)


def test_gpu_validate_measures_on_the_cpu_with_quick(tmp_path):
    """The measuring half of benchmarks/gpu_validate.py runs the executor in-process (gloo, world
    size 1) and records what it measured; peak memory needs CUDA, so the CPU rows have none."""
    raw = tmp_path / "runs.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_validate.py", "--measure", "--quick", "--steps", "2",
                           "--warmup", "1", "--raw", str(raw)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(raw.read_text())
    assert out["environment"]["device"] == "cpu"
    assert {r["name"] for r in out["rows"]} == {"tiny-gpt mb2 s64", "tiny-llama mb1x2 s64 full", "tiny-oss mb2 s64 sel"}
    for r in out["rows"]:
        assert "error" not in r, r.get("error")
        assert len(r["step_times_s"]) == 2 and r["measured_step_s"] > 0
        assert r["categories_bytes"]["params"] > 0 and "measured_peak_bytes" not in r
    assert set(out["capabilities"]) >= {"sdpa_flash", "torch_context_parallel_1rank"}


def test_host_issue_counts_launches_and_when_the_last_one_ended():
    """benchmarks/gpu_validate.py's host side of a profiled step: the CUDA runtime's launch calls and the span
    from the step's first event to the end of its last launch (torch.profiler times in microseconds)."""
    sys.path.insert(0, "benchmarks")
    from gpu_validate import host_issue

    class Event:
        def __init__(self, name, start, end):
            self.name, self.time_range = name, type("Range", (), {"start": start, "end": end})()
    events = [Event("aten::mm", 100, 400), Event("cudaLaunchKernel", 150, 160), Event("cudaMemcpyAsync", 300, 320),
              Event("aten::item", 500, 900), Event("cuLaunchKernel", 350, 355)]
    assert host_issue(events) == {"launches": 3, "last_launch_s": pytest.approx(255e-6)}     # 355 - 100 us
    assert host_issue([Event("aten::add", 0, 5)]) == {"launches": 0, "last_launch_s": 0.0}


def test_fp8_casts_time_the_column_wise_scaling_of_a_transposed_operand():
    """Row-wise scaling of a (tokens, features) operand's transpose: one scale per feature, its largest value
    on 448 (e4m3's largest), written feature-major; each value back within e4m3's rounding (3 mantissa bits)."""
    import torch
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    q, scale = pk._to_fp8_colwise(x)
    assert q.shape == (8, 16) and q.is_contiguous() and scale.shape == (1, 8)
    back = q.float().t() / scale
    assert torch.allclose(back, x.float(), rtol=2 ** -4, atol=1e-3)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((8,), 448.0))
    rows = {r["kernel"]: r for r in pk.fp8_casts("cpu", tokens=64, hidden=32, repeat=1)}
    for name in ("amax_colwise", "cast_colwise"):
        assert "error" not in rows[name] and rows[name]["seconds"] > 0, rows[name]
