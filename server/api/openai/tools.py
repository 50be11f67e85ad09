"""Tool calling on the chat route (pure functions, plus the schema check off the event loop).

    tool_choice  (default: auto with tools, none without)
      none       the tools are not shown; the answer is text
      auto       the tools are shown; the model writes text, or calls in the default format
                 (below); the answer is parsed: calls that parse and name a tool become
                 `tool_calls` (finish_reason "tool_calls"), anything else stays text. With a
                 `strict` tool (native engine) the grammar allows only text without
                 "<tool_call>", or text then calls whose arguments follow their tool's schema
      required   constrained by the JSON-schema grammar (engines/grammar.py) to a list of one or
                 more calls [{"name": NAME, "parameters": ARGS}, ...] (one with
                 parallel_tool_calls false), ARGS valid for that tool's schema
      named      constrained to the named tool's arguments: the whole answer is ARGS
    Required and named answers always parse and validate; one cut short by max tokens is
    finish_reason "length" with the text as content and no calls (never a partial call).

    rendering    the backbone's chat template with `tools=` where the template has a tools
                 section; otherwise the default format: the tools are listed in the system
                 message, a call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
                 in the assistant's text, and a tool message is a user turn
                 `<tool_response>...</tool_response>` (Hermes' convention)
    a task       with a tool_choice other than none, the conversation is rendered as for base
                 (the chat template, the tools) and generated with the task's adapter; a task
                 alone answers only the last user message, which cannot carry tools

Errors are 400 naming the field (ApiError): a schema that does not compile, two tools of one
name, a named or required choice without that tool, a tool message answering no earlier call.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2

from server.api.errors import ApiError
from server.api.openai.response_format import MAX_SCHEMA_CHARS
from server.api.openai.schemas import ChatMessage
from server.api.openai.tool_schemas import MAX_TOOLS_CHARS, NamedToolChoice, Tool
from server.engines.grammar import check_format

# a tool without parameters
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# keys the route sets itself (or that change what apply_chat_template returns)
RESERVED_TEMPLATE_KEYS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "return_dict", "chat_template", "padding", "truncation", "max_length", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
_TEMPLATE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")

DEFAULT_PRELUDE = (
    "You can call functions to answer. Their signatures, one JSON object a line, are between "
    "<tools> and </tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call one, answer with a JSON object of its name and arguments between <tool_call> and "
    "</tool_call>, one block per call:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>'
)


CODE = "invalid_tools"  # what JSON Schema cannot say about a request's tools and conversation


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param, code=CODE)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parameters_of(tool: Tool) -> dict[str, Any]:
    return NO_ARGUMENTS if tool.function.parameters is None else tool.function.parameters


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass
class ToolPlan:
    """What a chat request does with tools: mode none | auto | required | named."""

    mode: str = "none"
    tools: list[Tool] = field(default_factory=list)
    name: str | None = None  # the named tool
    parallel: bool = True
    response_format: tuple[str, str] | None = None  # the grammar of required / named

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}


def required_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """A list of one or more calls, each {"name": a tool's name, "parameters": its arguments}."""
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": parameters_of(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def check_messages(messages: Sequence[ChatMessage], continue_final_message: bool = False) -> None:
    """Every assistant call's arguments are a JSON object; every tool message answers an earlier
    call; continue_final_message has an assistant message to continue."""
    if continue_final_message and messages[-1].role != "assistant":
        raise _bad("messages: continue_final_message needs an assistant message last", "messages")
    called: set[str] = set()
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or ()):
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise _bad(f"messages.{i}.tool_calls.{j}.function.arguments: must be a JSON object, as text",
                           f"messages.{i}.tool_calls.{j}.function.arguments")
            called.add(call.id)
        if m.role == "tool" and m.tool_call_id not in called:
            raise _bad(f"messages.{i}.tool_call_id: answers no tool call of an earlier assistant message",
                       f"messages.{i}.tool_call_id")


async def plan(tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool | None,
               tokenizer: Any, *, stop: list[str], json_format: bool, field_prefix: str = "",
               strict_auto: bool = True) -> ToolPlan:
    """The request's ToolPlan, every schema compiled for the served tokenizer (off the event loop);
    ApiError 400 naming the field. field_prefix: where the route's tool fields sit ("" on chat).
    strict_auto: auto with a strict tool is constrained by the tool-calls grammar (the native
    engine's; grammar.tool_calls_grammar)."""
    tools = list(tools or ())
    mode = choice if isinstance(choice, str) else ("named" if choice is not None else ("auto" if tools else "none"))
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    out = ToolPlan(mode, tools, name, parallel is not False)
    seen: set[str] = set()
    total = 0
    for i, tool in enumerate(tools):
        where = f"{field_prefix}tools.{i}"
        if tool.function.name in seen:
            raise _bad(f"{where}.function.name: two tools named {tool.function.name!r}", f"{where}.function.name")
        seen.add(tool.function.name)
        params = parameters_of(tool)
        if params.get("type", "object") != "object":
            raise _bad(f"{where}.function.parameters: must be a schema of an object", f"{where}.function.parameters")
        text = _compact(params)
        total += len(text)
        if len(text) > MAX_SCHEMA_CHARS:
            raise _bad(f"{where}.function.parameters: more than {MAX_SCHEMA_CHARS} characters",
                       f"{where}.function.parameters")
        error = await asyncio.to_thread(check_format, ("json_schema", text), tokenizer)
        if error is not None:
            raise _bad(f"{where}.function.parameters: invalid schema: {error}", f"{where}.function.parameters")
    if total > MAX_TOOLS_CHARS:
        raise _bad(f"{field_prefix}tools: the schemas have more than {MAX_TOOLS_CHARS} characters together",
                   f"{field_prefix}tools")
    param = f"{field_prefix}tool_choice"
    if mode != "none" and not tools:
        raise _bad(f"{param}: {mode} needs tools", param)
    if mode == "named":
        if name not in seen:
            raise _bad(f"{param}.function.name: no tool named {name!r}", f"{param}.function.name")
        tool = next(t for t in tools if t.function.name == name)
        out.response_format = ("json_schema", _compact(parameters_of(tool)))
    elif mode == "required":
        spec = ("json_schema", _compact(required_schema(tools, out.parallel)))
        error = await asyncio.to_thread(check_format, spec, tokenizer)
        if error is not None:
            raise _bad(f"{field_prefix}tools: the calls' grammar does not compile: {error}", f"{field_prefix}tools")
        out.response_format = spec
    elif mode == "auto" and strict_auto and any(t.function.strict for t in tools):
        listed = [{"name": t.function.name, "parameters": parameters_of(t)} for t in tools]
        spec = ("tool_calls", _compact(listed))
        error = await asyncio.to_thread(check_format, spec, tokenizer)
        if error is not None:
            raise _bad(f"{field_prefix}tools: the calls' grammar does not compile: {error}", f"{field_prefix}tools")
        out.response_format = spec
    if out.active and json_format:
        raise _bad(f"{param}: a JSON response_format with tools is not supported (use one or the other)", param)
    if out.response_format is not None and stop:
        raise _bad("stop: not supported with required, named or strict tool calls (a stop string would cut a call "
                   "short)", "stop")
    return out


# -- rendering -----------------------------------------------------------------------------------
def template_has_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def tool_dicts(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.function.name, "description": t.function.description or "",
                                              "parameters": parameters_of(t)}} for t in tools]


def _call_block(name: str, arguments: str) -> str:
    return f"{CALL_OPEN}\n{_compact({'name': name, 'arguments': json.loads(arguments)})}\n{CALL_CLOSE}"


def turns(messages: Sequence[ChatMessage], tools: Sequence[Tool], native: bool) -> list[dict[str, Any]]:
    """The conversation as the chat template's messages. native: the template renders tools,
    tool_calls and tool messages itself; otherwise they are written in the default format."""
    names = {c.id: c.function.name for m in messages for c in (m.tool_calls or ())}
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if native:
            turn: dict[str, Any] = {"role": role, "content": m.text()}
            if m.tool_calls:
                turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in m.tool_calls]
            if m.role == "tool":
                turn["tool_call_id"], turn["name"] = m.tool_call_id, names.get(m.tool_call_id or "", "")
            out.append(turn)
            continue
        if m.role == "tool":
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("_tool"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        text = m.text()
        if m.tool_calls:
            call_blocks = [_call_block(c.function.name, c.function.arguments) for c in m.tool_calls]
            text = "\n".join([text, *call_blocks]).lstrip("\n")
        out.append({"role": role, "content": text})
    if tools and not native:
        prelude = DEFAULT_PRELUDE.format(tools="\n".join(_compact(t) for t in tool_dicts(tools)))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prelude}"
        else:
            out.insert(0, {"role": "system", "content": prelude})
    for turn in out:
        turn.pop("_tool", None)
    return out


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KEYS or not _TEMPLATE_KEY.match(key):
            raise _bad(f"chat_template_kwargs: {key[:64]!r} cannot be set (a name the server sets, or not a "
                       "variable name)", "chat_template_kwargs")
    return dict(kwargs or {})


def render(tokenizer: Any, messages: Sequence[ChatMessage], tools: Sequence[Tool], *,
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           template_kwargs: dict[str, Any] | None = None, documents: list[dict[str, str]] | None = None) -> str:
    """The prompt text; ValueError (-> 400 on messages) when the template cannot render it."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: the backbone has no chat template; use /v1/completions")
    if continue_final_message and messages[-1].role != "assistant":
        raise ValueError("messages: continue_final_message needs an assistant message last")
    native = template_has_tools(tokenizer)
    extra: dict[str, Any] = dict(template_kwargs or {})
    if tools and native:
        extra["tools"] = tool_dicts(tools)
    if documents is not None:
        extra["documents"] = documents
    try:
        return tokenizer.apply_chat_template(turns(messages, tools, native), tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **extra)
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as err:  # a template refusing this conversation
        raise ValueError(f"messages: the chat template cannot render this conversation: {str(err)[:200]}") from None


# -- parsing ---------------------------------------------------------------------------------------
@dataclass
class Parsed:
    content: str | None
    calls: list[dict[str, Any]]  # OpenAI's tool_calls entries (id, type, function{name, arguments})


def _entry(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_auto(text: str, names: set[str], parallel: bool = True) -> Parsed:
    """Hermes-style calls in free text; anything that does not parse as calls of known tools is text."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return Parsed(text, [])
    calls = []
    for block in _CALL.finditer(text, start):
        try:
            value = json.loads(block.group(1))
        except ValueError:
            return Parsed(text, [])
        args = value.get("arguments", value.get("parameters", {})) if isinstance(value, dict) else None
        if not isinstance(value, dict) or value.get("name") not in names or not isinstance(args, dict):
            return Parsed(text, [])
        calls.append(_entry(value["name"], _compact(args)))
    content = text[:start].strip()
    return Parsed(content or None, calls[:1] if not parallel else calls)


def parse(plan_: ToolPlan, text: str, complete: bool) -> Parsed:
    """An answer's content and calls. complete: the row ended by its grammar or an end token (not
    max tokens); a cut-short required / named answer is text, never a call."""
    if plan_.mode == "named" and complete:
        assert plan_.name is not None
        return Parsed(None, [_entry(plan_.name, text)])
    if plan_.mode == "required" and complete:
        return Parsed(None, [_entry(c["name"], _compact(c["parameters"])) for c in json.loads(text)])
    if plan_.mode == "auto":
        return parse_auto(text, plan_.names, plan_.parallel)
    return Parsed(text, [])


def finish_reason(plan_: ToolPlan, parsed: Parsed, reason: str) -> str:
    """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named call is "stop"."""
    if parsed.calls and plan_.mode in ("auto", "required"):
        return "tool_calls"
    return reason


class StreamSplitter:
    """One streamed choice of an auto request: text is passed on as it comes, up to a possible
    start of a call; from the first `<tool_call>` on it is held until the answer is whole."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0
        self.held = False

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.held:
            return ""
        at = self.text.find(CALL_OPEN, self.sent)
        if at >= 0:
            self.held = True
            out, self.sent = self.text[self.sent:at], at
            return out
        keep = 0  # a tail that may be the start of "<tool_call>"
        for k in range(min(len(CALL_OPEN) - 1, len(self.text) - self.sent), 0, -1):
            if CALL_OPEN.startswith(self.text[-k:]):
                keep = k
                break
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], end
        return out

    def rest(self) -> str:
        """The text not passed on yet."""
        return self.text[self.sent:]


_ITEM = re.compile(r'(?:\[|\},)\{"name":("(?:[^"\\]|\\.)*"),"parameters":')


class RequiredSplitter:
    """One streamed choice of a required request: the grammar writes compact JSON,
    [{"name":N,"parameters":{...}},...], so each call's name is known once its header is
    whole, and its arguments stream as they come (a string-aware brace count ends them).
    feed(piece) -> OpenAI delta entries; anything unexpected stops the streaming (the calls
    then come whole at the end, from the parsed answer: `streamed` says how many did not)."""

    def __init__(self) -> None:
        self.text, self.pos, self.streamed = "", 0, 0
        self.in_args, self.depth, self.in_str, self.escaped = False, 0, False, False
        self.ok = True

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        out: list[dict[str, Any]] = []
        while self.ok:
            if not self.in_args:
                head = self.text.find('"parameters":', self.pos)
                if head < 0:
                    break
                m = _ITEM.match(self.text, self.pos)
                if m is None or m.end() != head + len('"parameters":'):
                    self.ok = False
                    break
                out.append({"index": self.streamed, "id": new_call_id(), "type": "function",
                            "function": {"name": json.loads(m.group(1)), "arguments": ""}})
                self.in_args, self.pos, self.depth = True, m.end(), 0
                continue
            start, end = self.pos, self.pos
            while end < len(self.text):
                ch = self.text[end]
                end += 1
                if self.in_str:
                    if self.escaped:
                        self.escaped = False
                    elif ch == "\\":
                        self.escaped = True
                    elif ch == '"':
                        self.in_str = False
                    continue
                if ch == '"':
                    self.in_str = True
                elif ch in "{[":
                    self.depth += 1
                elif ch in "}]":
                    self.depth -= 1
                    if self.depth == 0:
                        break
            if end > start:
                out.append({"index": self.streamed, "function": {"arguments": self.text[start:end]}})
            self.pos = end
            if self.depth == 0 and end > start and self.text[end - 1] in "}]":
                self.in_args, self.streamed = False, self.streamed + 1
                continue
            break
        return out
