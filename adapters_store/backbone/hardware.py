"""What this machine's CPU can do for bf16, asked by serving (engines/dtype.py) and training
(training/precision.py) alike. Facts only; each side decides what to do with them."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def cpu_has_amx() -> bool:
    """The CPU has AMX tiles (and the OS lets torch use them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def cpu_has_avx512() -> bool:
    """The CPU has AVX-512 (its foundation, avx512f)."""
    return _cpu_flag("avx512f")


def cpu_has_avx512_bf16() -> bool:
    return _cpu_flag("avx512_bf16")


def _cpu_flag(name: str) -> bool:
    """`name` is one of the CPU's flags in /proc/cpuinfo (False where there is none)."""
    try:
        return any(line.startswith("flags") and name in line.split(":", 1)[-1].split()
                   for line in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return False


def cpu_time_ratio(slow: Callable[[], Any], fast: Callable[[], Any], rounds: int) -> float:
    """slow's time / fast's: interleaved rounds, medians, each round timed by the CPU clock of the
    thread that runs it, on one torch thread, in a thread of its own (the caller's OpenMP team is
    left as it was).

    CPU time, not wall time, so that busy neighbours do not decide: a wall clock counts the time
    slices other processes take in the middle of a round, and beside busy processes a probe of a
    CPU that runs bf16 twice as fast read parity (docs/history/dtype.md). One thread: a team's round
    would count its members' barrier waits for a descheduled partner, which a CPU clock cannot
    leave out."""
    times: dict[bool, list[float]] = {False: [], True: []}
    failed: list[BaseException] = []

    def run() -> None:
        before = torch.get_num_threads()  # also this thread's lazy start (server/infra/openmp.py)
        torch.set_num_threads(1)
        try:
            slow(), fast()  # untimed: first calls pack, plan and fill caches
            for _ in range(rounds):
                for is_fast, fn in ((False, slow), (True, fast)):
                    started = time.thread_time()
                    fn()
                    times[is_fast].append(time.thread_time() - started)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            failed.append(err)
        finally:
            torch.set_num_threads(before)  # the process-wide default set_num_threads also moved

    thread = threading.Thread(target=run, name="polyserve-cpu-probe")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return statistics.median(times[False]) / max(statistics.median(times[True]), 1e-9)
