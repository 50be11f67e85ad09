"""Shared request path of every generating endpoint (polyserve's own and OpenAI's):

    prepare:  resolve the task's adapter (cache tiers) + tokenise, off the event loop;
              limits -> 413 (prompt), 422 (max_new_tokens), 404/409 (task)
    submit:   into the engine's bounded queue -> 429 with Retry-After when full
    collect:  await the final event; a client that disconnects cancels its row
    events:   async iterator of engine events for streaming; closing it cancels the row
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request

from adapters_store.errors import TaskNotFound
from server.engine.engine import EngineStopped, QueueFull
from server.engine.request import (
    FinalEvent,
    GenRequest,
    RequestHandle,
    SamplingParams,
    TokenEvent,
    new_request_id,
)
from server.errors import ApiError
from server.runtime import Runtime


@dataclass
class Result:
    text: str
    finish: FinalEvent


def _encode(rt: Runtime, text: str) -> list[int]:
    return list(rt.tokenizer(text, add_special_tokens=False).input_ids)


async def prepare(
    rt: Runtime, task: str, render: Callable[[], str], params: SamplingParams, *, id_prefix: str = "gen",
    tokens_field: str = "max_new_tokens",
) -> GenRequest:
    """Validate against the limits, resolve the adapter, tokenise; returns an unsubmitted request."""
    s = rt.settings
    if params.max_new_tokens > s.max_new_tokens:
        raise ApiError(422, "validation_error", f"{tokens_field}: must be <= {s.max_new_tokens}")
    if len(params.stop) > s.max_stop_strings:
        raise ApiError(422, "validation_error", f"stop: at most {s.max_stop_strings} stop strings")

    def work() -> tuple[object, list[int]]:
        try:
            adapter = rt.registry.resolve(task)
        except TaskNotFound:
            raise ApiError(404, "not_found", f"task {task!r} not found") from None
        except ValueError as err:
            raise ApiError(422, "validation_error", f"task: {err}") from None
        text = render()
        if len(text) > 16 * s.max_prompt_tokens + 1024:  # cheap bound before tokenising
            raise ApiError(413, "too_large", f"prompt is longer than max_prompt_tokens={s.max_prompt_tokens}")
        return adapter, _encode(rt, text)

    adapter, ids = await asyncio.to_thread(work)
    if not ids:
        raise ApiError(422, "validation_error", "prompt: must not be empty")
    if len(ids) > s.max_prompt_tokens:
        raise ApiError(413, "too_large", f"prompt has {len(ids)} tokens, the limit is {s.max_prompt_tokens}")
    return GenRequest(ids, params, adapter, task, id=new_request_id(id_prefix),
                      handle=RequestHandle(asyncio.get_running_loop()))


def submit(rt: Runtime, req: GenRequest) -> GenRequest:
    try:
        return rt.engine.submit(req)
    except QueueFull as err:
        raise ApiError(429, "overloaded", str(err), {"Retry-After": str(err.retry_after)}) from None
    except EngineStopped:
        raise ApiError(503, "unavailable", "server is shutting down") from None
    except ValueError as err:
        raise ApiError(413, "too_large", str(err)) from None


async def _watch_disconnect(request: Request, req: GenRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            req.handle.cancel()
            return


def _check(final: FinalEvent) -> FinalEvent:
    if final.error is not None and final.finish_reason == "cancelled" and "shutting down" in final.error:
        raise ApiError(503, "unavailable", final.error)
    if final.error is not None:
        raise RuntimeError(final.error)
    return final


async def collect(request: Request, req: GenRequest) -> Result:
    """Wait for the whole answer; a disconnect cancels the row (finish_reason 'cancelled')."""
    watcher = asyncio.create_task(_watch_disconnect(request, req))
    parts: list[str] = []
    try:
        async for event in req.handle:
            parts.append(event.text)
            if isinstance(event, FinalEvent):
                return Result("".join(parts), _check(event))
    finally:
        watcher.cancel()
        req.handle.cancel()  # no-op once finished
    raise AssertionError("engine closed a handle without a final event")


async def events(request: Request, req: GenRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
    """Engine events of a streaming request; leaving early (disconnect) cancels the row. (Once the
    stream has started its status is sent: an engine failure ends it with finish_reason
    'cancelled' rather than an HTTP error.)"""
    watcher = asyncio.create_task(_watch_disconnect(request, req))
    try:
        async for event in req.handle:
            yield event
    finally:
        watcher.cancel()
        req.handle.cancel()


def sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()
