"""How many intra-op threads the engine's next step runs on, from what the CPUs give it now.

A decode step is hundreds of small parallel ops, each ending in a barrier. With the host to itself
the engine's team (its thread and one libgomp worker per extra thread) runs them on every usable
CPU and spins between ops (server/infra/openmp.py). Once other processes want the same CPUs, the kernel
deschedules one member of the team for a time slice at a time; every barrier then waits for it,
and the members that wait spin away the CPU time the descheduled one needs (measured in
docs/history/openmp-threads.md: the same work cost 8x the CPU seconds beside two busy processes).
One thread has no barrier to wait at. So the governor switches the team between its full size and
one thread, step by step; with one, the engine splits each step's rows over as many lanes as the
team had (server/engines/native/model/lanes.py: threads of one torch thread each, no barrier inside the
step), which the scheduler gives one share of the CPUs each:

    full team  each window (WINDOW_S of steps), the seconds the process's threads spent runnable
               but not running (/proc/self/task/*/schedstat) over the window's wall time; above
               CONTENDED, another process holds CPUs the team needs: down to one thread
    one thread the system's runnable threads other than this one (/proc/loadavg's running count,
               averaged over the window); when they leave a CPU free for every extra thread, try
               the full team again. Low-priority (niced) work counts as runnable there but takes
               almost nothing, so the waits decide too:
               probe the team now and then (PROBE_S, doubling after each probe that finds the
               CPUs still taken, up to PROBE_MAX_S), but only after a window in which this
               process's threads waited at most CONTENDED: where the lanes (as many runnable
               threads as the team) or even one thread wait, a team would wait as much or more,
               and a probe step costs seconds there (each of its barriers waits for a
               descheduled member)
               deep: the one thread waits at least DEEP_ONE s a second (it holds less than half
               a CPU), or the lanes at least DEEP_LANES: there two lanes hold ~1.6x one thread's
               CPU, more than their extra CPU a token on every CPU measured, so the engine runs
               lanes where the CPU alone would not choose them (engine.py). With the weight
               kernel's panel helper beside the one thread (panel_helper.h), the engine thread's
               own waits decide, against DEEP_HELPER: the helper waits while it has no panels,
               which says nothing of the step's share

Weights of other processes show in the waits only (a nice-19 training run leaves the team's waits
near zero, so the team stays), which is why going down trusts them and going up checks them again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("polyserve")

WINDOW_S = 0.25  # a decision per window of steps: long enough to average a few time slices
CONTENDED = 0.2  # runnable-but-waiting seconds per wall second, summed over threads
# deep contention, where lanes pay even on CPUs whose lanes cost more a token (lanes.py): the one
# thread waits at least DEEP_ONE s a second (it holds under half a CPU); on lanes, their waits summed
# over both at least DEEP_LANES. Each line sits between what that mode was measured to wait beside a
# few busy processes and beside many (docs/history/openmp-threads.md), and a change needs DEEP_WINDOWS
# windows in a row that agree: single windows swing across the lines
DEEP_ONE = 0.5
DEEP_LANES = 1.1
DEEP_HELPER = 0.6
DEEP_WINDOWS = 2
PROBE_S = 2.0
PROBE_MAX_S = 60.0


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


def thread_wait_ns() -> int | None:
    """The calling thread's waits."""
    return waited_ns(Path("/proc/thread-self/schedstat"))


def runnable_threads(loadavg: Path = Path("/proc/loadavg")) -> int | None:
    """Threads runnable on the whole system right now, this one included (loadavg's "R/total")."""
    try:
        return int(loadavg.read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


class ThreadGovernor:
    """`threads()` before each step: the team size for it. max_threads: the engine's configured
    count (POLYSERVE_THREADS or the usable CPUs); usable: the CPUs the process may use
    (server/infra/cpus.py)."""

    def __init__(self, max_threads: int, usable: float, *, clock: Callable[[], float] = time.monotonic,
                 wait_ns: Callable[[], int | None] = process_wait_ns,
                 runnable: Callable[[], int | None] = runnable_threads,
                 own_wait_ns: Callable[[], int | None] = thread_wait_ns) -> None:
        """own_wait_ns: the waits of the thread that calls `threads()` (read there only)."""
        self.max_threads = max_threads
        self.usable = usable
        self._clock, self._wait_ns, self._runnable, self._own_wait_ns = clock, wait_ns, runnable, own_wait_ns
        self.current = max_threads
        self.switches = 0
        self.steps_at: dict[int, int] = {}  # steps run per team size (benchmarks report it)
        self.deep = False  # without the team: the CPUs are taken deeply enough for lanes (DEEP_ONE)
        self._deep_votes = 0  # windows in a row that disagreed with self.deep
        self.lanes_running = False  # set by the engine: the last window's steps ran on lanes
        self.helper_running = False  # set by the engine: the last window's linears had the panel helper
        self._own0: int | None = None  # the calling thread's waits at the window's start (None: not yet read)
        self._probe_s = PROBE_S
        self._start_window()
        self._probe_at = self._t0 + self._probe_s

    def _start_window(self, t0: float | None = None, w0: int | None = None) -> None:
        """t0, w0: the clock and the waits just read to close the last window (read here if not)."""
        self._t0 = self._clock() if t0 is None else t0
        self._w0 = self._wait_ns() if w0 is None else w0
        self._others: list[int] = []

    def _own_share(self, now: float) -> float | None:
        """The calling thread's waits over the window closing now (seconds a second), and the
        next window's start; None for a window it did not see start."""
        own, own0 = self._own_wait_ns(), self._own0
        self._own0 = own
        if own is None or own0 is None:
            return None
        return (own - own0) / 1e9 / (now - self._t0)

    def _set(self, n: int, why: str) -> None:
        log.log(logging.DEBUG if why == "probe" else logging.INFO, "engine threads %d -> %d (%s)", self.current, n, why)
        self.current = n
        self.switches += 1

    def threads(self) -> int:
        n = self._decide()
        self.steps_at[n] = self.steps_at.get(n, 0) + 1
        return n

    def _decide(self) -> int:
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
        own = self._own_share(now)
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
            elif self.helper_running and own is not None:
                self._vote_deep(own >= DEEP_HELPER, own)
            elif share is not None:
                self._vote_deep(share >= (DEEP_LANES if self.lanes_running else DEEP_ONE), share)
            if self.current > 1:
                self.deep, self._deep_votes = False, 0
        self._start_window(now, waited)
        return self.current

    def _vote_deep(self, deep: bool, waits: float) -> None:
        """One window's say on self.deep: a change needs DEEP_WINDOWS windows in a row."""
        self._deep_votes = self._deep_votes + 1 if deep != self.deep else 0
        if self._deep_votes >= DEEP_WINDOWS:
            log.debug("contention %s: threads waited %.2f s a second", "deep" if deep else "shallow", waits)
            self.deep, self._deep_votes = deep, 0
