"""OpenMP spin-waiting for a process where several threads run torch ops (the server).

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
"""

from __future__ import annotations

import os
import sys

DEFAULTS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}

_state = "not applied"


def apply() -> str:
    """Set the spin defaults if torch is not loaded yet and the user set neither. Returns what
    happened (logged at start-up)."""
    global _state
    if any(name in os.environ for name in DEFAULTS):
        _state = "left to the environment (" + ", ".join(
            f"{k}={os.environ[k]}" for k in DEFAULTS if k in os.environ) + ")"
    elif "torch" in sys.modules:
        _state = "not set: torch was loaded before polyserve (set OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=300000)"
    else:
        os.environ.update(DEFAULTS)
        _state = "OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=300000"
    return _state


def state() -> str:
    return _state
