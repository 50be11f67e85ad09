"""Required and named calls against 200 generated tool schemas (objects, enums, nested arrays,
numbers with bounds, optional keys) on a live tiny server: every call returned parses and validates
against its tool's schema (the grammar's guarantee), and an answer is only ever cut short by
max_tokens, never wrong."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.server.api.openai.test_tools import long_backbone
from tests.support.server_fixtures import build_store, live_server, settings_for

jsonschema_rs = pytest.importorskip("jsonschema_rs")

N_SCHEMAS = 200
MAX_TOKENS = 200


def leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "enum", "integer", "number", "boolean", "const"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "y z", "1"], rng.randint(1, 4))}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        start = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(start, 2), "maximum": round(start + rng.uniform(0, 5), 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"const": rng.choice(["on", 3, True])}


def value(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth < 2 and roll < 0.2:
        return obj(rng, depth + 1)
    if depth < 2 and roll < 0.35:
        return {"type": "array", "items": value(rng, depth + 1), "minItems": 0, "maxItems": rng.randint(1, 3)}
    return leaf(rng)


def obj(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(["a", "b", "city", "n", "tags", "when", "unit", "deep"], rng.randint(1, 4))
    props = {name: value(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas() -> list[dict[str, Any]]:
    rng = random.Random(78)
    return [obj(rng) for _ in range(N_SCHEMAS)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzed_tools")
    build_store(root / "store")
    with live_server(settings_for(root, max_new_tokens=MAX_TOKENS, max_prompt_tokens=1800),
                     long_backbone()) as srv:
        yield srv


def ask(url: str, i: int, schema: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]]:
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": schema}},
             {"type": "function", "function": {"name": "other"}}]  # no parameters: the arguments are {}
    choice: Any = {"type": "function", "function": {"name": f"t{i}"}} if i % 2 else "required"
    body = {"model": "base", "messages": [{"role": "user", "content": "call"}], "tools": tools, "tool_choice": choice,
            "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": i, "parallel_tool_calls": i % 4 != 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return i, schema, r.json()["choices"][0]


def test_every_call_parses_and_validates(server):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda a: ask(server.url, *a), enumerate(schemas())))
    complete = 0
    for i, schema, choice in results:
        if choice["finish_reason"] == "length":  # cut short: no call, the text as content
            assert not choice["message"].get("tool_calls")
            continue
        complete += 1
        calls = choice["message"]["tool_calls"]
        assert calls, choice
        if i % 4 == 0:
            assert len(calls) == 1  # parallel_tool_calls false
        for call in calls:
            name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
            want = schema if name == f"t{i}" else {"const": {}}
            assert name in (f"t{i}", "other") and (i % 2 == 0 or name == f"t{i}")
            assert jsonschema_rs.validator_for(want).is_valid(args), (schema, args)
    assert complete >= 0.9 * N_SCHEMAS, f"only {complete} of {N_SCHEMAS} finished within {MAX_TOKENS} tokens"
