"""OpenAI-compatible endpoints. `model` is a task id or `base`.

    POST /v1/completions       the prompt verbatim (OpenAI semantics), the tokenizer's own
                               specials (BOS...) added as its config says; one prompt or a
                               batch, scoring with max_tokens 0 (server.api.openai.completions)
    POST /v1/chat/completions  base: the backbone's chat template; a task: the conversation
                               rendered into the task's training prompt format (server.api.openai.chat)
    GET  /v1/models, /v1/models/{model}

Which request fields are supported, ignored or refused: server.api.openai.schemas. Errors come in
OpenAI's shape (server.api.errors).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from adapters_store.backbone.prompt import strip_separator
from adapters_store.store.records import TaskRecord
from server.api import generation
from server.api.api_docs import OPENAI_ERRORS, ROUTE_DESCRIPTIONS, SSE_200
from server.api.deps import ApiKey, RuntimeDep
from server.api.errors import ApiError
from server.api.openai import chat
from server.api.openai import completions as openai_completions
from server.api.openai.format import TokenText, chat_logprobs, finish_reason, usage
from server.api.openai.response_format import format_spec
from server.api.openai.schemas import (
    ChatRequest,
    CompletionRequest,
    effective_seed,
    effective_temperature,
    effective_top_p,
)
from server.api.schemas import ModelList, ModelOut, prompt_fields
from server.engines.request import FinalEvent, SamplingParams
from server.registry.tasks import BASE
from server.tenancy import tenants
from server.wiring.runtime import Runtime

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[ApiKey])

COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "prompt_logprobs": "echo", "task": "model"}
CHAT_NAMES = {"max_new_tokens": "max_tokens", "prompt_logprobs": "messages", "task": "model"}


def _params(rt: Runtime, body: CompletionRequest | ChatRequest, max_tokens: int, names: dict[str, str], *,
            logprobs: int | None, prompt_logprobs: int | None = None,
            response_format: tuple[str, str] | None = None) -> SamplingParams:
    return generation.sampling(
        names, max_new_tokens=max_tokens, temperature=effective_temperature(body.temperature),
        top_p=effective_top_p(body.top_p), top_k=max(body.top_k, 0), seed=effective_seed(body.seed), stop=tuple(body.stop_list()), n=body.n,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        logit_bias=body.bias_pairs(), response_format=response_format,
        **vllm_extensions(body, max_tokens, rt.settings.max_new_tokens))


def vllm_extensions(body: CompletionRequest | ChatRequest, max_tokens: int, limit: int) -> dict[str, Any]:
    """vLLM's sampling extensions; min_tokens above max_tokens is max_tokens (above the server's
    limit on max tokens it is refused, as max_tokens is)."""
    if body.min_tokens > limit:
        raise ApiError(422, "validation_error", f"min_tokens: must be <= {limit}", param="min_tokens")
    return {"ignore_eos": body.ignore_eos, "min_tokens": min(body.min_tokens, max_tokens),
            "stop_token_ids": body.stop_ids(), "include_stop_str_in_output": body.include_stop_str_in_output,
            "skip_special_tokens": body.skip_special_tokens, "min_p": body.min_p}


@router.post("/completions", responses={**SSE_200, **OPENAI_ERRORS["generate"]},
             description=ROUTE_DESCRIPTIONS["completions"])
async def completions(body: CompletionRequest, request: Request, rt: RuntimeDep):
    names = COMPLETION_NAMES
    if body.stream and body.echo and body.logprobs is not None:
        raise ApiError(400, "invalid_request", "echo: echo with logprobs is not supported when streaming",
                       param="echo")
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    max_tokens = min(16, rt.settings.max_new_tokens) if body.max_tokens is None else body.max_tokens
    if "max_tokens" not in body.model_fields_set:  # the default never exceeds the server's limit
        max_tokens = min(max_tokens, rt.settings.max_new_tokens)
    params = _params(rt, body, max(max_tokens, 1), names, logprobs=body.logprobs, prompt_logprobs=echo_logprobs,
                     response_format=await format_spec(body.response_format, rt.tokenizer, stop=body.stop_list()))
    if max_tokens == 0:  # scoring: the one token the engine makes is dropped (openai_completions)
        params = dataclasses.replace(params, min_tokens=0)
    return await openai_completions.respond(body, request, rt, params, names)


def _render_chat(rt: Runtime, body: ChatRequest):
    def render(prompt_format: str) -> str:
        if body.model == BASE:
            return chat.render_with_template(rt.tokenizer, body.messages)
        return chat.render_for_task(body.messages, prompt_format)

    return render


@router.post("/chat/completions", responses={**SSE_200, **OPENAI_ERRORS["generate"]},
             description=ROUTE_DESCRIPTIONS["chat"])
async def chat_completions(body: ChatRequest, request: Request, rt: RuntimeDep):
    for name in ("max_tokens", "max_completion_tokens"):  # both are checked, whichever is used
        value = getattr(body, name)
        if value is not None and value > rt.settings.max_new_tokens:
            raise ApiError(422, "validation_error", f"{name}: must be <= {rt.settings.max_new_tokens}", param=name)
    max_tokens = body.max_completion_tokens or body.max_tokens or min(rt.settings.max_new_tokens, 512)
    names = {**CHAT_NAMES, "max_new_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
             "logprobs": "top_logprobs" if body.top_logprobs else "logprobs"}
    k = body.top_logprobs or 0
    params = _params(rt, body, max_tokens, names, logprobs=k if body.logprobs else None,
                     response_format=await format_spec(body.response_format, rt.tokenizer, stop=body.stop_list()))
    task_chat = body.model != BASE
    special = task_chat if body.add_special_tokens is None else body.add_special_tokens
    call = await generation.prepare(rt, body.model, _render_chat(rt, body), params, id_prefix="chatcmpl",
                                    names=names, prompt_field="messages", special_tokens=special)
    generation.submit(rt, call)
    text_of = TokenText(rt.tokenizer)
    created = int(time.time())
    if not body.stream:
        choices = await generation.collect(request, call)
        out = []
        for c in choices:
            assert c.final is not None
            text = strip_separator(c.text) if task_chat else c.text
            out.append({"index": c.index, "message": {"role": "assistant", "content": text, "refusal": None},
                        "logprobs": chat_logprobs(text_of, c.logprobs, k) if body.logprobs else None,
                        "finish_reason": finish_reason(c.final.finish_reason)})
        return {"id": call.req.id, "object": "chat.completion", "created": created, "model": body.model,
                "choices": out, "usage": usage([c.final for c in choices if c.final is not None])}
    base = {"id": call.req.id, "object": "chat.completion.chunk", "created": created, "model": body.model}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(index: int, delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return generation.sse(json.dumps({**base, "choices": [choice]}))

    async def stream() -> AsyncIterator[bytes]:
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None)
        leading = [task_chat] * body.n  # the separator can only lead a choice's first text
        finals: list[FinalEvent] = []
        async for event in generation.events(request, call):
            text = event.text
            if leading[event.index] and text:
                text, leading[event.index] = strip_separator(text), False
            logprobs = chat_logprobs(text_of, event.logprobs, k) if body.logprobs and event.logprobs else None
            if text or logprobs:
                yield chunk(event.index, {"content": text}, None, logprobs)
            if isinstance(event, FinalEvent):
                finals.append(event)
                yield chunk(event.index, {}, finish_reason(event.finish_reason))
        if include_usage:
            yield generation.sse(json.dumps({**base, "choices": [], "usage": usage(finals)}))
        yield generation.sse("[DONE]")

    return generation.stream_response(request, stream())


def _model(rt: Runtime, record: TaskRecord | None = None) -> ModelOut:
    if record is None:
        return ModelOut(id=BASE, created=int(rt.started_at), owned_by="polyserve", root=rt.backbone.name)
    return ModelOut(id=record.id, created=int(record.created_at), owned_by="polyserve", root=rt.backbone.name,
                    parent=BASE, **prompt_fields(record))


@router.get("/models", response_model=ModelList, responses=OPENAI_ERRORS["read"])
async def models(rt: RuntimeDep) -> ModelList:
    records = await asyncio.to_thread(rt.registry.list, tenants.current())
    return ModelList(data=[_model(rt), *(_model(rt, r) for r in records if rt.registry.servable(r))])


@router.get("/models/{model}", response_model=ModelOut, responses=OPENAI_ERRORS["lookup"])
async def model(model: str, rt: RuntimeDep) -> ModelOut:
    """A servable task (or `base`); a task that is unknown or not ready is 404, as in the list."""
    if model == BASE:
        return _model(rt)
    try:
        record = await asyncio.to_thread(rt.registry.get, model, tenants.current())
    except (ValueError, KeyError):
        record = None
    if record is None or not rt.registry.servable(record):
        raise ApiError(404, "not_found", f"model {model[:64]!r} not found", param="model")
    return _model(rt, record)
