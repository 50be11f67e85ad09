"""`response_format` on the OpenAI routes: the wire models and their check (400 naming the field).

    {"type": "text"}                                            plain text (the default)
    {"type": "json_object"}                                     any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
                                                                JSON valid against `schema`
The schema is compiled for the served tokenizer before the request is queued (an invalid schema
is a 400 naming `response_format`); the engines enforce it (engines/grammar.py). A stop string
could cut the JSON short and still say "stop", so `stop` with a JSON format is refused.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.api.errors import ApiError
from server.api.wire import Bool
from server.engines.grammar import ResponseFormat as FormatSpec
from server.engines.grammar import check_format

MAX_SCHEMA_CHARS = 32768
# what JSON Schema cannot say about a request (an unusable schema, a field that conflicts with the format)
CODE = "invalid_response_format"


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(default=None, max_length=4096)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema",
                                    description="a JSON Schema; {} accepts any JSON value")
    strict: Bool | None = Field(default=None, description="the output always follows the schema (true or not)")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, description="with type json_schema")


async def format_spec(value: ResponseFormat | None, tokenizer: Any, *, stop: list[str]) -> FormatSpec | None:
    """The engines' response_format, or None for plain text; ApiError 400 naming the field. The
    schema is compiled off the event loop (the tokenizer's grammar view is built on first use)."""
    if value is None or value.type == "text":
        if value is not None and value.json_schema is not None:
            raise ApiError(400, "invalid_request", "response_format.json_schema: only with type json_schema",
                           param="response_format.json_schema", code=CODE)
        return None
    if value.type == "json_object":
        if value.json_schema is not None:
            raise ApiError(400, "invalid_request", "response_format.json_schema: only with type json_schema",
                           param="response_format.json_schema", code=CODE)
        spec: FormatSpec = ("json_object", "")
    else:
        if value.json_schema is None:
            raise ApiError(400, "invalid_request", "response_format.json_schema: required with type json_schema",
                           param="response_format.json_schema", code=CODE)
        text = json.dumps(value.json_schema.schema_, sort_keys=True, separators=(",", ":"))
        if len(text) > MAX_SCHEMA_CHARS:
            raise ApiError(400, "invalid_request", f"response_format: the schema has more than {MAX_SCHEMA_CHARS} "
                           "characters", param="response_format", code=CODE)
        spec = ("json_schema", text)
    if stop:
        raise ApiError(400, "invalid_request", "stop: not supported with a JSON response_format (a stop string "
                       "would cut the JSON short)", param="stop", code=CODE)
    error = await asyncio.to_thread(check_format, spec, tokenizer)
    if error is not None:
        raise ApiError(400, "invalid_request", f"response_format: invalid schema: {error}", param="response_format",
                       code=CODE)
    return spec
