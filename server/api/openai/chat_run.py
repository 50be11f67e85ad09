"""A chat request from its plan to its answer, shared by /v1/chat/completions and /v1/responses.

    ChatRun          what the route decided before submitting: the tool plan (tools.ToolPlan),
                     how the conversation is rendered, whether a task's separator is stripped,
                     vLLM's echo prefix
    render_fn        the prompt for the task's prompt format: base, or tools in play -> the chat
                     template (tools.render; chat.render_with_template when nothing else is
                     asked for), a task -> its training format; truncate_prompt_tokens applied
    whole(...)       every choice's message (content, tool_calls), finish_reason, logprobs, ids
    deltas(...)      the stream as OpenAI chat deltas: (choice, delta, finish_reason, logprobs,
                     token ids); named and required calls stream their arguments as they come
                     (tools.RequiredSplitter), auto calls come whole when the choice ends (its
                     text streams up to a call)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from adapters_store.backbone.prompt import strip_separator
from server.api import generation
from server.api.openai import chat, extensions, tools
from server.api.openai.format import TokenText, chat_logprobs, finish_reason
from server.api.openai.schemas import ChatRequest
from server.engines.request import FinalEvent
from server.registry.tasks import BASE
from server.wiring.runtime import Runtime


@dataclass
class ChatRun:
    body: ChatRequest
    plan: tools.ToolPlan
    task_chat: bool  # a task's own format: its separator leads the answer
    k: int  # top logprobs
    text_of: TokenText
    echo: str = ""  # vLLM's echo: the last assistant message's content starts the answer
    finals: list[FinalEvent] = field(default_factory=list)


def plain_template(body: ChatRequest, plan: tools.ToolPlan) -> bool:
    """Nothing beyond the plain chat template is asked for."""
    return (not plan.active and body.add_generation_prompt and not body.continue_final_message
            and not body.chat_template_kwargs and body.documents is None
            and all(m.role != "tool" and not m.tool_calls for m in body.messages))


def render_fn(rt: Runtime, body: ChatRequest, plan: tools.ToolPlan, special: bool,
              template_kwargs: dict[str, Any]) -> Callable[[str], str | list[int]]:
    def render(prompt_format: str) -> str | list[int]:
        if body.model == BASE or plan.active:
            if plain_template(body, plan):
                text = chat.render_with_template(rt.tokenizer, body.messages)
            else:
                text = tools.render(rt.tokenizer, body.messages, plan.tools if plan.active else [],
                                    add_generation_prompt=(body.add_generation_prompt
                                                           and not body.continue_final_message),
                                    continue_final_message=body.continue_final_message,
                                    template_kwargs=template_kwargs, documents=body.documents)
        else:
            text = chat.render_for_task(body.messages, prompt_format)
        if body.truncate_prompt_tokens is None:
            return text
        ids = list(rt.tokenizer(text, add_special_tokens=special).input_ids)
        return extensions.truncated(ids, body, rt.settings.max_prompt_tokens)

    return render


def echo_prefix(body: ChatRequest) -> str:
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


def whole(run: ChatRun, choices: list[generation.Choice]) -> list[dict[str, Any]]:
    body, out = run.body, []
    for c in choices:
        assert c.final is not None
        run.finals.append(c.final)
        text = strip_separator(c.text) if run.task_chat else c.text
        parsed = tools.parse(run.plan, text, c.final.finish_reason == "stop")
        content = parsed.content
        if run.echo:
            content = run.echo + (content or "")
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if parsed.calls:
            message["tool_calls"] = parsed.calls
        choice = {"index": c.index, "message": message,
                  "logprobs": chat_logprobs(run.text_of, c.logprobs, run.k) if body.logprobs else None,
                  "finish_reason": tools.finish_reason(run.plan, parsed, finish_reason(c.final.finish_reason))}
        if body.return_token_ids:
            choice["token_ids"] = [e.token_id for e in c.logprobs]
        out.append(choice)
    return out


Delta = tuple[int, dict[str, Any], str | None, Any, list[int]]


def _whole_calls(calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]}


async def deltas(request: Request, run: ChatRun, call: generation.Call) -> AsyncIterator[Delta]:
    body, plan, n = run.body, run.plan, run.body.n
    for i in range(n):
        yield i, {"role": "assistant", "content": ""}, None, None, []
    if run.echo:
        for i in range(n):
            yield i, {"content": run.echo}, None, None, []
    leading = [run.task_chat] * n  # the separator can only lead a choice's first text
    texts = [""] * n
    splitters = [tools.StreamSplitter() for _ in range(n)]
    lists = [tools.RequiredSplitter() for _ in range(n)]
    call_ids = [tools.new_call_id() for _ in range(n)]
    pending: list[list[int]] = [[] for _ in range(n)]
    async for event in generation.events(request, call):
        i = event.index
        text = event.text
        if leading[i] and text:
            text, leading[i] = strip_separator(text), False
        pending[i].extend(e.token_id for e in event.logprobs or ())
        logprobs = chat_logprobs(run.text_of, event.logprobs, run.k) if body.logprobs and event.logprobs else None
        final = isinstance(event, FinalEvent)
        delta: dict[str, Any] = {}
        if plan.mode == "named":
            if text and not texts[i]:
                yield i, {"tool_calls": [{"index": 0, "id": call_ids[i], "type": "function",
                                          "function": {"name": plan.name, "arguments": ""}}]}, None, None, []
            if text:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        elif plan.mode == "required":
            entries = lists[i].feed(text) if text else []
            if entries:
                delta = {"tool_calls": entries}
        elif plan.mode == "auto":
            out = splitters[i].feed(text)
            if out:
                delta = {"content": out}
        elif plan.mode == "none" and text:
            delta = {"content": text}
        texts[i] += text
        if delta or logprobs or (pending[i] and body.return_token_ids and not final):
            ids, pending[i] = pending[i], []
            yield i, delta, None, logprobs, ids
        if isinstance(event, FinalEvent):
            run.finals.append(event)
            parsed = tools.parse(plan, texts[i], event.finish_reason == "stop")
            if plan.mode == "required":  # what did not stream: unexpected text, or a list cut short
                done = lists[i].streamed
                if parsed.calls[done:]:
                    rest = [{"index": done + j, **c} for j, c in enumerate(parsed.calls[done:])]
                    yield i, {"tool_calls": rest}, None, None, []
                elif not parsed.calls and not lists[i].streamed and not lists[i].in_args:
                    yield i, {"content": texts[i]}, None, None, []
            elif plan.mode == "auto":
                if parsed.calls:
                    yield i, _whole_calls(parsed.calls), None, None, []
                elif splitters[i].rest():
                    yield i, {"content": splitters[i].rest()}, None, None, []
            ids, pending[i] = pending[i], []
            yield i, {}, tools.finish_reason(plan, parsed, finish_reason(event.finish_reason)), None, ids
