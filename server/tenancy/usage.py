"""Usage by tenant and task over a sliding window, in bounded memory (GET /v1/usage).

Counts land in one-minute buckets; buckets older than the longest window kept (`keep_seconds`)
are dropped, so memory is (minutes kept) x (tenant, task) pairs seen in them. Tenants are
configured names (server.tenancy.tenants) and tasks are registered ids (a request is counted only once
its task resolved), so both are bounded sets.

    request(tenant, task, prompt_tokens)       a generation was accepted by the engine
    completion(tenant, task, tokens)           one choice finished with `tokens` generated
    refused(tenant, task)                      a 429 at submit (its tenant's cap, or a full queue)
    rows(window)                               [{tenant, task, requests, prompt_tokens,
                                                 completion_tokens, refused}], over the last
                                                 `window` seconds (whole minutes, rounded up)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

BUCKET_SECONDS = 60
FIELDS = ("requests", "prompt_tokens", "completion_tokens", "refused")


class UsageLedger:
    def __init__(self, keep_seconds: int = 24 * 3600, clock: Callable[[], float] = time.time) -> None:
        self.keep_seconds = keep_seconds
        self.clock = clock
        self._lock = threading.Lock()
        # (bucket start, {(tenant, task): [requests, prompt, completion, refused]}), oldest first
        self._buckets: deque[tuple[int, dict[tuple[str, str], list[int]]]] = deque()

    def _add(self, tenant: str, task: str, field: int, amount: int) -> None:
        start = int(self.clock()) // BUCKET_SECONDS * BUCKET_SECONDS
        with self._lock:
            if not self._buckets or self._buckets[-1][0] != start:
                self._buckets.append((start, {}))
                while self._buckets and self._buckets[0][0] <= start - self.keep_seconds:
                    self._buckets.popleft()
            counts = self._buckets[-1][1].setdefault((tenant, task), [0, 0, 0, 0])
            counts[field] += amount

    def request(self, tenant: str, task: str, prompt_tokens: int) -> None:
        self._add(tenant, task, 0, 1)
        self._add(tenant, task, 1, prompt_tokens)

    def completion(self, tenant: str, task: str, tokens: int) -> None:
        self._add(tenant, task, 2, tokens)

    def refused(self, tenant: str, task: str) -> None:
        self._add(tenant, task, 3, 1)

    def rows(self, window: float) -> list[dict[str, int | str]]:
        """Totals per (tenant, task) over the buckets that overlap the last `window` seconds."""
        since = self.clock() - window
        totals: dict[tuple[str, str], list[int]] = {}
        with self._lock:
            for start, counts in self._buckets:
                if start + BUCKET_SECONDS <= since:
                    continue
                for key, values in counts.items():
                    total = totals.setdefault(key, [0, 0, 0, 0])
                    for i, v in enumerate(values):
                        total[i] += v
        return [{"tenant": tenant, "task": task, **dict(zip(FIELDS, values, strict=True))}
                for (tenant, task), values in sorted(totals.items())]
