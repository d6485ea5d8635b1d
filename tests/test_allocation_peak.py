"""The CPU's stand-in for max_memory_allocated (executor/measure.py AllocationPeak) and which steps
a run times (executor/train.py instrumented_step, steady_times)."""
from types import SimpleNamespace

import torch

from executor.measure import AllocationPeak, allocation_peak, gemm_achieved
from executor.train import instrumented_step, steady_times

CPU = torch.autograd.DeviceType.CPU


def _event(t: int, nbytes: int, name: str = "[memory]", device=CPU):
    return SimpleNamespace(name=lambda: name, nbytes=lambda: nbytes, start_ns=lambda: t, device_type=lambda: device)


def test_the_peak_is_the_largest_running_sum_in_time_order():
    # given out of order: +100 at t=1, +50 at t=2, -100 at t=3, +30 at t=4 -> running 100, 150, 50, 80
    events = [_event(3, -100), _event(1, 100), _event(4, 30), _event(2, 50),
              _event(0, 999, name="aten::mm"), _event(0, 999, device=torch.autograd.DeviceType.CUDA)]
    assert allocation_peak(events) == 150


def test_the_profiler_sees_what_a_step_allocates_at_once():
    a = torch.empty(1024 * 1024, dtype=torch.uint8)            # before: not counted
    with AllocationPeak().track() as peak:
        b = torch.empty(4 * 2**20, dtype=torch.uint8)
        c = torch.empty(2 * 2**20, dtype=torch.uint8)
        del b
        d = torch.empty(3 * 2**20, dtype=torch.uint8)          # 2 + 3 MiB live < 4 + 2
        del c, d
    assert peak.peak_bytes == 6 * 2**20
    del a


def test_the_instrumented_step_is_the_third_where_there_are_four():
    assert [instrumented_step(n) for n in (1, 2, 3, 4, 6)] == [0, 1, 1, 2, 2]


def test_steady_times_leave_out_the_first_two_and_the_instrumented_step():
    times = [9.0, 5.0, 7.0, 2.0, 3.0, 4.0]
    assert steady_times(times, 2) == [2.0, 3.0, 4.0]
    assert steady_times([9.0, 5.0, 2.0], 1) == [2.0]
    assert steady_times([9.0, 5.0], 1) == [9.0]
    assert steady_times([9.0], 0) == [9.0]


def _call(name: str, start: int, end: int, flops: int, thread: int = 1, device=CPU):
    return SimpleNamespace(name=lambda: name, start_ns=lambda: start, end_ns=lambda: end,
                           duration_ns=lambda: end - start, flops=lambda: flops,
                           start_thread_id=lambda: thread, device_type=lambda: device)


def test_achieved_gemm_counts_the_innermost_products_only():
    # a DTensor product: an outer aten::mm over 0-100 ns around the local one over 10-90 ns, which
    # alone counts (1000 FLOPs in 80 ns); an addmm beside it over 200-300 ns (500 FLOPs); on another
    # thread a bmm over 50-70 ns (300 FLOPs); other ops and other devices do not count
    events = [_call("aten::addmm", 200, 300, 500), _call("aten::mm", 0, 100, 1000), _call("aten::mm", 10, 90, 1000),
              _call("aten::bmm", 50, 70, 300, thread=2), _call("aten::add", 0, 1000, 7),
              _call("aten::mm", 400, 500, 9999, device=torch.autograd.DeviceType.CUDA)]
    got = gemm_achieved(events)
    assert got["flops"] == 1800 and got["seconds"] == 200e-9
    assert got["tflops"] == 1800 / 200e-9 / 1e12
    assert gemm_achieved([_call("aten::add", 0, 10, 0)]) is None


def test_the_profiler_counts_a_step_s_products():
    a, b, w = torch.randn(64, 32), torch.randn(32, 48), torch.randn(16, 48)
    with AllocationPeak().track() as peak:
        torch.nn.functional.linear(a @ b, w)             # 2*64*32*48 and 2*64*48*16 FLOPs
    assert peak.gemm["flops"] == 2 * 64 * 32 * 48 + 2 * 64 * 48 * 16 and peak.gemm["seconds"] > 0
