"""How the engine's next step runs on the CPUs: the one object the engine asks, once a step.

    Mode(threads, helper)   a step's OpenMP team size, and whether the weight kernel's panel
                            helper shares the linears of a step run on one thread
    Execution.mode()        the next step's Mode; the runner takes it whole (runner.set_mode)
    ThreadGovernor          the team size, from what the CPUs give the process now

A decode step is hundreds of small parallel ops, each ending in a barrier. With the host to itself
the engine's team (its thread and one libgomp worker per extra thread) runs them on every usable
CPU and spins between ops (server/infra/openmp.py). Once other processes want the same CPUs, the
kernel deschedules one member of the team for a time slice at a time; every barrier then waits for
it, and the members that wait spin away the CPU time the descheduled one needs (the same work cost
8x the CPU seconds beside two busy processes: docs/history/openmp-threads.md). One thread has no
barrier to wait at. So the governor switches the team between its full size and one thread, step
by step:

    full team  each window (WINDOW_S of steps), the seconds the process's threads spent runnable
               but not running (/proc/self/task/*/schedstat) over the window's wall time; above
               CONTENDED, another process holds CPUs the team needs: down to one thread
    one thread the system's runnable threads other than this one (/proc/loadavg's running count,
               averaged over the window); when they leave a CPU free for every extra thread, try
               the full team again. Low-priority (niced) work counts as runnable there but takes
               almost nothing, so the waits decide too: probe the team now and then (PROBE_S,
               doubling after each probe that finds the CPUs still taken, up to PROBE_MAX_S), but
               only after a window in which this process's threads waited at most CONTENDED:
               where even one thread waits, a team would wait as much or more, and a probe step
               costs seconds there (each of its barriers waits for a descheduled member)

Weights of other processes show in the waits only (a nice-19 training run leaves the team's waits
near zero, so the team stays), which is why going down trusts them and going up checks them again.

A step on one thread runs its linears with the weight kernel's panel helper where the runner has
one (kernels/panel_helper.h): a second runnable thread that takes panels of the same GEMMs, with
no barrier and no weight read twice. Beside 2 busy processes it made 1.19-1.39x the tokens of the
step's rows split over single-thread lanes, the other mode this replaced (BENCHMARKS.md, "Beside
busy processes and under a CPU quota"; docs/history/contention.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.engines.native.tuning import Tuning, switch

log = logging.getLogger("polyserve")

WINDOW_S = 0.25  # a decision per window of steps: long enough to average a few time slices
CONTENDED = 0.2  # runnable-but-waiting seconds per wall second, summed over threads
PROBE_S = 2.0
PROBE_MAX_S = 60.0


@dataclass(frozen=True)
class Mode:
    """threads: the step's OpenMP team (the engine thread's torch threads); helper: the linears of
    a one-thread step share their panels with the weight kernel's helper thread."""

    threads: int
    helper: bool = False


def waited_ns(schedstat: Path) -> int | None:
    """Nanoseconds a thread has spent runnable, waiting for a CPU (its schedstat's second field);
    None where it has ended or the kernel keeps no schedstat."""
    try:
        return int(schedstat.read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def process_wait_ns(task_dir: Path = Path("/proc/self/task")) -> int | None:
    """This process's threads' waits, summed (threads that just ended skipped); None where the
    kernel keeps no schedstat."""
    waits = [w for task in task_dir.iterdir() if (w := waited_ns(task / "schedstat")) is not None]
    return sum(waits) if waits else None


def runnable_threads(loadavg: Path = Path("/proc/loadavg")) -> int | None:
    """Threads runnable on the whole system right now, this one included (loadavg's "R/total")."""
    try:
        return int(loadavg.read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


class ThreadGovernor:
    """`threads()` before each step: the team size for it. max_threads: the engine's configured
    count (POLYSERVE_THREADS or the usable CPUs); usable: the CPUs the process may use
    (server/infra/cpus.py: a CPU quota counts)."""

    def __init__(self, max_threads: int, usable: float, *, clock: Callable[[], float] = time.monotonic,
                 wait_ns: Callable[[], int | None] = process_wait_ns,
                 runnable: Callable[[], int | None] = runnable_threads) -> None:
        self.max_threads = max_threads
        self.usable = usable
        self._clock, self._wait_ns, self._runnable = clock, wait_ns, runnable
        self.current = max_threads
        self.switches = 0
        self._probe_s = PROBE_S
        self._start_window()
        self._probe_at = self._t0 + self._probe_s

    def _start_window(self, t0: float | None = None, w0: int | None = None) -> None:
        """t0, w0: the clock and the waits just read to close the last window (read here if not)."""
        self._t0 = self._clock() if t0 is None else t0
        self._w0 = self._wait_ns() if w0 is None else w0
        self._others: list[int] = []

    def _set(self, n: int, why: str) -> None:
        log.log(logging.DEBUG if why == "probe" else logging.INFO, "engine threads %d -> %d (%s)", self.current, n, why)
        self.current = n
        self.switches += 1

    def threads(self) -> int:
        if self.max_threads <= 1:
            return 1
        now = self._clock()
        if self.current == 1:
            running = self._runnable()
            if running is not None:
                self._others.append(max(0, running - 1))
        if now - self._t0 < WINDOW_S:
            return self.current
        waited = self._wait_ns()
        share = (waited - self._w0) / 1e9 / (now - self._t0) if waited is not None and self._w0 is not None else None
        if self.current > 1:
            if share is not None:
                if share > CONTENDED:
                    self._set(1, f"threads waited {share:.2f} s a second for CPUs others hold")
                    self._probe_at = now + self._probe_s
                else:
                    self._probe_s = PROBE_S  # a window without contention: probe soon after the next
        else:
            others = sum(self._others) / len(self._others) if self._others else None
            free = self.usable - others if others is not None else 0.0
            if free >= self.max_threads - 0.25:
                self._set(self.max_threads, f"{others:.2f} other runnable threads on {self.usable:g} CPUs")
            elif now >= self._probe_at and (share is None or share <= CONTENDED):
                self._set(self.max_threads, "probe")
                self._probe_s = min(PROBE_MAX_S, self._probe_s * 2)
                self._probe_at = now + self._probe_s
        self._start_window(now, waited)
        return self.current


class Execution:
    """Each step's Mode, applied to the runner. threads: the engine's configured team; governor:
    None runs every step on the whole team (tuning.adaptive_threads off); helper: one-thread steps
    run with the panel helper; apply: the runner's set_mode (returns the Mode it runs: without the
    helper where its thread would not start). `steps` counts the steps run in each mode
    (benchmarks report it)."""

    def __init__(self, threads: int, governor: ThreadGovernor | None, helper: bool,
                 apply: Callable[[Mode], Mode]) -> None:
        self.threads, self.governor, self.helper, self._apply = threads, governor, helper, apply
        self.current: Mode | None = None  # what the runner runs (None: not yet set)
        self.steps = {"team": 0, "one": 0, "helper": 0}

    @classmethod
    def build(cls, threads: int, usable: float, tuning: Tuning, helper_possible: bool,
              apply: Callable[[Mode], Mode]) -> Execution:
        """From the tuning switches (adaptive_threads, contended_helper) and whether the runner's
        linears have the panel helper (the weight kernel on a CPU)."""
        governor = ThreadGovernor(threads, usable) if tuning.adaptive_threads and threads > 1 else None
        setting = switch(tuning.contended_helper)
        if setting and not helper_possible:
            log.warning("POLYSERVE_CONTENDED_HELPER=on, but the runner's linears have no panel helper "
                        "(it needs the weight kernel on a CPU)")
        helper = governor is not None and setting is not False and helper_possible
        if governor is not None:
            log.info("while other processes hold the CPUs, a step runs on one thread%s",
                     " with the panel helper" if helper else "")
        return cls(threads, governor, helper, apply)

    def step(self) -> Mode:
        """The next step's Mode, set on the runner where it changed (call on the engine thread,
        before the step)."""
        n = self.governor.threads() if self.governor is not None else self.threads
        want = Mode(n, helper=n == 1 and self.helper)
        if want != self.current:
            self.current = self._apply(want)
            if want.helper and not self.current.helper:
                log.warning("the panel helper did not start; one-thread steps run without it")
                self.helper = False
        mode = self.current
        self.steps["helper" if mode.helper else "one" if mode.threads == 1 else "team"] += 1
        return mode

    def close(self) -> None:
        """Back to the whole team, the helper's thread joined (the engine thread is ending)."""
        if self.current is not None and self.current.helper:
            self.current = self._apply(Mode(self.threads))
