"""OpenMP in a process where several threads run torch ops (the server): one pool, and its spin.

PyTorch's CPU wheels use GNU OpenMP (libgomp). libgomp gives every thread that starts a parallel
region its own pool of workers, and once the process holds more pool threads than CPUs (the
engine thread's pool plus the pool of the thread that loaded the model, say) every worker spins
only 100 iterations before it sleeps on a futex (libgomp's "throttled" spin count): every parallel
op after that pays a wake-up. Measured here (2 cores, 2 threads, `bench/openmp_spin.py`): a
129k-element `mul` took 4x longer once a second thread had run one parallel op, and a training
step of a registration on the server's model took ~1.3x longer after the engine's warm-up.

    OMP_WAIT_POLICY=ACTIVE   raises the throttled spin to 1,000 iterations (enough: no slowdown)
    GOMP_SPINCOUNT=300000    keeps the normal spin at libgomp's default (ACTIVE alone spins forever:
                             a core busy while the server is idle)

libgomp reads them once, when torch loads, so `apply()` runs on `import server` and does nothing
where torch is already loaded or either variable is set (a user's own setting wins).

Under a CPU quota below the CPUs the threads may run on (a container's `cpu.max`: server/infra/cpus.py)
the spin is the wrong choice: the kernel parks every thread of the process once the period's quota
is spent, and a thread spinning in a barrier spends the quota its partner needs to reach it. There
`apply()` sets OMP_WAIT_POLICY=PASSIVE instead (each waiting thread sleeps at once). The engine's
threads are then ceil(quota) (1 under a 1-CPU quota: no team, no barrier).

Spinning is also wrong while other processes hold the CPUs without a quota (busy neighbours);
that changes during a process's life, so it is handled per step, by the team's size
(server/engines/native/core/execution.py), not here.

The spin setting is not enough for the native engine, whose steps are hundreds of small ops:
measured on this project's 2-core AMX machine (bench/openmp_spin.py, "engine loop"), a linear +
silu pair took 45 us on the only pool's thread and 103-131 us once another thread's pool existed
(1,000 spins are shorter than the gaps between its ops). So the server keeps ONE pool, the
engine thread's:

    in_fresh_thread(fn)   start-up (loading, packing weights) runs in a thread that then exits:
                          libgomp frees a thread's pool when the thread ends (49 us after, 45 alone)
    one_thread()          every other thread that may run torch ops (HTTP workers resolving
                          adapters, the job builder, replica sync) runs them on one OpenMP and
                          one MKL thread, so it never starts a pool (62-66 us with such a thread
                          busy beside the engine, 96-118 us without)
    use_threads(n)        the engine thread (and start-up) set their own count, forcing torch's
                          lazy per-thread initialisation first (see its docstring)
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from server.infra import cpus
from server.infra.cpus import CpuBudget

T = TypeVar("T")

DEFAULTS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}
UNDER_QUOTA = {"OMP_WAIT_POLICY": "PASSIVE"}

_state = "not applied"


def wait_policy(budget: CpuBudget) -> tuple[dict[str, str], str]:
    """The libgomp settings for what this process may use, and why."""
    if budget.limited:
        return UNDER_QUOTA, f"CPU quota {budget.quota:g} below the CPUs: waiting threads sleep"
    return DEFAULTS, "spin between ops"


def apply() -> str:
    """Set the wait policy (wait_policy) if torch is not loaded yet and the user set neither.
    Returns what happened (logged at start-up)."""
    global _state
    if any(name in os.environ for name in DEFAULTS):
        _state = "left to the environment (" + ", ".join(
            f"{k}={os.environ[k]}" for k in DEFAULTS if k in os.environ) + ")"
    elif "torch" in sys.modules:
        _state = "not set: torch was loaded before polyserve (set OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=300000)"
    else:
        env, why = wait_policy(cpus.budget())
        os.environ.update(env)
        _state = " ".join(f"{k}={v}" for k, v in env.items()) + f" ({why})"
    return _state


def state() -> str:
    return _state


def use_threads(n: int) -> None:
    """This thread runs torch ops on n OpenMP / MKL threads, from now on.

    torch.set_num_threads sets the calling thread's count and a process-wide default, but a thread
    takes its count from that default lazily, at its first parallel op, and set_num_threads does
    not count as that first op: a thread that set 2 and ran nothing yet took 1 from the next
    thread that set 1 (measured: its 2000x2000 matmul 85 ms instead of 46). So the thread's lazy
    initialisation is forced first (get_num_threads), then its own count is set."""
    import torch

    torch.get_num_threads()
    torch.set_num_threads(n)


def one_thread() -> None:
    """Run this thread's torch ops on one OpenMP / MKL thread (no OpenMP pool of its own). The
    process-wide default becomes 1 as well: threads that never choose run on one."""
    use_threads(1)


def in_fresh_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) in a new thread that ends when it returns (its OpenMP pool with it);
    returns its result or raises its exception."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            out["error"] = err

    thread = threading.Thread(target=run, name="polyserve-start")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
