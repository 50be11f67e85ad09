"""Wire schemas of vLLM's utility endpoints (POST /tokenize, POST /detokenize, GET /version), in
vLLM's request and response shapes, so clients written for vLLM (its benchmark client among
them) work unchanged. `model` is a task id or `base` (vLLM's default: the served model).

    /tokenize    {"model", "prompt", "add_special_tokens": true, "return_token_strs": false}
                 or {"model", "messages", "add_generation_prompt": true, "add_special_tokens"}
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"model", "tokens"} -> {"prompt"}
    /version     -> {"version"}
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from adapters_store.store.ids import TASK_ID_PATTERN
from server.api.openai.schemas import ChatMessage, TokenId
from server.api.wire import Bool

MAX_DETOKENIZE_TOKENS = 1 << 16
Model = Annotated[str, Field(default="base", pattern=TASK_ID_PATTERN, max_length=64,
                             description="a task id, or `base`")]


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Model = "base"
    prompt: str = Field(description="the text, tokenised as /v1/completions does")
    add_special_tokens: Bool = True
    return_token_strs: Bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Model = "base"
    messages: list[ChatMessage] = Field(min_length=1, description="rendered as /v1/chat/completions does")
    add_generation_prompt: Bool = Field(default=True, description="base: the template's assistant prompt "
                                        "(chat completions always add it); a task's format has none")
    add_special_tokens: Bool | None = Field(default=None, description="default as /v1/chat/completions: a task "
                                            "yes, base no (its template has them)")
    return_token_strs: Bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Model = "base"
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_TOKENS, description="token ids of the vocabulary")


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
