"""OpenAI-compatible endpoints: /v1/completions (prompt verbatim), /v1/chat/completions (the
backbone's chat template), /v1/models. `model` is a task id or `base`."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from server import generation
from server.deps import ApiKey, RuntimeDep
from server.engine.request import FinalEvent, FinishReason, SamplingParams
from server.errors import ApiError
from server.openai_schemas import ChatRequest, CompletionRequest
from server.tasks import BASE

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[ApiKey])


def _finish(reason: FinishReason) -> str:
    return "length" if reason == "length" else "stop"


def _usage(final: FinalEvent) -> dict[str, int]:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens}


def _params(body: CompletionRequest | ChatRequest, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, seed=body.seed, stop=tuple(s for s in body.stop_list() if s))


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, rt: RuntimeDep):
    params = _params(body, body.max_tokens or 16)
    req = await generation.prepare(rt, body.model, body.prompt_text, params, id_prefix="cmpl",
                                   tokens_field="max_tokens")
    generation.submit(rt, req)
    created = int(time.time())
    base = {"id": req.id, "object": "text_completion", "created": created, "model": body.model}
    if not body.stream:
        result = await generation.collect(request, req)
        choice = {"index": 0, "text": result.text, "logprobs": None,
                  "finish_reason": _finish(result.finish.finish_reason)}
        return {**base, "choices": [choice], "usage": _usage(result.finish)}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def stream():
        async for event in generation.events(request, req):
            final = isinstance(event, FinalEvent)
            if event.text or final:
                choice = {"index": 0, "text": event.text, "logprobs": None,
                          "finish_reason": _finish(event.finish_reason) if final else None}
                yield generation.sse(json.dumps({**base, "choices": [choice]}))
            if final:
                if include_usage:
                    yield generation.sse(json.dumps({**base, "choices": [], "usage": _usage(event)}))
                yield generation.sse("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _render_chat(rt, body: ChatRequest) -> str:
    try:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
    except ValueError as err:
        raise ApiError(422, "validation_error", f"messages: {err}") from None
    if getattr(rt.tokenizer, "chat_template", None) is None:
        raise ApiError(400, "invalid_request", "the backbone has no chat template; use /v1/completions")
    return rt.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, rt: RuntimeDep):
    max_tokens = body.max_completion_tokens or body.max_tokens or min(rt.settings.max_new_tokens, 512)
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    req = await generation.prepare(rt, body.model, lambda: _render_chat(rt, body), _params(body, max_tokens),
                                   id_prefix="chatcmpl", tokens_field=field)
    generation.submit(rt, req)
    created = int(time.time())
    if not body.stream:
        result = await generation.collect(request, req)
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                  "finish_reason": _finish(result.finish.finish_reason)}
        return {"id": req.id, "object": "chat.completion", "created": created, "model": body.model,
                "choices": [choice], "usage": _usage(result.finish)}
    base = {"id": req.id, "object": "chat.completion.chunk", "created": created, "model": body.model}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return generation.sse(json.dumps({**base, "choices": [choice]}))

    async def stream():
        yield chunk({"role": "assistant", "content": ""}, None)
        async for event in generation.events(request, req):
            if event.text:
                yield chunk({"content": event.text}, None)
            if isinstance(event, FinalEvent):
                yield chunk({}, _finish(event.finish_reason))
                if include_usage:
                    yield generation.sse(json.dumps({**base, "choices": [], "usage": _usage(event)}))
                yield generation.sse("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get("/models")
async def models(rt: RuntimeDep) -> dict:
    records = await asyncio.to_thread(rt.registry.list)
    created = int(rt.started_at)
    data = [{"id": BASE, "object": "model", "created": created, "owned_by": "polyserve"}]
    data += [{"id": r.id, "object": "model", "created": int(r.created_at), "owned_by": "polyserve"}
             for r in records if rt.registry.servable(r)]
    return {"object": "list", "data": data}
