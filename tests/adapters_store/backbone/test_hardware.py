"""The CPU probes' clock (adapters_store/backbone/hardware.py): CPU time on one thread of its own."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from adapters_store.backbone.hardware import cpu_time_ratio


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_ratio_counts_cpu_time_not_wall_time():
    # "slow" sleeps 20 ms on 1 ms of CPU, "fast" spins 5 ms: by the wall clock slow is ~4x slower,
    # by the CPU clock it is the cheaper one, as a round that lost time slices to another
    # process must not look slow
    def slow() -> None:
        _spin(0.001)
        time.sleep(0.02)

    ratio = cpu_time_ratio(slow, lambda: _spin(0.005), rounds=3)
    assert ratio < 0.5


def test_the_rounds_run_on_one_torch_thread_and_leave_the_counts_as_they_were():
    seen: list[tuple[int, str]] = []

    def record() -> None:
        seen.append((torch.get_num_threads(), threading.current_thread().name))

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cpu_time_ratio(record, record, rounds=2)
        assert torch.get_num_threads() == 2  # the caller's own count
        fresh: list[int] = []
        thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert fresh == [2]  # and the process-wide default other threads start from
    finally:
        torch.set_num_threads(before)
    # one untimed call of each first, then two timed rounds of both, all on another thread
    assert len(seen) == 6
    assert {n for n, _ in seen} == {1}
    assert threading.current_thread().name not in {name for _, name in seen}


def test_a_failing_probe_raises_in_the_caller():
    def boom() -> None:
        raise RuntimeError("no kernel")

    with pytest.raises(RuntimeError, match="no kernel"):
        cpu_time_ratio(boom, lambda: None, rounds=1)
