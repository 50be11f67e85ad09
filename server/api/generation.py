"""Shared request path of every generating endpoint (polyserve's own and OpenAI's):

    prepare:  resolve the task's adapter (cache tiers) + render + tokenise, off the event loop;
              limits (server/api/validation.py) -> 413 / context_length_exceeded (prompt), 422
              (max tokens, n, stop, logit_bias), 404/409 (task); starts the request's deadline
    submit:   into the engine's bounded queue -> 429 with Retry-After when full; an engine that
              refuses a sampling field (ValueError "field: ...") -> 400 naming the request field
    collect:  await every choice's final event; a client that disconnects cancels the row
    events:   async iterator of engine events for streaming; closing it cancels the row
    stream:   the SSE response; a failure after the first byte ends it with an error event
              `data: {"error": {...}}` then `data: [DONE]` (vLLM's convention; never a fake "stop")

Deadline: POLYSERVE_REQUEST_TIMEOUT_SECONDS from arrival, queueing included. On expiry the row
is cancelled and the answer is 504 `timeout` (not streamed) or the stream's error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from adapters_store.backbone.prompt import demonstration_token_ids
from server.api.errors import ApiError, api_error, error_payload
from server.api.validation import check_prompt_ids, check_rendered, check_sampling, task_errors, vocab_size
from server.engines.base import EngineStopped, QueueFull
from server.engines.fair import TenantLimit
from server.engines.request import (
    FinalEvent,
    GenRequest,
    RequestHandle,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    new_request_id,
)
from server.registry.tasks import ANSWER_END
from server.tenancy import tenants
from server.wiring.runtime import Runtime

log = logging.getLogger("polyserve.api")

SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_FIELD_PREFIX = re.compile(r"^\s*([a-z_]+)\b")


@dataclass
class Call:
    """A prepared request: what the engine runs, plus what the route needs to answer."""

    req: GenRequest
    deadline: float  # event-loop time
    prompt_text: str
    names: dict[str, str]  # SamplingParams field -> request field (for error messages)
    # the task's demonstrations at the front of req.prompt_ids: prompt, counted in usage, but not
    # the caller's text (an echo or prompt logprobs start after them)
    demonstration_tokens: int = 0
    usage: Any = None  # server.tenancy.usage.UsageLedger, once submitted: completions are counted there

    @property
    def caller_ids(self) -> list[int]:
        """The prompt's tokens after the task's demonstrations: what the caller sent, tokenised."""
        return list(self.req.prompt_ids[self.demonstration_tokens:])


@dataclass
class Choice:
    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: FinalEvent | None = None


def engine_param(err: ValueError, names: dict[str, str]) -> str | None:
    """The request field an engine's ValueError is about: its `param` attribute, else a leading
    SamplingParams field name ("n: not supported ..."), mapped to the route's field name."""
    name = getattr(err, "param", None)
    if name is None:
        match = _FIELD_PREFIX.match(str(err))
        name = match.group(1) if match and match.group(1) in SAMPLING_FIELDS else None
    return names.get(name, name) if name else None


def sampling(names: dict[str, str], **values) -> SamplingParams:
    """SamplingParams, its ValueErrors as 422 naming the request field."""
    try:
        return SamplingParams(**values)
    except ValueError as err:
        param = engine_param(err, names)
        raise ApiError(422, "validation_error", str(err), param=param) from None


async def prepare(
    rt: Runtime, task: str, render: Callable[[str], str | list[int]], params: SamplingParams, *,
    id_prefix: str = "gen", names: dict[str, str] | None = None, prompt_field: str = "prompt",
    special_tokens: bool = True, cache_salt: str | None = None,
) -> Call:
    """Validate against the limits (server/api/validation.py), resolve the adapter, render (given
    the task's prompt format) and tokenise; returns an unsubmitted request. special_tokens: add the
    tokenizer's own specials (BOS...) as its config says, the way training encodes prompts; False
    for chat templates, which carry their own."""
    loop = asyncio.get_running_loop()
    s = rt.settings
    deadline = loop.time() + s.request_timeout_seconds
    names = names or {}
    vocab = vocab_size(rt)
    check_sampling(params, s, vocab, names)
    tenant = tenants.current()

    def work() -> tuple[object, list[int], str, int]:
        # the prompt is checked before any work for it (adapter resolution, decoding, tokenising)
        with task_errors(names):
            prompt = rt.registry.prompt(task, tenant)
        try:
            rendered = render(prompt.prompt_format)
        except ValueError as err:  # unknown prompt format, unrenderable or empty messages
            raise ApiError(400, "invalid_request", str(err), param=prompt_field,
                           code=getattr(err, "code", None)) from None
        check_rendered(rendered, vocab, s.max_prompt_tokens, prompt_field)
        with task_errors(names):
            adapter = rt.registry.resolve(task, tenant)
        # a task's demonstrations go first, tokenised on their own, so that every prompt of the task
        # begins with the same tokens (the prefix cache holds them once) and the caller's part is
        # tokenised as it would be alone
        demos = demonstration_ids(rt.tokenizer, prompt.demonstration_text(), special_tokens) \
            if prompt.demonstrations else []
        if isinstance(rendered, list):
            return adapter, demos + rendered, rt.tokenizer.decode(rendered), len(demos)
        ids = list(rt.tokenizer(rendered, add_special_tokens=special_tokens and not demos).input_ids)
        return adapter, demos + ids, rendered, len(demos)

    adapter, ids, text, hidden = await asyncio.to_thread(work)
    check_prompt_ids(ids, vocab, s.max_prompt_tokens, prompt_field)
    if hidden and ANSWER_END not in params.stop:
        # after demonstrations an answer ends as theirs do, at a newline (training/demos.py)
        params = dataclasses.replace(params, stop=(*params.stop, ANSWER_END))
    req = GenRequest(ids, params, adapter, task, id=new_request_id(id_prefix), handle=RequestHandle(loop),
                     tenant=tenant.name, cache_salt=cache_salt)
    return Call(req, deadline, text, names, demonstration_tokens=hidden)


_DEMO_IDS: OrderedDict[tuple[int, bool, str], list[int]] = OrderedDict()
_DEMO_IDS_HELD = 256  # tasks' demonstration texts kept tokenised
_demo_lock = threading.Lock()


def demonstration_ids(tokenizer: Any, text: str, special_tokens: bool) -> list[int]:
    """The token ids of a task's demonstration text, as training encodes them before a prompt
    (adapters_store.backbone.prompt.demonstration_token_ids), tokenised once per text (LRU)."""
    key = (id(tokenizer), special_tokens, text)
    with _demo_lock:
        ids = _DEMO_IDS.get(key)
        if ids is not None:
            _DEMO_IDS.move_to_end(key)
            return list(ids)
    ids = demonstration_token_ids(tokenizer, text, special_tokens)
    with _demo_lock:
        _DEMO_IDS[key] = ids
        while len(_DEMO_IDS) > _DEMO_IDS_HELD:
            _DEMO_IDS.popitem(last=False)
    return list(ids)


def submit(rt: Runtime, call: Call) -> Call:
    req = call.req
    call.usage = usage = getattr(rt, "usage", None)  # a Runtime has one; unit tests' stand-ins may not
    try:
        rt.engine.submit(req)
    except TenantLimit as err:
        if err.permanent:  # this request alone exceeds its tenant's cap: it can never run
            raise ApiError(422, "validation_error", str(err), param="n" if err.limit == "rows" else None) from None
        if usage is not None:
            usage.refused(req.tenant, req.task)
        rt.metrics.tenant_refused.labels(tenant=req.tenant, limit=err.limit).inc()
        raise ApiError(429, "overloaded", f"{err} ({err.limit} limit); retry after {err.retry_after}s",
                       {"Retry-After": str(err.retry_after)}) from None
    except QueueFull as err:
        if usage is not None:
            usage.refused(req.tenant, req.task)
        raise ApiError(429, "overloaded", str(err), {"Retry-After": str(err.retry_after)}) from None
    except EngineStopped:
        raise ApiError(503, "unavailable", "server is shutting down") from None
    except ValueError as err:
        param = engine_param(err, call.names)
        if param is not None:  # a sampling field this engine does not honour
            raise ApiError(400, "unsupported", str(err), param=param, code="unsupported_parameter") from None
        raise ApiError(413, "too_large", str(err), code="context_length_exceeded") from None
    if usage is not None:
        usage.request(req.tenant, req.task, len(req.prompt_ids))
    return call


def _count(call: Call, final: FinalEvent) -> None:
    if call.usage is not None:
        call.usage.completion(call.req.tenant, call.req.task, final.completion_tokens)


def check(final: FinalEvent) -> FinalEvent:
    """A final event that carries an error becomes the ApiError the client sees."""
    if final.error is None:
        return final
    if final.finish_reason == "cancelled" and "shutting down" in final.error:
        raise ApiError(503, "unavailable", "server is shutting down")
    log.error("generation failed in the engine: %s", final.error)
    raise ApiError(500, "internal_error", "generation failed in the engine (details in the server log)")


def _timeout(call: Call) -> ApiError:
    call.req.handle.cancel()
    return ApiError(504, "timeout", "the generation did not finish within the server's deadline "
                    "(POLYSERVE_REQUEST_TIMEOUT_SECONDS)")


async def _watch_disconnect(request: Request, req: GenRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            req.handle.cancel()
            return


def _absorb(choices: list[Choice], event: TokenEvent | FinalEvent) -> Choice:
    choice = choices[event.index]
    choice.text += event.text
    choice.logprobs.extend(event.logprobs or ())
    if isinstance(event, FinalEvent):
        choice.final = check(event)
    return choice


async def collect(request: Request, call: Call) -> list[Choice]:
    """Wait for every choice's whole answer; a disconnect cancels the row (finish 'cancelled')."""
    req = call.req
    choices = [Choice(i) for i in range(req.params.n)]
    watcher = asyncio.create_task(_watch_disconnect(request, req))
    try:
        async with asyncio.timeout_at(call.deadline):
            async for event in req.handle:
                if isinstance(event, FinalEvent):
                    _count(call, event)
                _absorb(choices, event)
    except TimeoutError:
        raise _timeout(call) from None
    finally:
        watcher.cancel()
        req.handle.cancel()  # no-op once finished
    if any(c.final is None for c in choices):
        raise AssertionError("engine closed a handle without a final event per choice")
    return choices


async def events(request: Request, call: Call) -> AsyncIterator[TokenEvent | FinalEvent]:
    """Engine events of a streaming request (a failed final event raises ApiError); leaving
    early (disconnect) or the deadline cancels the row."""
    req = call.req
    watcher = asyncio.create_task(_watch_disconnect(request, req))
    loop = asyncio.get_running_loop()
    it = aiter(req.handle)
    try:
        while True:
            try:
                event = await asyncio.wait_for(anext(it), timeout=max(0.0, call.deadline - loop.time()))
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise _timeout(call) from None
            if isinstance(event, FinalEvent):
                _count(call, event)
                check(event)
            yield event
    finally:
        watcher.cancel()
        req.handle.cancel()


def sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


def stream_response(request: Request, chunks: AsyncIterator[bytes]) -> StreamingResponse:
    """SSE response; an error after the stream started becomes an error event, then [DONE]."""
    path = request.url.path

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:
            err = api_error(exc)
            if err is None:  # a bug: logged, answered in general terms
                log.exception("stream failed")
                err = ApiError(500, "internal_error", "internal server error")
            _, body = error_payload(path, err.status, err.type, err.message, err.param, err.code)
        else:
            return
        yield sse(json.dumps(body))
        yield sse("[DONE]")

    return StreamingResponse(guarded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
