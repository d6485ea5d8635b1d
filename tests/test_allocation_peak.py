"""The CPU's stand-in for max_memory_allocated (executor/measure.py AllocationPeak) and which steps
a run times (executor/train.py instrumented_step, steady_times)."""
from types import SimpleNamespace

import torch

from executor.measure import AllocationPeak, allocation_peak
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
