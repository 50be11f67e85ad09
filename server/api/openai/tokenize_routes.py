"""vLLM's utility endpoints (shapes: server.api.openai.tokenize_schemas), behind the same API keys as /v1/*:

    POST /tokenize     a prompt as /v1/completions tokenises it, or messages as
                       /v1/chat/completions renders and tokenises them (a task: its prompt format)
    POST /detokenize   token ids -> text (special tokens kept, as vLLM's decode)
    GET  /version      polyserve's version

`model` must be `base` or a servable task (404 otherwise, as on /v1/models/{model}). Errors come in
OpenAI's shape, as vLLM answers them.
"""

from __future__ import annotations

import asyncio
from importlib import metadata

from fastapi import APIRouter

from server.api.api_docs import OPENAI_ERRORS
from server.api.deps import ApiKey, RuntimeDep
from server.api.errors import ApiError
from server.api.openai import chat
from server.api.openai.tokenize_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from server.api.validation import check_in_vocab, vocab_size
from server.registry.tasks import BASE
from server.tenancy import tenants
from server.wiring.runtime import Runtime

router = APIRouter(tags=["vllm"], dependencies=[ApiKey])


def version() -> str:
    try:
        return metadata.version("polyserve")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def _prompt_format(rt: Runtime, model: str) -> str:
    """The model's prompt format; 404 unless it is `base` or a servable task. Blocking."""
    tenant = tenants.current()  # someone else's task is not found
    if model != BASE:
        try:
            record = rt.registry.get(model, tenant)
        except (ValueError, KeyError):
            record = None
        if record is None or not rt.registry.servable(record):
            raise ApiError(404, "not_found", f"model {model[:64]!r} not found", param="model")
    return rt.registry.prompt_format(model, tenant)


def _max_model_len(rt: Runtime) -> int:
    config = getattr(rt.backbone.model, "config", None)
    positions = getattr(config, "max_position_embeddings", None)
    return int(positions) if positions else rt.settings.max_prompt_tokens + rt.settings.max_new_tokens


def _render(rt: Runtime, body: TokenizeChatRequest, prompt_format: str) -> str:
    if body.model != BASE:
        return chat.render_for_task(body.messages, prompt_format)
    if getattr(rt.tokenizer, "chat_template", None) is None:
        raise ValueError("messages: the backbone has no chat template")
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    return rt.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=body.add_generation_prompt)


@router.post("/tokenize", response_model=TokenizeResponse, responses=OPENAI_ERRORS["lookup"] | {
    400: OPENAI_ERRORS["generate"][400], 413: OPENAI_ERRORS["generate"][413]})
async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, rt: RuntimeDep) -> TokenizeResponse:
    def work() -> list[int]:
        prompt_format = _prompt_format(rt, body.model)
        if isinstance(body, TokenizeCompletionRequest):
            text, special = body.prompt, body.add_special_tokens
        else:
            try:
                text = _render(rt, body, prompt_format)
            except ValueError as err:
                raise ApiError(400, "invalid_request", str(err), param="messages") from None
            special = body.model != BASE if body.add_special_tokens is None else body.add_special_tokens
        return list(rt.tokenizer(text, add_special_tokens=special).input_ids)

    ids = await asyncio.to_thread(work)
    strs = rt.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=_max_model_len(rt), tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=OPENAI_ERRORS["lookup"] | {
    400: OPENAI_ERRORS["generate"][400]})
async def detokenize(body: DetokenizeRequest, rt: RuntimeDep) -> DetokenizeResponse:
    check_in_vocab("tokens", body.tokens, vocab_size(rt))
    await asyncio.to_thread(_prompt_format, rt, body.model)
    return DetokenizeResponse(prompt=await asyncio.to_thread(rt.tokenizer.decode, body.tokens))


@router.get("/version", response_model=VersionResponse, responses=OPENAI_ERRORS["read"])
async def get_version() -> VersionResponse:
    return VersionResponse(version=version())
