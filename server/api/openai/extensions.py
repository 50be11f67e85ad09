"""vLLM's request extensions that polyserve honours on both OpenAI routes (pure functions).

    truncate_prompt_tokens N   the prompt keeps N tokens (truncation_side left, the default: the
                               last N; right: the first N); -1: the server's prompt limit
                               (POLYSERVE_MAX_PROMPT_TOKENS); applied before the limit is checked
    stream_options.continuous_usage_stats   with include_usage, every chunk carries `usage`: the
                               prompt's tokens and that choice's completion tokens so far
    return_token_ids           `prompt_token_ids` and each choice's `token_ids` (streaming: the
                               prompt's on the first chunk, each chunk's new tokens on it)
    prompt_logprobs k          vLLM's list: None for the first token, then {token id: {"logprob",
                               "rank", "decoded_token"}} of the token and the k most likely (rank:
                               its place among them, null when outside them); not when streaming
    return_tokens_as_token_ids logprob tokens written `token_id:N`
    return_prompt_text         `prompt_text`: the rendered prompt (streaming: on the first chunk)
Counting and ids need every generated token: the engine is asked for logprobs with no
alternatives (k = 0) when the client did not ask for logprobs itself; they are not returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from server.api.errors import ApiError
from server.api.openai.format import TokenText, clamp
from server.api.openai.schemas import ChatRequest, CompletionRequest
from server.engines.request import TokenLogprob


def truncated(ids: list[int], body: CompletionRequest | ChatRequest, limit: int) -> list[int]:
    n = body.truncate_prompt_tokens
    if n is None:
        return ids
    n = limit if n == -1 else n
    if n >= len(ids):
        return ids
    return ids[:n] if body.truncation_side == "right" else ids[len(ids) - n:]


CODE = "invalid_extension"  # a combination of vLLM's extensions that is refused


def check(body: CompletionRequest | ChatRequest) -> None:
    if body.truncate_prompt_tokens == 0:
        raise ApiError(400, "invalid_request", "truncate_prompt_tokens: must be -1 or at least 1",
                       param="truncate_prompt_tokens", code=CODE)
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(400, "invalid_request", "prompt_logprobs: not available when streaming (as vLLM)",
                       param="prompt_logprobs", code=CODE)


def continuous(body: CompletionRequest | ChatRequest) -> bool:
    options = body.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def needs_tokens(body: CompletionRequest | ChatRequest) -> bool:
    """The answer needs every generated token (ids or counts) from the engine."""
    return bool(body.return_token_ids) or (body.stream and continuous(body))


def running_usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class IdTokenText(TokenText):
    """return_tokens_as_token_ids: a logprob entry names its token `token_id:N` (bytes unchanged)."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def token_text(tokenizer: Any, body: CompletionRequest | ChatRequest) -> TokenText:
    return IdTokenText(tokenizer) if body.return_tokens_as_token_ids else TokenText(tokenizer)


def prompt_logprobs(text_of: TokenText, entries: Sequence[TokenLogprob | None] | None,
                    ids: Sequence[int]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for token_id, entry in zip(ids, entries or [None] * len(ids), strict=True):
        if entry is None:
            out.append(None)
            continue
        ranked = [t for t, _ in entry.top]
        item = {str(token_id): {"logprob": clamp(entry.logprob),
                                "rank": ranked.index(token_id) + 1 if token_id in ranked else None,
                                "decoded_token": text_of(token_id)}}
        for rank, (t, lp) in enumerate(entry.top, start=1):
            item.setdefault(str(t), {"logprob": clamp(lp), "rank": rank, "decoded_token": text_of(t)})
        out.append(item)
    return out
