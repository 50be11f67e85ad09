"""POST /v1/responses: the part of OpenAI's Responses API that agent clients use (openai-agents'
default model), served by the chat path (server.api.openai.chat_run) it is translated into.

    input                a string (one user message) or items: messages (role user / system /
                         developer / assistant; text or input_text / output_text parts),
                         function_call (an assistant's call), function_call_output (its result)
    instructions         a system message first
    tools                function tools {type, name, description, parameters, strict}
    tool_choice          none | auto | required | {type: function, name}  (server.api.openai.tools)
    text.format          text | json_object | json_schema {name, schema, strict}
    max_output_tokens, temperature, top_p, top_logprobs, parallel_tool_calls, stream
    output               a message item (output_text) and/or function_call items; status
                         "incomplete" (incomplete_details.reason max_output_tokens) when cut short
    stream               Responses events (response.created, response.in_progress,
                         response.output_item.added, response.content_part.added,
                         response.output_text.delta / .done, response.function_call_arguments.delta
                         / .done, response.content_part.done, response.output_item.done,
                         response.completed or response.incomplete), each with its sequence_number
    refused (400)        store: true and previous_response_id / conversation (this server keeps no
                         responses: every request carries its whole input), background: true,
                         prompt templates, truncation "auto", max_tool_calls, non-function tools,
                         image / file / audio parts, reasoning items
    ignored              metadata, user, safety_identifier, prompt_cache_key, prompt_cache_retention,
                         service_tier, include, reasoning, stream_options (nothing here produces
                         what they ask for, or they do not change the answer)
Errors are OpenAI's shape; a field of the chat path an error names is named as Responses names it.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from adapters_store.lora.mix import MAX_MIX_CHARS, MIX_SCHEMA_EXTRA, MODEL_ID_PATTERN
from server.api import generation
from server.api.api_docs import OPENAI_ERRORS, SSE_200
from server.api.deps import ApiKey, RuntimeDep
from server.api.errors import ApiError
from server.api.openai import chat_run
from server.api.openai.format import usage
from server.api.openai.response_format import JsonSchemaFormat
from server.api.openai.schemas import MAX_LOGPROBS, ChatRequest, OnlyFalse
from server.api.openai.tool_schemas import MAX_ARGUMENT_CHARS, MAX_CALL_ID, MAX_TOOLS, TOOL_NAME
from server.api.wire import Bool, Number

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[ApiKey])

MAX_ITEMS = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = Field(default=None, max_length=0, description="output_text: none")
    logprobs: list[Any] | None = Field(default=None, description="ignored (an earlier answer's)")


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: str = Field(description="an earlier answer's refusal: not shown to the model")


class MessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart | RefusalPart] = Field(description="text, or input_text / output_text parts")
    id: str | None = Field(default=None, max_length=256, description="ignored")
    status: str | None = Field(default=None, max_length=32, description="ignored")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_CALL_ID)
    name: str = Field(pattern=TOOL_NAME)
    arguments: str = Field(max_length=MAX_ARGUMENT_CHARS, description="a JSON object, as text")
    id: str | None = Field(default=None, max_length=256, description="ignored")
    status: str | None = Field(default=None, max_length=32, description="ignored")


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_CALL_ID)
    output: str | list[InputText]
    id: str | None = Field(default=None, max_length=256, description="ignored")
    status: str | None = Field(default=None, max_length=32, description="ignored")

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(_Strict):
    type: Literal["function"] = Field(description="only function tools")
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = Field(default=None, description="as chat's tools[].function.parameters")
    strict: Bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)


class TextFormatPlain(_Strict):
    type: Literal["text", "json_object"]


class TextFormatSchema(JsonSchemaFormat):
    type: Literal["json_schema"]


class TextConfig(_Strict):
    format: TextFormatPlain | TextFormatSchema | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(default=None, description="ignored")


class ResponsesRequest(_Strict):
    model: str = Field(pattern=MODEL_ID_PATTERN, max_length=MAX_MIX_CHARS, json_schema_extra=MIX_SCHEMA_EXTRA,
                       description="a task id, `base`, or a mix `mix:ID=W,...`", examples=["base"])
    input: Annotated[str, Field(min_length=1)] | Annotated[list[Item], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: Bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1), Number] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0), Number] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0), Number] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Number] | None = None
    text: TextConfig | None = None
    stream: Bool = False
    # refused unless absent: this server keeps no responses
    store: OnlyFalse | None = Field(default=None, description="only false: no response is stored")
    previous_response_id: None = Field(default=None, description="refused: send the whole input")
    conversation: None = Field(default=None, description="refused: send the whole input")
    background: OnlyFalse | None = Field(default=None, description="only false")
    prompt: None = Field(default=None, description="refused (no stored prompts)")
    truncation: Literal["disabled"] | None = Field(default=None, description="only disabled")
    max_tool_calls: None = Field(default=None, description="refused")
    # ignored
    metadata: dict[str, str] | None = Field(default=None, max_length=16, description="ignored")
    user: str | None = Field(default=None, max_length=256, description="ignored")
    safety_identifier: str | None = Field(default=None, max_length=256, description="ignored")
    prompt_cache_key: str | None = Field(default=None, max_length=256, description="ignored")
    prompt_cache_retention: str | None = Field(default=None, max_length=32, description="ignored")
    service_tier: str | None = Field(default=None, max_length=64, description="ignored")
    include: list[Annotated[str, Field(max_length=128)]] | None = Field(default=None, max_length=16,
                                                                         description="ignored")
    reasoning: dict[str, Any] | None = Field(default=None, description="ignored (no reasoning model)")
    stream_options: dict[str, Bool] | None = Field(default=None, description="ignored")


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call], "_calls": True})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    for m in out:
        m.pop("_calls", None)
    return out


def to_chat(body: ResponsesRequest) -> ChatRequest:
    fmt: dict[str, Any] | None = None
    if body.text is not None and body.text.format is not None:
        f = body.text.format
        if isinstance(f, TextFormatSchema):
            fmt = {"type": "json_schema",
                   "json_schema": f.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)}
        else:
            fmt = {"type": f.type}
    choice: Any = body.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    values: dict[str, Any] = {
        "model": body.model, "messages": _messages(body), "stream": body.stream,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in body.tools] if body.tools else None,
        "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens, "response_format": fmt,
        "logprobs": body.top_logprobs is not None, "top_logprobs": body.top_logprobs,
    }
    if body.temperature is not None:
        values["temperature"] = body.temperature
    if body.top_p is not None:
        values["top_p"] = body.top_p
    try:
        return ChatRequest.model_validate({k: v for k, v in values.items() if v is not None})
    except ValueError as err:  # pydantic's ValidationError: a shape the chat path refuses
        raise ApiError(400, "invalid_request", f"input: {str(err).splitlines()[-1][:200]}", param="input") from None


def _param(name: str | None) -> str | None:
    """A chat field an error names, as Responses names it."""
    if name is None:
        return None
    if name.startswith("messages"):
        return "input"
    if name.startswith("tools.") and ".function." in name:
        return name.replace(".function.", ".", 1)
    if name == "tool_choice.function.name":
        return "tool_choice.name"
    key = name.split(".")[0] if name.startswith("response_format") else name
    return {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
            "top_logprobs": "top_logprobs"}.get(key, name)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _envelope(body: ResponsesRequest, rid: str, created: float, status: str) -> dict[str, Any]:
    fmt = (body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format
           else {"type": "text"})
    choice: Any = body.tool_choice or ("auto" if body.tools else "none")
    if isinstance(choice, NamedFunction):
        choice = choice.model_dump()
    return {"id": rid, "object": "response", "created_at": created, "model": body.model, "status": status,
            "output": [], "error": None, "incomplete_details": None, "instructions": body.instructions,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p, "max_output_tokens": body.max_output_tokens,
            "tool_choice": choice, "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "text": {"format": fmt}, "truncation": "disabled", "store": False, "background": False,
            "previous_response_id": None, "reasoning": None, "usage": None}


def _usage(finals: list) -> dict[str, Any]:
    u = usage(finals)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _text_item(mid: str, text: str, logprobs: list, status: str) -> dict[str, Any]:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _call_item(fid: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": fid, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _finish(envelope: dict[str, Any], finish: str | None) -> None:
    if finish == "length":
        envelope["status"], envelope["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        envelope["status"] = "completed"


@router.post("/responses", responses={**SSE_200, **OPENAI_ERRORS["generate"]})
async def responses(body: ResponsesRequest, request: Request, rt: RuntimeDep):
    from server.api.openai.routes import start_chat  # the chat route's planning and submission

    chat = to_chat(body)
    try:
        run, call = await start_chat(rt, chat, id_prefix="resp")
    except ApiError as err:
        err.param = _param(err.param)
        raise
    rid, created = call.req.id.replace("resp-", "resp_", 1), time.time()
    envelope = _envelope(body, rid, created, "in_progress")
    if not body.stream:
        (choice,) = chat_run.whole(run, await generation.collect(request, call))
        message = choice["message"]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        if message["content"]:
            logprobs = (choice["logprobs"] or {}).get("content") or []
            envelope["output"].append(_text_item(_new_id("msg"), message["content"], logprobs, status))
        for c in message.get("tool_calls") or ():
            envelope["output"].append(_call_item(_new_id("fc"), c, "completed"))
        _finish(envelope, choice["finish_reason"])
        envelope["usage"] = _usage(run.finals)
        return envelope

    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    async def stream() -> AsyncIterator[bytes]:
        yield event("response.created", response=envelope)
        yield event("response.in_progress", response=envelope)
        output: list[dict[str, Any]] = []
        text_at: int | None = None  # the message item's output index
        text, text_logprobs = "", cast(list[dict[str, Any]], [])
        calls: dict[int, int] = {}  # chat tool-call index -> output index
        finish = None
        async for _, delta, reason, logprobs, _ids in chat_run.deltas(request, run, call):
            piece = delta.get("content") or ""
            if piece:
                if text_at is None:
                    text_at = len(output)
                    output.append(_text_item(_new_id("msg"), "", [], "in_progress"))
                    item = {**output[text_at], "content": []}
                    yield event("response.output_item.added", output_index=text_at, item=item)
                    yield event("response.content_part.added", item_id=item["id"], output_index=text_at,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                       "logprobs": []})
                entries = (logprobs or {}).get("content") or []
                text += piece
                text_logprobs.extend(entries)
                yield event("response.output_text.delta", item_id=output[text_at]["id"], output_index=text_at,
                            content_index=0, delta=piece, logprobs=entries)
            for tc in delta.get("tool_calls") or ():
                fn = tc.get("function") or {}
                if tc["index"] not in calls:
                    calls[tc["index"]] = len(output)
                    output.append({"type": "function_call", "id": _new_id("fc"), "call_id": tc["id"],
                                   "name": fn.get("name", ""), "arguments": "", "status": "in_progress"})
                    yield event("response.output_item.added", output_index=calls[tc["index"]],
                                item={**output[calls[tc["index"]]]})
                at = calls[tc["index"]]
                if fn.get("arguments"):
                    output[at]["arguments"] += fn["arguments"]
                    yield event("response.function_call_arguments.delta", item_id=output[at]["id"], output_index=at,
                                delta=fn["arguments"])
            if reason is not None:
                finish = reason
        status = "incomplete" if finish == "length" else "completed"
        for at, item in enumerate(output):
            if item["type"] == "message":
                item["content"][0].update(text=text, logprobs=text_logprobs)
                item["status"] = status
                part = item["content"][0]
                yield event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                            text=text, logprobs=text_logprobs)
                yield event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                            part=part)
            else:
                item["status"] = "completed"
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                            name=item["name"], arguments=item["arguments"])
            yield event("response.output_item.done", output_index=at, item=item)
        envelope["output"] = output
        _finish(envelope, finish)
        envelope["usage"] = _usage(run.finals)
        yield event("response.incomplete" if finish == "length" else "response.completed", response=envelope)

    return generation.stream_response(request, stream())
