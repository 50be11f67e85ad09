"""Which choices of admitted requests still owe their FinalEvent; each is sent exactly once.

Every FinalEvent of an admitted request goes through `send`, so whatever fails (a row, a forward,
the engine step, the engine thread) `fail_open` can answer exactly the choices nobody answered
yet, and a late duplicate (a row finished twice by a bug) is dropped instead of confusing the
client.

    open(req)            at admission: choices 0..n-1 are owed
    send(req, final)     deliver final (its `index` says which choice) if still owed -> True
    fail_open(msg, why)  an error final for every choice still owed (last resort, shutdown)
"""

from __future__ import annotations

import logging

from server.engines.request import FinalEvent, FinishReason, GenRequest

log = logging.getLogger("polyserve.engine")


class FinalLedger:
    def __init__(self) -> None:
        self._open: dict[int, tuple[GenRequest, set[int]]] = {}

    def __len__(self) -> int:
        """Choices still owed a final event."""
        return sum(len(owed) for _, owed in self._open.values())

    def open(self, req: GenRequest) -> None:
        self._open[id(req)] = (req, set(range(req.params.n)))

    def owes(self, req: GenRequest, index: int) -> bool:
        entry = self._open.get(id(req))
        return entry is not None and index in entry[1]

    def send(self, req: GenRequest, final: FinalEvent) -> bool:
        entry = self._open.get(id(req))
        if entry is None or final.index not in entry[1]:
            log.error("duplicate final event for %s choice %d dropped", req.id, final.index)
            return False
        entry[1].discard(final.index)
        if not entry[1]:
            del self._open[id(req)]
        deliver(req, final)
        return True

    def fail_open(self, message: str, reason: FinishReason = "cancelled") -> int:
        """An error final for every choice still owed; returns how many were sent."""
        sent = 0
        for req, owed in list(self._open.values()):
            for index in sorted(owed):
                sent += self.send(req, FinalEvent("", reason, len(req.prompt_ids), 0, error=message, index=index))
        return sent


def deliver(req: GenRequest, final: FinalEvent) -> None:
    """Push a final event; a handle that raises is logged (nothing more can reach its client)."""
    try:
        req.handle.push(final)
    except Exception:
        log.exception("could not deliver the final event of %s choice %d", req.id, final.index)


def answer_unadmitted(req: GenRequest, reason: FinishReason, message: str | None = None) -> None:
    """Finals for every choice of a request that never left the waiting queue."""
    for index in range(req.params.n):
        deliver(req, FinalEvent("", reason, len(req.prompt_ids), 0, error=message, index=index))
