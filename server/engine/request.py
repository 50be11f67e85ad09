"""What the engine is asked to do, and how its answers travel back to the asyncio side.

The API layer builds a `GenRequest` (token ids, sampling params, the row's adapter) and submits
it; the engine thread pushes `TokenEvent`s / one `FinalEvent` into the request's `RequestHandle`,
which hands them to the event loop with `call_soon_threadsafe` (the loop never blocks on the
engine, the engine never awaits the loop).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "cancelled"]

_ids = itertools.count()


def new_request_id(prefix: str = "gen") -> str:
    return f"{prefix}-{secrets.token_hex(6)}{next(_ids):x}"


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; seed None = fresh randomness."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks only: fixed output lengths

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class TokenEvent:
    text: str  # new text since the previous event (may be "" while a stop prefix is held back)
    token_id: int


@dataclass
class FinalEvent:
    text: str  # text not yet sent in a TokenEvent
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # set only when the engine failed the row (a bug) or shut down


class RequestHandle:
    """Thread-safe mailbox for one request; the API side iterates it, the engine fills it."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[TokenEvent | FinalEvent] | None = asyncio.Queue() if loop else None
        self._events: list[TokenEvent | FinalEvent] = []  # used without a loop (benchmarks, tests)
        self._done = threading.Event()
        self.cancelled = threading.Event()

    # -- engine side ---------------------------------------------------------------------------
    def push(self, event: TokenEvent | FinalEvent) -> None:
        if isinstance(event, FinalEvent):
            self._done.set()
        if self._loop is None:
            self._events.append(event)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)  # type: ignore[union-attr]
        except RuntimeError:  # loop closed: nobody is listening any more
            self.cancelled.set()

    # -- API side ------------------------------------------------------------------------------
    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def events(self) -> list[TokenEvent | FinalEvent]:
        return self._events

    async def __aiter__(self) -> AsyncIterator[TokenEvent | FinalEvent]:
        assert self._queue is not None, "handle created without an event loop"
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, FinalEvent):
                return


@dataclass
class GenRequest:
    """One generation: prompt token ids, sampling, and the adapter its row runs with."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter: Any = None  # server.adapters.types.Adapter | None (None = base)
    task: str = "base"
    id: str = field(default_factory=new_request_id)
    handle: RequestHandle = field(default_factory=lambda: RequestHandle(None))
    arrival: float = field(default_factory=time.perf_counter)

    @property
    def budget_tokens(self) -> int:
        """KV positions this request may occupy: its admission cost against max_batch_tokens."""
        return len(self.prompt_ids) + self.params.max_new_tokens
