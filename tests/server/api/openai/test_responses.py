"""POST /v1/responses with the official `openai` client against a live server (tiny random
backbone): text, a named and a required function call (grammar: always valid), a round trip with
function_call / function_call_output items, json_schema text format, the streamed event sequence,
and the refusals (store, previous_response_id, non-function tools) naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.api.openai.test_tools import long_backbone
from tests.support.server_fixtures import build_store, live_server, settings_for

openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "weather", "description": "the weather", "parameters": WEATHER, "strict": True}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    build_store(root / "store")
    with live_server(settings_for(root, max_new_tokens=64, max_prompt_tokens=1800), long_backbone()) as srv:
        yield srv


@pytest.fixture(scope="module")
def oc(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_text_answer_and_usage(oc):
    r = oc.responses.create(model="base", input="hello", instructions="be brief", max_output_tokens=6,
                            temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens <= 6 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.output_text == "".join(p.text for item in r.output if item.type == "message" for p in item.content)


@pytest.mark.parametrize("choice", [{"type": "function", "name": "weather"}, "required"], ids=["named", "required"])
def test_function_calls_are_valid(oc, choice):
    r = oc.responses.create(model="base", input="weather in Paris?", tools=TOOLS, tool_choice=choice,
                            parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    assert calls[0].name == "weather" and calls[0].call_id.startswith("call_")
    assert jsonschema_rs.validator_for(WEATHER).is_valid(json.loads(calls[0].arguments))


def test_a_function_call_round_trip(oc):
    first = oc.responses.create(model="base", input=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS,
                                tool_choice={"type": "function", "name": "weather"}, max_output_tokens=60,
                                temperature=0)
    call = next(item for item in first.output if item.type == "function_call")
    items = [{"role": "user", "content": "weather in Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = oc.responses.create(model="base", input=items, tools=TOOLS, max_output_tokens=8, temperature=0)
    assert second.status in ("completed", "incomplete")
    orphan = [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "nope", "output": "y"}]
    with pytest.raises(openai.BadRequestError) as info:
        oc.responses.create(model="base", input=orphan, max_output_tokens=4)
    assert info.value.body["param"] == "input"


def test_json_schema_text_format(oc):
    r = oc.responses.create(model="base", input="answer", max_output_tokens=60, temperature=0,
                            text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}})
    assert r.status == "completed"
    assert jsonschema_rs.validator_for(WEATHER).is_valid(json.loads(r.output_text))


def test_streamed_events(oc):
    kwargs = {"model": "base", "input": "weather?", "tools": TOOLS,
              "tool_choice": {"type": "function", "name": "weather"},
              "max_output_tokens": 60, "temperature": 0}
    whole = oc.responses.create(**kwargs)
    events = list(oc.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    want = next(item for item in whole.output if item.type == "function_call").arguments
    assert args == want == events[-1].response.output[0].arguments
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    text = list(oc.responses.create(model="base", input="hello", max_output_tokens=8, temperature=0, stream=True))
    deltas = "".join(e.delta for e in text if e.type == "response.output_text.delta")
    done = [e for e in text if e.type == "response.output_text.done"]
    assert not done or done[0].text == deltas
    assert text[-1].type in ("response.completed", "response.incomplete")


@pytest.mark.parametrize(("extra", "param"), [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools.0.parameters"),
    ({"tool_choice": {"type": "function", "name": "g"}, "tools": TOOLS}, "tool_choice.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"max_output_tokens": 10_000}, "max_output_tokens"),
], ids=["store", "previous", "web_search", "schema", "named", "image", "max_tokens"])
def test_refusals_name_the_field(server, extra, param):
    body = {"model": "base", "input": "hi", "max_output_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


def test_top_logprobs_come_with_the_text(oc):
    r = oc.responses.create(model="base", input="hello", max_output_tokens=4, temperature=0, top_logprobs=2)
    (part,) = next(item for item in r.output if item.type == "message").content
    assert len(part.logprobs) == r.usage.output_tokens or part.text == ""
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
