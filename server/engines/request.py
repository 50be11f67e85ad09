"""What the engine is asked to do, and how its answers travel back to the asyncio side.

The API layer builds a `GenRequest` (token ids, sampling params, the row's adapter) and submits
it; the engine thread pushes `TokenEvent`s / one `FinalEvent` into the request's `RequestHandle`,
which hands them to the event loop with `call_soon_threadsafe` (the loop never blocks on the
engine, the engine never awaits the loop).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "cancelled"]

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's top_logprobs bound, vLLM's default max_logprobs)

_ids = itertools.count()


def new_request_id(prefix: str = "gen") -> str:
    return f"{prefix}-{secrets.token_hex(6)}{next(_ids):x}"


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Every engine honours every field, or refuses the request at
    `submit` with a ValueError naming the field (never silently ignores it).

    temperature < 1e-5 (GREEDY_TEMPERATURE, 0 included) = greedy; top_k 0 = off; top_p 1 = off;
    seed None = fresh randomness.
    n                   choices generated for one prompt (they share its prefill); choice i of a
                        seeded request samples with seed + i, so every choice is reproducible
    logprobs            None = off; 0 <= k <= 20: each generated token's logprob under the model (log
                        softmax of the RAW logits: before logit_bias, penalties, temperature,
                        top-k/top-p, as vLLM's default) plus the k most likely alternatives. Every
                        generated token is reported exactly once, on a TokenEvent or the
                        FinalEvent, the EOS token that ends a choice included (it counts in
                        completion_tokens and adds no text), as OpenAI and vLLM do
    prompt_logprobs     None = off; 0 <= k <= 20: the same for every prompt token after the first, on
                        the FinalEvent of every choice (entry 0 is None)
    presence_penalty    OpenAI: logit -= p for every token generated at least once      [-2, 2]
    frequency_penalty   OpenAI: logit -= f * (times the token was generated)           [-2, 2]
    repetition_penalty  vLLM/HF: tokens seen in prompt or output: logit / r if > 0, * r else  (0, 2]
    logit_bias          (token id, bias) pairs added to the logits before sampling    [-100, 100]
    min_tokens          vLLM: EOS (unless ignore_eos) and stop_token_ids cannot be sampled, and
                        stop strings are not looked for, before this many tokens   [0, max_new_tokens]
    stop_token_ids      vLLM: generating one of these ends the choice ("stop"), even with ignore_eos
    include_stop_str_in_output  vLLM: the stop string (or stop token's text) stays in the text
    skip_special_tokens vLLM: special tokens add no text (default)
    min_p               vLLM: after temperature, tokens below min_p x the top token's probability
                        are dropped (sampling only; greedy is unchanged)             [0, 1]
    Order (vLLM's): logit_bias, repetition, frequency, presence on the raw logits, then the
    min_tokens mask; greedy takes the argmax of that; sampling then applies temperature, min-p,
    top-k, top-p.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks only: fixed output lengths
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_p: float = 0.0
    # structured output: ("json_object", "") or ("json_schema", the schema as JSON) (engines/grammar.py)
    response_format: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: token {token} bias {bias} (ids >= 0, bias in [-100, 100])")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (>= 0)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temperature below GREEDY_TEMPERATURE (dividing by a tinier one
        overflows; the limit of such sampling is the argmax anyway)."""
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class TokenEvent:
    text: str  # new text since the previous event (may be "" while a stop prefix is held back)
    token_id: int  # the newest token
    index: int = 0  # which choice (0 <= index < params.n)
    # every token since the previous event of this choice, with logprobs when asked for
    logprobs: list[TokenLogprob] | None = None


@dataclass
class FinalEvent:
    text: str  # text not yet sent in a TokenEvent
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    # set only when the engine failed this choice (finish_reason "cancelled"): its forward or
    # sampling failed (e.g. NaN logits), or the engine shut down ("server shutting down")
    error: str | None = None
    index: int = 0  # which choice
    logprobs: list[TokenLogprob] | None = None  # tokens not yet reported in a TokenEvent
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (first is None)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class RequestHandle:
    """Thread-safe mailbox for one request; the API side iterates it, the engine fills it.
    The request is done once every choice has had its FinalEvent (`expect` of them)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None, expect: int = 1) -> None:
        self._loop = loop
        self.expect = expect  # final events still to come; GenRequest sets it to params.n
        self._finals = 0
        self._finals_lock = threading.Lock()
        self._queue: asyncio.Queue[TokenEvent | FinalEvent] | None = asyncio.Queue() if loop else None
        self._events: list[TokenEvent | FinalEvent] = []  # used without a loop (benchmarks, tests)
        self._done = threading.Event()
        self.cancelled = threading.Event()

    # -- engine side ---------------------------------------------------------------------------
    def push(self, event: TokenEvent | FinalEvent) -> None:
        if isinstance(event, FinalEvent):
            with self._finals_lock:
                self._finals += 1
                if self._finals >= self.expect:
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
        finals = 0
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, FinalEvent):
                finals += 1
                if finals >= self.expect:
                    return


@dataclass
class GenRequest:
    """One generation: prompt token ids, sampling, and the adapter its row runs with."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter: Any = None  # server.adapter_cache.types.Adapter | None (None = base)
    task: str = "base"
    id: str = field(default_factory=new_request_id)
    handle: RequestHandle = field(default_factory=lambda: RequestHandle(None))
    arrival: float = field(default_factory=time.perf_counter)
    tenant: str = "default"  # who asked (server.tenancy.tenants): fair admission, caps and usage go by it
    cache_salt: str | None = None  # vLLM's field: only requests with the same salt share prompt KV
    cached_tokens: int = 0  # set by the engine at admission: prompt tokens found in its prefix cache

    def __post_init__(self) -> None:
        self.handle.expect = self.params.n

    @property
    def budget_tokens(self) -> int:
        """KV positions this request may occupy: its admission cost against max_batch_tokens
        (each of the n choices is a row with its own copy of the prompt's positions)."""
        return self.params.n * (len(self.prompt_ids) + self.params.max_new_tokens)
