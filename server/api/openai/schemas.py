"""Wire schemas of the OpenAI-compatible endpoints (/v1/completions, /v1/chat/completions).

Every request field falls in one of three groups (README "OpenAI compatibility" says the same):

  supported   model, prompt (a string, a token-id list, or a list of either: one row per prompt),
              messages (text content), max_tokens (0 with echo: score the prompt),
              max_completion_tokens, temperature, top_p, n, stop, seed, stream, stream_options,
              logprobs, top_logprobs (chat), logprobs: int (completions), echo, presence_penalty,
              frequency_penalty, logit_bias, best_of 1; vLLM's extensions top_k,
              repetition_penalty, ignore_eos, min_tokens, stop_token_ids,
              include_stop_str_in_output, skip_special_tokens, min_p, add_special_tokens;
              response_format (text, json_object, json_schema: server.api.openai.response_format)
  ignored     user, metadata, store, service_tier, prompt_cache_key, safety_identifier,
              parallel_tool_calls: they do not change the answer
  refused     (400 naming the field) suffix, best_of > 1, tools / functions, tool_choice and
              function_call other than "none", stop with a JSON response_format, a `tool`
              message, more prompts than POLYSERVE_MAX_PROMPTS_PER_REQUEST, max_tokens 0
              without echo, and any field not listed here
              (OpenAI answers an unrecognised argument with 400 too)

Numeric rules (vLLM's): a temperature below 1e-5 is greedy; one in [1e-5, 0.01) is raised to
0.01; a top_p below 1e-6 is raised to 1e-6 (the same answer: the most likely token alone);
repetition_penalty is at least 0.01; top_k -1 (vLLM's "off") is 0; logit_bias keys are token ids
of the backbone's vocabulary (checked against it in the route), values in [-100, 100];
min_tokens above the request's max tokens is that many (every token is generated).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from adapters_store.lora.mix import MAX_MIX_CHARS, MIX_SCHEMA_EXTRA, MODEL_ID_PATTERN
from server.api.openai.response_format import ResponseFormat
from server.api.openai.tool_schemas import (
    MAX_CALL_ID,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from server.api.wire import Bool, Number
from server.engines.request import GREEDY_TEMPERATURE

MIN_TEMPERATURE = 0.01
GREEDY_BELOW = GREEDY_TEMPERATURE  # the engines' threshold (vLLM's _SAMPLING_EPS)
MIN_TOP_P = 1e-6
MAX_LOGPROBS = 20
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 300

NonEmpty = Annotated[str, Field(min_length=1)]


def _boolean(value: Any) -> Any:
    if not isinstance(value, bool):  # Literal[False] alone takes 0
        raise PydanticCustomError("bool_type", "Input should be a valid boolean")
    return value


OnlyFalse = Annotated[Literal[False], BeforeValidator(_boolean)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0), Number]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
MAX_PROMPTS = 1024  # the schema's bound; POLYSERVE_MAX_PROMPTS_PER_REQUEST is the server's (the OpenAPI bound)
MAX_STOP_TOKEN_IDS = 64
Prompts = Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_PROMPTS)]
PromptsOfIds = Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
BIAS_KEY = r"^(0|[1-9][0-9]{0,8})$"
BiasKey = Annotated[str, Field(pattern=BIAS_KEY)]


def effective_seed(value: int | None) -> int | None:
    return None if value is None else value % 2**63


def effective_top_p(value: float) -> float:
    """(0, MIN_TOP_P) is raised to MIN_TOP_P: the same answer (the most likely token alone; its
    probability is at least 1 / vocabulary size > MIN_TOP_P), but no float32 underflow to 0."""
    return max(value, MIN_TOP_P)


def effective_temperature(value: float) -> float:
    """vLLM's rule: below GREEDY_BELOW is greedy (0, as the engine treats it too); the rest of
    (0, MIN_TEMPERATURE) is raised to MIN_TEMPERATURE."""
    if value < GREEDY_BELOW:
        return 0.0
    return max(value, MIN_TEMPERATURE)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: Bool = False
    continuous_usage_stats: Bool = Field(default=False, description="extension (vLLM): with include_usage, every "
                                         "chunk carries the usage so far")


NOT_NULL: dict[str, Any] = {"not": {"type": "null"}}


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs, the JSON part: the same as response_format (json -> json_schema,
    json_object -> json_object); regex, choice, grammar and structural tags are refused."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, json_schema_extra={"anyOf": [  # one of the two
        {"required": ["json"], "properties": {"json": NOT_NULL, "json_object": {"not": {"const": True}}}},
        {"required": ["json_object"], "properties": {"json_object": {"const": True}, "json": {"type": "null"}}}]})

    json_schema: dict[str, Any] | None = Field(default=None, alias="json", description="a JSON Schema (an object)")
    json_object: Bool | None = None
    disable_any_whitespace: Bool = Field(default=False, description="ignored: the JSON is always compact")
    disable_additional_properties: OnlyFalse = Field(default=False, description="only false")
    regex: None = Field(default=None, description="refused")
    choice: None = Field(default=None, description="refused")
    grammar: None = Field(default=None, description="refused")
    whitespace_pattern: None = Field(default=None, description="refused")
    structural_tag: None = Field(default=None, description="refused")

    def as_response_format(self) -> ResponseFormat:
        if (self.json_schema is None) == (not self.json_object):
            raise ValueError("structured_outputs: give one of json and json_object")
        if self.json_object:
            return ResponseFormat(type="json_object")
        return ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "structured_outputs",
                                                                                    "schema": self.json_schema}})


class _Common(BaseModel):
    # numbers and booleans as JSON Schema says (server.api.wire): "5" is not an integer
    model_config = ConfigDict(extra="forbid")

    model: str = Field(pattern=MODEL_ID_PATTERN, max_length=MAX_MIX_CHARS, json_schema_extra=MIX_SCHEMA_EXTRA,
                       description="a task id, `base`, or a mix `mix:ID=W,...`", examples=["base"])
    temperature: Annotated[float, Field(ge=0.0, le=2.0), Number] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0), Number] = 1.0
    top_k: Annotated[int, Field(ge=-1), Number] = Field(default=0, description="extension (vLLM): 0 or -1 = off")
    n: Annotated[int, Field(ge=1), Number] = Field(default=1, description="choices; the maximum is POLYSERVE_MAX_N")
    stop: StopString | list[StopString] | None = None
    seed: Annotated[int, Number] | None = Field(default=None, description=(
        "any integer (used modulo 2**63); choice i samples with seed + i"))
    stream: Bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0), Number] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0), Number] = 0.0
    repetition_penalty: Annotated[float, Field(ge=0.01, le=2.0), Number] = Field(
        default=1.0, description="extension (vLLM)")
    logit_bias: dict[BiasKey, Annotated[float, Field(ge=-100.0, le=100.0), Number]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS, json_schema_extra={"propertyNames": {"pattern": BIAS_KEY}},
        description="token id (as a string, below the vocabulary size) -> bias")
    # ignored: they do not change the answer
    user: str | None = Field(default=None, max_length=256, description="ignored")
    metadata: dict[str, str] | None = Field(default=None, description="ignored")
    store: Bool | None = Field(default=None, description="ignored")
    service_tier: str | None = Field(default=None, max_length=64, description="ignored")
    prompt_cache_key: str | None = Field(default=None, max_length=256, description="ignored")
    safety_identifier: str | None = Field(default=None, max_length=256, description="ignored")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description=(
        "extension (vLLM): only requests of this tenant with the same salt reuse each other's cached prompt KV"))
    # vLLM's sampling extensions (server.engines.request.SamplingParams says what each does)
    ignore_eos: Bool = Field(default=False, description="extension (vLLM): EOS does not end a choice")
    min_tokens: Annotated[int, Field(ge=0), Number] = Field(default=0, description=(
        "extension (vLLM): no EOS / stop token / stop string before this many tokens "
        "(at most the request's max tokens)"))
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS,
                                                 description="extension (vLLM): token ids that end a choice")
    include_stop_str_in_output: Bool = Field(default=False, description="extension (vLLM)")
    skip_special_tokens: Bool = Field(default=True, description="extension (vLLM)")
    min_p: Annotated[float, Field(ge=0.0, le=1.0), Number] = Field(default=0.0, description="extension (vLLM)")
    add_special_tokens: Bool | None = Field(
        default=None, description="extension (vLLM): add the tokenizer's specials (BOS...) to the prompt; "
        "default: completions and chat with a task yes, chat with base no (its template has them)")
    # vLLM's request extensions (server.api.openai.extensions says what each does here)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1), Number] | None = Field(
        default=None, description="extension (vLLM): keep only this many prompt tokens (-1: the server's limit)")
    truncation_side: Literal["left", "right"] | None = Field(
        default=None, description="extension (vLLM): left (default) keeps the last tokens, right the first")
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Number] | None = Field(
        default=None, description="extension (vLLM): each prompt token's logprob and the k most likely")
    return_token_ids: Bool | None = Field(default=None, description="extension (vLLM): token ids of the prompt "
                                          "and of each choice")
    return_tokens_as_token_ids: Bool | None = Field(default=None, description="extension (vLLM): logprob tokens "
                                                    "written token_id:N")
    return_prompt_text: Bool | None = Field(default=None, description="extension (vLLM): the rendered prompt")
    priority: Annotated[int, Field(ge=0, le=0), Number] = Field(
        default=0, description="extension (vLLM): only 0 (no priority scheduling here, as vLLM's default)")
    use_beam_search: OnlyFalse = Field(default=False, description="extension (vLLM): only false")
    allowed_token_ids: list[TokenId] | None = Field(default=None, max_length=0, description="refused unless empty")
    bad_words: list[str] | None = Field(default=None, max_length=0, description="refused unless empty")
    logprob_token_ids: list[TokenId] | None = Field(default=None, max_length=0, description="refused unless empty")
    structured_outputs: StructuredOutputs | None = Field(default=None, description="extension (vLLM): json or "
                                                         "json_object, as response_format")
    repetition_detection: None = Field(default=None, description="refused")
    # vLLM's extensions that change nothing here (ignored, as vLLM ignores them in this configuration)
    spaces_between_special_tokens: Bool = Field(default=True, description="ignored (fast tokenizers)")
    length_penalty: Annotated[float, Number] = Field(default=1.0, description="ignored (beam search only)")
    watermarking: Bool | None = Field(default=None, description="ignored (no watermark configured)")
    request_id: str | None = Field(default=None, max_length=256, description="ignored (the server names requests)")
    session_id: str | None = Field(default=None, max_length=256, description="ignored")
    stream_interval: Annotated[int, Field(ge=1), Number] | None = Field(default=None, description="ignored")
    return_token_offsets: Bool | None = Field(default=None, description="ignored (render routes only)")
    routed_experts_prompt_start: Annotated[int, Field(ge=0), Number] = Field(default=0, description="ignored")
    mm_payload: Literal["tensors", "none"] = Field(default="tensors", description="ignored (render routes only)")
    return_mm_kwargs: Bool | None = Field(default=None, description="ignored")
    kv_transfer_params: dict[str, Any] | None = Field(default=None, max_length=64, description="ignored "
                                                      "(no KV transfer)")
    ec_transfer_params: dict[str, Any] | None = Field(default=None, max_length=64, description="ignored")
    vllm_xargs: dict[str, Any] | None = Field(default=None, max_length=64, description="ignored (no custom "
                                              "extension reads them)")
    thinking_token_budget: Annotated[int, Number] | None = Field(default=None, description="ignored (no reasoning "
                                                                 "parser)")

    @model_validator(mode="after")
    def _structured_outputs(self) -> _Common:
        """vLLM's structured_outputs becomes the request's response_format (one or the other)."""
        if self.structured_outputs is not None:
            if getattr(self, "response_format", None) is not None:
                raise ValueError("structured_outputs: not together with response_format")
            self.__dict__["response_format"] = self.structured_outputs.as_response_format()  # both subclasses have it
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def stop_ids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(self.stop_token_ids or ()))

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))


class CompletionRequest(_Common):
    prompt: NonEmpty | Prompts | TokenIds | PromptsOfIds = Field(
        description="a string or a list of token ids, or a list of prompts of either kind (each its own row; "
        "choice index = prompt index x n + choice)")
    max_tokens: Annotated[int, Field(ge=0), Number] | None = Field(
        default=16, description="0 with echo: the prompt's logprobs, nothing generated")
    echo: Bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Number] | None = None
    best_of: Annotated[int, Field(ge=1, le=1), Number] | None = Field(
        default=None, description="only 1 (or null): no server-side ranking")
    suffix: str | None = Field(default=None, max_length=0, description="refused unless null or empty")
    prompt_embeds: None = Field(default=None, description="refused (extension (vLLM): token ids or text only)")
    response_format: ResponseFormat | None = Field(default=None, description="text, json_object or json_schema")

    model_config = ConfigDict(json_schema_extra={"allOf": [
        {  # vLLM's structured_outputs is the response_format: not both
            "if": {"properties": {"structured_outputs": {"type": "object"}}, "required": ["structured_outputs"]},
            "then": {"properties": {"response_format": {"type": "null"}}}},
        {  # max_tokens 0 scores the prompt: it needs echo
            "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
            "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]}},
        {  # streaming echoes the prompt without its logprobs (they come with the last event)
            "if": {"properties": {"stream": {"const": True}, "echo": {"const": True}}, "required": ["stream", "echo"]},
            "then": {"properties": {"logprobs": {"type": "null"}}}},
    ]})

    @model_validator(mode="after")
    def _zero_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 needs echo: true (it scores the prompt)")
        return self

    def prompt_values(self) -> list[str | list[int]]:
        """Every prompt, as text or as token ids."""
        value = self.prompt
        if isinstance(value, str):
            return [value]
        # the ignores: mypy does not narrow `value` by all(), nor `v` to list[int] past it
        if all(isinstance(v, int) for v in value):
            return [list(value)]  # type: ignore[arg-type]
        return [v if isinstance(v, str) else list(v) for v in value]  # type: ignore[arg-type]

    def prompt_value(self) -> str | list[int]:
        """The first prompt (the whole request when it has one)."""
        return self.prompt_values()[0]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = Field(description="only text parts (images, audio, files are refused)")
    text: str




class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [  # what _shape checks
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
         "else": {"properties": {"tool_call_id": {"type": "null"}}}},
        {"if": {"properties": {"role": {"const": "assistant"}}},
         "then": {"anyOf": [{"required": ["content"], "properties": {"content": NOT_NULL}},
                            {"required": ["tool_calls"],
                             "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]},
         "else": {"required": ["content"], "properties": {"content": NOT_NULL, "tool_calls": {"type": "null"}}}},
    ]})

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = Field(default=None, description="null only on an assistant message "
                                                 "with tool_calls")
    name: str | None = Field(default=None, max_length=64, description="ignored")
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS,
                                              description="an assistant message's calls")
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=MAX_CALL_ID,
                                     description="a tool message: the call it answers")
    refusal: str | None = Field(default=None, description="ignored")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (null only on an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only on an assistant message")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id: required on a tool message, and only there")
        return self


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1), Number] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), Number] | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Number] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS, description="function tools "
                                     "(server.api.openai.tools)")
    functions: list[Any] | None = Field(default=None, max_length=0, description="refused unless empty (use tools)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="default: auto with tools, none without")
    function_call: Literal["none"] | None = Field(default=None, description="only \"none\" (use tool_choice)")
    parallel_tool_calls: Bool | None = Field(default=None, description="false: at most one call (default true)")
    # vLLM's chat extensions (server.api.openai.extensions)
    echo: Bool = Field(default=False, description="extension (vLLM): the answer starts with the last message's "
                       "content when that is an assistant message")
    add_generation_prompt: Bool = Field(default=True, description="extension (vLLM)")
    continue_final_message: Bool = Field(default=False, description="extension (vLLM): continue the last "
                                         "(assistant) message instead of starting a new one (no generation prompt)")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=32,
                                                        description="extension (vLLM): variables for the template")
    documents: list[dict[str, str]] | None = Field(default=None, max_length=64,
                                                   description="extension (vLLM): for a template that uses them")
    chat_template: None = Field(default=None, description="refused: the backbone's own template is used")
    reasoning_effort: str | None = Field(default=None, max_length=16, description="ignored (no reasoning model)")
    include_reasoning: Bool = Field(default=True, description="ignored (no reasoning model)")
    media_io_kwargs: dict[str, Any] | None = Field(default=None, max_length=16, description="ignored (text only)")
    mm_processor_kwargs: dict[str, Any] | None = Field(default=None, max_length=16, description="ignored (text only)")

    model_config = ConfigDict(json_schema_extra={"allOf": [
        {  # vLLM's structured_outputs is the response_format: not both
            "if": {"properties": {"structured_outputs": {"type": "object"}}, "required": ["structured_outputs"]},
            "then": {"properties": {"response_format": {"type": "null"}}}},
        {  # top_logprobs above 0 needs logprobs: true (0 is vLLM's default)
            "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}},
        {  # a task answers the last user message (server.api.openai.chat): there must be one
            "if": {"properties": {"model": {"not": {"const": "base"}}}},
            "then": {"properties": {"messages": {"contains": {
                "type": "object", "properties": {"role": {"const": "user"}}, "required": ["role"]}}}}},
    ]})

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self
