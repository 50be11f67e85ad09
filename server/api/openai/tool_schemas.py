"""Wire models of tool calling on /v1/chat/completions (and /v1/responses): a function tool, a
named tool_choice, an assistant message's tool call. What they do: server.api.openai.tools."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.api.openai.response_format import MAX_SCHEMA_CHARS
from server.api.wire import Bool

MAX_TOOLS = 128  # OpenAI's bound
MAX_TOOLS_CHARS = 4 * MAX_SCHEMA_CHARS  # every tool's schema together (the required grammar holds them all)
MAX_TOOL_CALLS = 64  # calls in one assistant message
MAX_CALL_ID = 128
MAX_ARGUMENT_CHARS = 65536
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=TOOL_NAME, description="letters, digits, _ . - (at most 64)")
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON Schema of the arguments "
                                              f"(an object; at most {MAX_SCHEMA_CHARS} characters as compact JSON, "
                                              f"{MAX_TOOLS_CHARS} for all the tools together); none: no arguments")
    strict: Bool | None = Field(default=None, description="accepted; required and named calls always follow "
                                "the schema")


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = Field(description="only function tools")
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=TOOL_NAME)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=TOOL_NAME)
    arguments: str = Field(max_length=MAX_ARGUMENT_CHARS, description="a JSON object, as text")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=MAX_CALL_ID)
    type: Literal["function"]
    function: CalledFunction
