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

from adapters_store.store.records import TaskRecord
from server.api import generation
from server.api.api_docs import OPENAI_ERRORS, ROUTE_DESCRIPTIONS, SSE_200
from server.api.deps import ApiKey, RuntimeDep
from server.api.errors import ApiError
from server.api.openai import chat_run, extensions, tools
from server.api.openai import completions as openai_completions
from server.api.openai.format import usage
from server.api.openai.response_format import format_spec
from server.api.openai.schemas import (
    ChatRequest,
    CompletionRequest,
    effective_seed,
    effective_temperature,
    effective_top_p,
)
from server.api.schemas import ModelList, ModelOut, prompt_fields, quality_out
from server.engines.request import SamplingParams
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
        top_p=effective_top_p(body.top_p), top_k=max(body.top_k, 0), seed=effective_seed(body.seed),
        stop=tuple(body.stop_list()), n=body.n,
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
    extensions.check(body)
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    if body.prompt_logprobs is not None:  # vLLM's extension: the prompt's logprobs without echo
        names = {**names, "prompt_logprobs": "prompt_logprobs"}
        echo_logprobs = max(echo_logprobs or 0, body.prompt_logprobs)
    max_tokens = min(16, rt.settings.max_new_tokens) if body.max_tokens is None else body.max_tokens
    if "max_tokens" not in body.model_fields_set:  # the default never exceeds the server's limit
        max_tokens = min(max_tokens, rt.settings.max_new_tokens)
    logprobs = 0 if body.logprobs is None and extensions.needs_tokens(body) else body.logprobs
    params = _params(rt, body, max(max_tokens, 1), names, logprobs=logprobs, prompt_logprobs=echo_logprobs,
                     response_format=await format_spec(body.response_format, rt.tokenizer, stop=body.stop_list()))
    if max_tokens == 0:  # scoring: the one token the engine makes is dropped (openai_completions)
        params = dataclasses.replace(params, min_tokens=0)
    return await openai_completions.respond(body, request, rt, params, names)


async def start_chat(rt: Runtime, body: ChatRequest,
                     id_prefix: str = "chatcmpl") -> tuple[chat_run.ChatRun, generation.Call]:
    """Check, plan (tools), render, tokenise and submit a chat request (also /v1/responses')."""
    for name in ("max_tokens", "max_completion_tokens"):  # both are checked, whichever is used
        value = getattr(body, name)
        if value is not None and value > rt.settings.max_new_tokens:
            raise ApiError(422, "validation_error", f"{name}: must be <= {rt.settings.max_new_tokens}", param=name)
    extensions.check(body)
    tools.check_messages(body.messages, body.continue_final_message)
    template_kwargs = tools.check_template_kwargs(body.chat_template_kwargs)
    max_tokens = body.max_completion_tokens or body.max_tokens or min(rt.settings.max_new_tokens, 512)
    names = {**CHAT_NAMES, "max_new_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
             "logprobs": "top_logprobs" if body.top_logprobs else "logprobs"}
    if body.prompt_logprobs is not None:
        names["prompt_logprobs"] = "prompt_logprobs"
    k = body.top_logprobs or 0
    json_format = await format_spec(body.response_format, rt.tokenizer, stop=body.stop_list())
    plan = await tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls, rt.tokenizer,
                            stop=body.stop_list(), json_format=json_format is not None,
                            strict_auto=rt.settings.engine == "native")
    logprobs = k if body.logprobs else (0 if extensions.needs_tokens(body) else None)
    params = _params(rt, body, max_tokens, names, logprobs=logprobs, prompt_logprobs=body.prompt_logprobs,
                     response_format=plan.response_format or json_format)
    task_chat = body.model != BASE and not plan.active  # with tools a task is rendered as base (chat_run)
    special = task_chat if body.add_special_tokens is None else body.add_special_tokens
    call = await generation.prepare(rt, body.model, chat_run.render_fn(rt, body, plan, special, template_kwargs),
                                    params, id_prefix=id_prefix, names=names, prompt_field="messages",
                                    special_tokens=special,
                                    cache_salt=body.cache_salt)
    generation.submit(rt, call)
    run = chat_run.ChatRun(body, plan, task_chat, k, extensions.token_text(rt.tokenizer, body),
                           chat_run.echo_prefix(body))
    return run, call


@router.post("/chat/completions", responses={**SSE_200, **OPENAI_ERRORS["generate"]},
             description=ROUTE_DESCRIPTIONS["chat"])
async def chat_completions(body: ChatRequest, request: Request, rt: RuntimeDep):
    run, call = await start_chat(rt, body)
    created = int(time.time())
    prompt_ids = list(call.req.prompt_ids)
    if not body.stream:
        choices = chat_run.whole(run, await generation.collect(request, call))
        out: dict[str, Any] = {"id": call.req.id, "object": "chat.completion", "created": created, "model": body.model,
                               "choices": choices, "usage": usage(run.finals)}
        if body.return_token_ids:
            out["prompt_token_ids"] = prompt_ids
        if body.prompt_logprobs is not None:
            entries = next((f.prompt_logprobs for f in run.finals if f.prompt_logprobs is not None), None)
            out["prompt_logprobs"] = extensions.prompt_logprobs(run.text_of, entries, prompt_ids)
        if body.return_prompt_text:
            out["prompt_text"] = call.prompt_text
        return out
    base = {"id": call.req.id, "object": "chat.completion.chunk", "created": created, "model": body.model}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = extensions.continuous(body)
    counts = [0] * body.n

    async def stream() -> AsyncIterator[bytes]:
        first = True
        async for index, delta, finish, logprobs, ids in chat_run.deltas(request, run, call):
            counts[index] += len(ids)
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if body.return_token_ids:
                choice["token_ids"] = ids
            chunk: dict[str, Any] = {**base, "choices": [choice]}
            if first and body.return_token_ids:
                chunk["prompt_token_ids"] = prompt_ids
            if first and body.return_prompt_text:
                chunk["prompt_text"] = call.prompt_text
            if continuous:
                chunk["usage"] = extensions.running_usage(len(prompt_ids), counts[index])
            first = False
            yield generation.sse(json.dumps(chunk))
        if include_usage:
            yield generation.sse(json.dumps({**base, "choices": [], "usage": usage(run.finals)}))
        yield generation.sse("[DONE]")

    return generation.stream_response(request, stream())


def _model(rt: Runtime, record: TaskRecord | None = None) -> ModelOut:
    if record is None:
        return ModelOut(id=BASE, created=int(rt.started_at), owned_by="polyserve", root=rt.backbone.name)
    return ModelOut(id=record.id, created=int(record.created_at), owned_by="polyserve", root=rt.backbone.name,
                    parent=BASE, **prompt_fields(record), description=record.description,
                    quality=quality_out(record))


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
