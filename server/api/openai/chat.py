"""How a chat conversation becomes a prompt (pure functions).

    model = base   the backbone's own chat template (its special tokens included), with a
                   generation prompt for the assistant's turn; `developer` is sent as `system`
    model = task   the task's adapter was trained on one input -> one answer in the prompt format
                   its record names (adapters_store.backbone.prompt), so the conversation is rendered into that
                   format: the text of the LAST USER message is the input (a conversation
                   without one is refused); every other message (system, developer, earlier
                   turns, anything after it) is not shown to the adapter (documented as
                   ignored). The answer is returned without the format's separator, exactly as
                   POST /v1/generate returns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from adapters_store.backbone.prompt import format_prompt_as
from server.api.openai.schemas import ChatMessage


class EmptyInput(ValueError):
    """A conversation with nothing to answer (no schema can say which message is the input)."""

    code = "empty_input"


def task_input(messages: Sequence[ChatMessage]) -> str:
    """The input a task sees: the text of the last user message (there must be one)."""
    for message in reversed(messages):
        if message.role == "user":
            if not message.text().strip():  # the task's format around nothing: a made-up answer
                raise EmptyInput("messages: the last user message (the task's input) is empty")
            return message.text()
    raise ValueError("messages: chatting with a task needs a user message (its input)")


def render_for_task(messages: Sequence[ChatMessage], prompt_format: str) -> str:
    return format_prompt_as(prompt_format, task_input(messages))


def render_with_template(tokenizer: Any, messages: Sequence[ChatMessage]) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: the backbone has no chat template; use /v1/completions")
    if not any(m.text().strip() for m in messages):
        raise EmptyInput("messages: every message is empty")
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
