"""The /v1/completions answer for one prompt or a batch of them (the route builds the sampling
parameters and calls `respond`).

    prompts    `prompt` is one string / token-id list, or a list of them (OpenAI and vLLM accept
               both); at most POLYSERVE_MAX_PROMPTS_PER_REQUEST. Each prompt is prepared and
               admitted as its own request (its own rows), so the batch shares the engine's
               forwards with everything else in flight.
    choices    prompt-major: choice j of prompt i has index i * n + j (OpenAI's and vLLM's order)
    usage      prompt tokens of every prompt + completion tokens of every choice
    scoring    max_tokens 0 (echo required): each choice is the prompt with its logprobs, nothing
               generated (finish_reason "length", 0 completion tokens). The engine is asked for one
               token, which is dropped (vLLM's server does the same); its prompt logprobs are the
               ones a generating request gets.

One disconnect watcher and one deadline for the whole batch; a prompt that fails fails the
request, and every other prompt's rows are cancelled.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request

from server.api import generation
from server.api.errors import ApiError
from server.api.openai import extensions
from server.api.openai.format import completion_logprobs, finish_reason, merge_completion_logprobs
from server.api.openai.schemas import CompletionRequest
from server.engines.request import FinalEvent, SamplingParams, TokenEvent
from server.wiring.runtime import Runtime


def batch_usage(finals_per_prompt: Sequence[Sequence[FinalEvent]], scoring: bool = False) -> dict[str, Any]:
    """Every prompt's tokens once, every choice's completion tokens (none when scoring)."""
    prompt = sum(finals[0].prompt_tokens for finals in finals_per_prompt if finals)
    completion = 0 if scoring else sum(f.completion_tokens for finals in finals_per_prompt for f in finals)
    cached = sum(finals[0].cached_tokens for finals in finals_per_prompt if finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def prepare_all(rt: Runtime, body: CompletionRequest, params: SamplingParams,
                      names: dict[str, str]) -> list[generation.Call]:
    prompts = body.prompt_values()
    limit = rt.settings.max_prompts_per_request
    if len(prompts) > limit:
        raise ApiError(422, "validation_error", f"prompt: at most {limit} prompts per request "
                       "(POLYSERVE_MAX_PROMPTS_PER_REQUEST)", param="prompt")
    special = True if body.add_special_tokens is None else body.add_special_tokens

    def render(prompt: str | list[int]) -> str | list[int]:
        if body.truncate_prompt_tokens is None:
            return prompt
        ids = rt.tokenizer(prompt, add_special_tokens=special).input_ids if isinstance(prompt, str) else prompt
        return extensions.truncated(list(ids), body, rt.settings.max_prompt_tokens)

    calls = []
    for prompt in prompts:
        calls.append(await generation.prepare(rt, body.model, lambda _fmt, p=prompt: render(p), params,  # type: ignore[misc]
                                              id_prefix="cmpl", names=names, special_tokens=special,
                                              cache_salt=body.cache_salt))
    return calls


def submit_all(rt: Runtime, calls: list[generation.Call]) -> None:
    """Every prompt into the engine's queue; if one is refused, the ones already queued are cancelled."""
    done: list[generation.Call] = []
    try:
        for call in calls:
            generation.submit(rt, call)
            done.append(call)
    except BaseException:
        for call in done:
            call.req.handle.cancel()
        raise


async def _watch_disconnect(request: Request, calls: list[generation.Call]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for call in calls:
                call.req.handle.cancel()
            return


def _timeout(calls: list[generation.Call]) -> ApiError:
    for call in calls:
        call.req.handle.cancel()
    return ApiError(504, "timeout", "the generation did not finish within the server's deadline "
                    "(POLYSERVE_REQUEST_TIMEOUT_SECONDS)")


async def events(request: Request, calls: list[generation.Call]) -> AsyncIterator[tuple[int, TokenEvent | FinalEvent]]:
    """(prompt index, event) of every prompt as they come; a failed final event raises ApiError;
    leaving early (disconnect, error) or the deadline cancels every prompt's rows."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, TokenEvent | FinalEvent]] = asyncio.Queue()

    async def pump(i: int, call: generation.Call) -> None:
        async for event in call.req.handle:
            queue.put_nowait((i, event))

    pumps = [asyncio.create_task(pump(i, call)) for i, call in enumerate(calls)]
    watcher = asyncio.create_task(_watch_disconnect(request, calls))
    remaining = sum(call.req.params.n for call in calls)
    deadline = min(call.deadline for call in calls)
    try:
        while remaining:
            try:
                i, event = await asyncio.wait_for(queue.get(), timeout=max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise _timeout(calls) from None
            if isinstance(event, FinalEvent):
                remaining -= 1
                generation.check(event)
            yield i, event
    finally:
        for task in (*pumps, watcher):
            task.cancel()
        for call in calls:
            call.req.handle.cancel()  # no-op once finished


async def collect(request: Request, calls: list[generation.Call]) -> list[list[generation.Choice]]:
    """Every choice of every prompt, whole."""
    out = [[generation.Choice(j) for j in range(call.req.params.n)] for call in calls]
    async for i, event in events(request, calls):
        choice = out[i][event.index]
        choice.text += event.text
        choice.logprobs.extend(event.logprobs or ())
        if isinstance(event, FinalEvent):
            choice.final = event
    return out


def _prompt_entries(call: generation.Call, finals: Sequence[FinalEvent]) -> list:
    """The caller's prompt tokens' logprobs (a task's demonstrations before them are not echoed)."""
    for final in finals:
        if final.prompt_logprobs is not None:
            return list(final.prompt_logprobs)[call.demonstration_tokens:]
    return [None] * len(call.caller_ids)


async def respond(body: CompletionRequest, request: Request, rt: Runtime, params: SamplingParams,
                  names: dict[str, str]) -> Any:
    scoring = body.max_tokens == 0
    calls = await prepare_all(rt, body, params, names)
    submit_all(rt, calls)
    text_of = extensions.token_text(rt.tokenizer, body)
    base = {"id": calls[0].req.id, "object": "text_completion", "created": int(time.time()), "model": body.model}
    ids_out = bool(body.return_token_ids)
    n = body.n
    if not body.stream:
        results = await collect(request, calls)
        out = []
        for i, (call, choices) in enumerate(zip(calls, results, strict=True)):
            finals = [c.final for c in choices if c.final is not None]
            prefix = call.prompt_text if body.echo else ""
            for c in choices:
                assert c.final is not None
                logprobs = None
                if body.logprobs is not None:
                    parts, offset = [], 0
                    if body.echo:
                        echoed, offset = completion_logprobs(text_of, _prompt_entries(call, finals), call.caller_ids)
                        parts.append(echoed)
                    if not scoring:
                        generated_ids = [e.token_id for e in c.logprobs]
                        parts.append(completion_logprobs(text_of, c.logprobs, generated_ids, offset)[0])
                    logprobs = parts[0] if len(parts) == 1 else merge_completion_logprobs(*parts)
                choice = {"index": i * n + c.index, "text": prefix + ("" if scoring else c.text),
                          "logprobs": logprobs,
                          "finish_reason": "length" if scoring else finish_reason(c.final.finish_reason)}
                if ids_out:
                    choice["token_ids"] = [] if scoring else [e.token_id for e in c.logprobs]
                    choice["prompt_token_ids"] = list(call.caller_ids)
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = extensions.prompt_logprobs(
                        text_of, _prompt_entries(call, finals), call.caller_ids)
                if body.return_prompt_text:
                    choice["prompt_text"] = call.prompt_text
                out.append(choice)
        usage = batch_usage([[c.final for c in choices if c.final is not None] for choices in results], scoring)
        return {**base, "choices": out, "usage": usage}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    continuous = extensions.continuous(body)
    counts = [0] * (len(calls) * n)  # completion tokens so far, per choice (continuous usage)
    first = [True] * (len(calls) * n)
    pending: list[list[int]] = [[] for _ in counts]  # token ids not sent yet, per choice
    sent_ids = [0] * len(counts)

    def chunk(index: int, text: str, logprobs: Any, reason: str | None, token_ids: list[int] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        call = calls[index // n]
        if ids_out:
            choice["token_ids"] = token_ids or []
            if first[index]:
                choice["prompt_token_ids"] = list(call.caller_ids)
        if body.return_prompt_text and first[index]:
            choice["prompt_text"] = call.prompt_text
        first[index] = False
        out: dict[str, Any] = {**base, "choices": [choice]}
        if continuous:
            out["usage"] = extensions.running_usage(len(call.req.prompt_ids), counts[index])
        return generation.sse(json.dumps(out))

    async def stream() -> AsyncIterator[bytes]:
        offsets = [0] * (len(calls) * n)
        if body.echo:  # the prompt first, as its own chunk per choice (vLLM's convention)
            for i, call in enumerate(calls):
                for j in range(n):
                    yield chunk(i * n + j, call.prompt_text, None, None)
        finals: list[list[FinalEvent]] = [[] for _ in calls]
        async for i, event in events(request, calls):
            index = i * n + event.index
            final = isinstance(event, FinalEvent)
            if scoring:  # the one token the engine made is not part of the answer
                if isinstance(event, FinalEvent):
                    finals[i].append(event)
                    yield chunk(index, "", None, "length")
                continue
            pending[index].extend(e.token_id for e in event.logprobs or ())
            counts[index] = len(pending[index]) + sent_ids[index]
            if not (event.text or (event.logprobs and body.logprobs is not None) or final):
                continue
            new_ids, pending[index] = pending[index], []
            sent_ids[index] += len(new_ids)
            logprobs = None
            if body.logprobs is not None:
                entries = event.logprobs or []
                logprobs, offsets[index] = completion_logprobs(text_of, entries, [e.token_id for e in entries],
                                                               offsets[index])
            reason = finish_reason(event.finish_reason) if isinstance(event, FinalEvent) else None
            yield chunk(index, event.text, logprobs, reason, new_ids)
            if isinstance(event, FinalEvent):
                finals[i].append(event)
        if include_usage:
            yield generation.sse(json.dumps({**base, "choices": [], "usage": batch_usage(finals, scoring)}))
        yield generation.sse("[DONE]")

    return generation.stream_response(request, stream())
