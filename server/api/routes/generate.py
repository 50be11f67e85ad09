"""POST /v1/generate: polyserve's own endpoint (applies the task's training prompt format, the
one its record names, with the tokenizer's own specials as training encoded it).

The model answers after the format's separator (adapters_store.backbone.prompt.TARGET_SEPARATOR); the text
returned, streamed or not, is the answer without it. A failure after the stream started ends it
with `data: {"error": {...}}` and `data: [DONE]` (server.api.generation).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from adapters_store.backbone.prompt import format_prompt_as, strip_separator
from server.api import generation
from server.api.api_docs import ERRORS, ROUTE_DESCRIPTIONS, SSE_200
from server.api.deps import ApiKey, RuntimeDep
from server.api.openai.schemas import effective_seed, effective_temperature, effective_top_p
from server.api.schemas import GenerateRequest, GenerateResponse, Usage
from server.engines.request import FinalEvent

router = APIRouter(prefix="/v1", tags=["generate"], dependencies=[ApiKey])


@router.post("/generate", response_model=GenerateResponse, responses={**SSE_200, **ERRORS["generate"]},
             description=ROUTE_DESCRIPTIONS["generate"])
async def generate(body: GenerateRequest, request: Request, rt: RuntimeDep):
    """temperature below 1e-5 is greedy, one in [1e-5, 0.01) is raised to 0.01, a top_p below
    1e-6 to 1e-6 (as on the OpenAI routes: server.api.openai.schemas)."""
    max_new = body.max_new_tokens
    if "max_new_tokens" not in body.model_fields_set:  # the default never exceeds the server's limit
        max_new = min(max_new, rt.settings.max_new_tokens)
    params = generation.sampling({}, max_new_tokens=max_new,
                                 temperature=effective_temperature(body.temperature), top_p=effective_top_p(body.top_p),
                                 top_k=body.top_k, seed=effective_seed(body.seed), stop=tuple(body.stop))
    call = await generation.prepare(rt, body.task, lambda fmt: format_prompt_as(fmt, body.prompt), params)
    generation.submit(rt, call)
    if not body.stream:
        (choice,) = await generation.collect(request, call)
        assert choice.final is not None
        return GenerateResponse(id=call.req.id, task=body.task, text=strip_separator(choice.text),
                                finish_reason=choice.final.finish_reason,
                                usage=Usage(prompt_tokens=choice.final.prompt_tokens,
                                            completion_tokens=choice.final.completion_tokens))

    async def stream() -> AsyncIterator[bytes]:
        first = True  # the separator can only lead the first non-empty piece of text
        async for event in generation.events(request, call):
            text = event.text
            if first and text:
                text, first = strip_separator(text), False
            if isinstance(event, FinalEvent):
                usage = {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens}
                yield generation.sse(json.dumps({"id": call.req.id, "task": body.task, "text": text,
                                                 "finish_reason": event.finish_reason, "usage": usage}))
                yield generation.sse("[DONE]")
            elif text:
                yield generation.sse(json.dumps({"id": call.req.id, "task": body.task, "text": text,
                                                 "finish_reason": None}))

    return generation.stream_response(request, stream())
