"""A circuit breaker for the Redis tier: after a few consecutive failures, skip Redis for a
cool-down instead of paying a timeout on every request; then let one trial call through.

    closed --(failures >= threshold)--> open --(cooldown elapsed)--> half_open
    half_open --success--> closed          half_open --failure--> open
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(self, threshold: int = 3, cooldown: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold, self.cooldown, self.clock = threshold, cooldown, clock
        self.state: BreakerState = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self._trial_out = False
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """May a call go to Redis now? (In half_open, only one trial at a time.)"""
        with self._lock:
            if self.state == "open" and self.clock() - self.opened_at >= self.cooldown:
                self.state, self._trial_out = "half_open", False
            if self.state == "closed":
                return True
            if self.state == "half_open" and not self._trial_out:
                self._trial_out = True
                return True
            return False

    def record_success(self) -> bool:
        """Returns whether the state changed."""
        with self._lock:
            changed = self.state != "closed"
            self.state, self.failures, self._trial_out = "closed", 0, False
            return changed

    def record_failure(self) -> bool:
        """Returns whether the state changed (i.e. the breaker opened)."""
        with self._lock:
            self.failures += 1
            self._trial_out = False
            if self.state == "half_open" or (self.state == "closed" and self.failures >= self.threshold):
                self.state, self.opened_at = "open", self.clock()
                return True
            if self.state == "open":
                self.opened_at = self.clock()
            return False
