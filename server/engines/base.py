"""What the rest of the server needs from an engine, and nothing more (TGI's backend trait).

The HTTP layer, the task registry, the cache tiers and the jobs talk to an engine only through
this interface; each engine lives in its own folder (`native/`, `vllm/`) and is chosen once at
start-up (`server.engines.factory.build_engine`, setting `POLYSERVE_ENGINE`).

    submit(req)              queue a GenRequest whose adapter is already resolved (cache tiers);
                             raises QueueFull (-> 429 + Retry-After), EngineStopped (-> 503),
                             ValueError (the request cannot fit the engine's budgets -> 4xx)
    req.handle               the engine pushes TokenEvents and exactly one FinalEvent per choice
                             into it, whatever fails (a failed row gets a FinalEvent with `error`)
    req.handle.cancel()      the API side gives up (disconnect): the row leaves within one step
    waiting / running        queue depth and rows in flight (gauges, 429 decisions)
    add_background_task(fn)  adaptation slices: fn() does a short piece of work, returns whether
                             it has more; the engine bounds the share of time it gets
    forget(task)             a task was deleted or re-registered: drop engine-side state for it
    alive                    the engine can still make progress (its loop / worker is running)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from server.engines.request import GenRequest


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"server overloaded: waiting queue is full; retry after {retry_after}s")
        self.retry_after = retry_after


class EngineStopped(Exception):
    pass


def check_fits(req: GenRequest, *, max_tokens: int, max_rows: int, vocab_size: int) -> None:
    """ValueError when a request can never run on an engine with these budgets (-> 4xx): prompt +
    max_new_tokens over max_batch_tokens, an empty prompt, a prompt token that is not an id of the
    vocabulary, n over max_batch_rows, a logit_bias token outside the vocabulary. Every engine
    calls it first in submit()."""
    if req.budget_tokens > max_tokens:
        raise ValueError(f"prompt + max_new_tokens = {req.budget_tokens} exceeds max_batch_tokens {max_tokens}")
    if not req.prompt_ids:
        raise ValueError("prompt must hold at least one token")
    bad = next((t for t in req.prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:  # the HTTP layer checks too; this keeps a direct caller's bad id out of a shared step
        raise ValueError(f"prompt: token id {bad!r} is not an integer in [0, {vocab_size})")
    if req.params.n > max_rows:
        raise ValueError(f"n: {req.params.n} choices exceed max_batch_rows {max_rows}")
    for token, _ in req.params.logit_bias:
        if token >= vocab_size:
            raise ValueError(f"logit_bias: token id {token} is outside the vocabulary (size {vocab_size})")
    for token in req.params.stop_token_ids:
        if token >= vocab_size:
            raise ValueError(f"stop_token_ids: token id {token} is outside the vocabulary (size {vocab_size})")


@runtime_checkable
class Engine(Protocol):
    name: str

    def start(self) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...

    def submit(self, req: GenRequest) -> GenRequest: ...

    def retry_after(self) -> int: ...

    def add_background_task(self, fn: Callable[[], bool]) -> None: ...

    def forget(self, task: str) -> None: ...

    @property
    def waiting(self) -> int: ...

    @property
    def running(self) -> int: ...

    @property
    def alive(self) -> bool: ...
