"""Structured outputs, engine-neutral: a request's response format -> an llguidance grammar.

    SamplingParams.response_format = ("json_object", "")            any JSON object
                                   | ("json_schema", SCHEMA_JSON)   JSON valid against the schema
                                   | ("tool_calls", TOOLS_JSON)     text or strict tool calls (auto)
    grammar_text(fmt)         the llguidance grammar (JSON compiled without free whitespace: the
                              answer is compact JSON, and a model cannot loop on blanks)
    check_format(fmt, tok)    None, or why the grammar is unusable (an invalid schema)
    ll_tokenizer(tok)         llguidance's view of a Hugging Face fast tokenizer, built once each

The native engine masks each constrained row's logits with it (engines/native/sample/grammar_mask.py);
the vLLM engine hands the format to vLLM's own structured outputs (engines/vllm/structured.py).
"""

from __future__ import annotations

import json
import threading
from typing import Any

ResponseFormat = tuple[str, str]
JSON_OBJECT: dict[str, Any] = {"type": "object"}
_COMPILE = {"whitespace_flexible": False}

_tokenizers: dict[int, tuple[Any, Any]] = {}  # id(HF tokenizer) -> (it, its LLTokenizer)
_lock = threading.Lock()


def schema_of(fmt: ResponseFormat) -> dict[str, Any]:
    kind, text = fmt
    if kind == "json_object":
        return JSON_OBJECT
    if kind == "json_schema":
        return json.loads(text)
    raise ValueError(f"response_format: unknown type {kind!r}")


def tool_calls_grammar(tools: list[dict[str, Any]]) -> str:
    """tool_choice auto with strict tools (server.api.openai.tools): free text that never contains
    "<tool_call>", or text then one or more calls <tool_call>\n{"name": N, "arguments": ARGS}\n</tool_call>,
    ARGS valid for N's schema. tools: [{"name", "parameters"}] (a Lark grammar for llguidance)."""
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return "\n".join([  # OPEN: any text up to the first "<tool_call>\n" (a lexeme cannot stop short of it)
        "start: TEXT | OPEN body CLOSE more*",
        'more: "\\n"? "<tool_call>\\n" body CLOSE',
        "TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/",
        "OPEN: /(?s:.*)<tool_call>\\n/ & ~/(?s:.*<tool_call>.*<tool_call>.*)/",
        'CLOSE: "\\n</tool_call>"',
        f"body: %json {json.dumps(schema, separators=(',', ':'))}",
    ])


def grammar_text(fmt: ResponseFormat) -> str:
    from llguidance import LLMatcher

    if fmt[0] == "tool_calls":
        return tool_calls_grammar(json.loads(fmt[1]))
    return LLMatcher.grammar_from_json_schema(schema_of(fmt), overrides=_COMPILE)  # type: ignore[arg-type]


def ll_tokenizer(tokenizer: Any) -> Any:
    """The LLTokenizer of a Hugging Face fast tokenizer (about a second for a large vocabulary:
    built once per tokenizer object and kept)."""
    with _lock:
        entry = _tokenizers.get(id(tokenizer))
        if entry is not None and entry[0] is tokenizer:
            return entry[1]
    import llguidance.hf

    built = llguidance.hf.from_tokenizer(tokenizer)
    with _lock:
        _tokenizers[id(tokenizer)] = (tokenizer, built)
    return built


def check_format(fmt: ResponseFormat, tokenizer: Any) -> str | None:
    """None when the format compiles to a usable grammar for this tokenizer, else the reason."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_text(fmt)
    except (ValueError, TypeError) as err:
        return str(err)[:300]
    error = LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    return error[:300] or None
