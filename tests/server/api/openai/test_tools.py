"""Tool calling on /v1/chat/completions with the official `openai` client against a live server
(tiny random backbone): required and named calls always parse and validate (the grammar), streamed
tool-call deltas add up to the whole answer, a tool round trip, the default format's rendering, the
auto parser, and 400s naming the field for bad tools (nothing reaches the engine)."""

from __future__ import annotations

import json

import httpx
import pytest

from adapters_store.backbone.tiny import tiny_tokenizer
from server.api.openai import tools
from server.api.openai.schemas import ChatMessage
from server.api.openai.tool_schemas import Tool
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"weather": WEATHER, "add": ADD}
MSGS = [{"role": "user", "content": "what is the weather in Paris?"}]


def valid_call(call) -> bool:
    return jsonschema_rs.validator_for(SCHEMAS[call.function.name]).is_valid(json.loads(call.function.arguments))


def long_backbone():
    """The tiny backbone with room for the tools' listing (a byte per token)."""
    backbone = tiny_backbone()
    backbone.model.config.max_position_embeddings = 2048
    return backbone


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    build_store(root / "store")
    with live_server(settings_for(root, max_new_tokens=96, max_n=4, max_prompt_tokens=1800), long_backbone()) as srv:
        yield srv


@pytest.fixture(scope="module")
def oc(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# -- required and named: the grammar ---------------------------------------------------------------
@pytest.mark.parametrize("model", ["base", "alpha", "mix:alpha=0.5,beta=0.5"])
def test_named_calls_parse_and_validate(oc, model):
    for temperature in (0.0, 1.0):
        r = oc.chat.completions.create(model=model, messages=MSGS, tools=TOOLS, max_tokens=80, n=2, seed=3,
                                       temperature=temperature,
                                       tool_choice={"type": "function", "function": {"name": "weather"}})
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice
            assert choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
            assert valid_call(call), call.function.arguments


def test_required_calls_parse_and_validate(oc):
    seen = set()
    for seed in range(4):
        r = oc.chat.completions.create(model="base", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       max_tokens=96, temperature=1.0, seed=seed)
        choice = r.choices[0]
        if choice.finish_reason == "length":  # a list of calls can run past max_tokens: then no call
            assert not choice.message.tool_calls and choice.message.content
            continue
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls and all(valid_call(c) for c in choice.message.tool_calls)
        seen.update(c.function.name for c in choice.message.tool_calls)
    assert seen  # at least one finished within the budget
    one = oc.chat.completions.create(model="base", messages=MSGS, tools=TOOLS, tool_choice="required",
                                     parallel_tool_calls=False, max_tokens=96, temperature=0)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1


def test_cut_short_call_is_length_and_no_call(oc):
    r = oc.chat.completions.create(model="base", messages=MSGS, tools=TOOLS, max_tokens=3, temperature=0,
                                   tool_choice={"type": "function", "function": {"name": "add"}})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_streamed_calls_add_up_to_the_whole_answer(oc, choice):
    # one call (a random model's list of calls may run past max_tokens)
    args = {"model": "base", "messages": MSGS, "tools": TOOLS, "tool_choice": choice, "max_tokens": 96,
            "temperature": 0, "parallel_tool_calls": False}
    whole = oc.chat.completions.create(**args)
    chunks = list(oc.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    want = whole.choices[0].message.tool_calls
    assert [(e["name"], e["arguments"]) for e in calls.values()] == [(w.function.name, w.function.arguments)
                                                                      for w in want]
    pieces = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert len(pieces) > 2  # the arguments come in fragments, as they are generated
    assert all(e["id"] and e["id"].startswith("call_") for e in calls.values())
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_the_clients_stream_helper_assembles_the_call(oc):
    with oc.chat.completions.stream(model="base", messages=MSGS, tools=TOOLS, max_tokens=80, temperature=0,
                                    tool_choice={"type": "function", "function": {"name": "weather"}}) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "weather" and valid_call(call)


def test_a_tool_round_trip(oc):
    first = oc.chat.completions.create(model="base", messages=MSGS, tools=TOOLS, max_tokens=80, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*MSGS, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    second = oc.chat.completions.create(model="base", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = oc.chat.completions.create(model="base", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8,
                                      temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


def test_what_the_model_sees(http):
    """none hides the tools; auto shows them; a task with tools is rendered as base (the template)."""
    def prompt(**extra):
        body = {"model": "base", "messages": MSGS, "tools": TOOLS, "max_tokens": 2, "return_prompt_text": True, **extra}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["prompt_text"]

    assert "<tools>" in prompt() and '"name":"add"' in prompt()
    assert "<tools>" not in prompt(tool_choice="none")
    task = prompt(model="alpha", tool_choice="required")
    assert task.startswith("<|im_start|>system\nYou can call functions") and "<tools>" in task
    plain = http.post("/v1/chat/completions", json={"model": "alpha", "messages": MSGS, "max_tokens": 2,
                                                    "return_prompt_text": True}).json()["prompt_text"]
    assert "<|im_start|>" not in plain  # a task alone: its own prompt format


STRICT = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]


def test_strict_tools_in_auto_are_grammar_enforced():
    """The grammar of auto with a strict tool: text without "<tool_call>", or text then valid calls."""
    from server.engines.native.sample.grammar_mask import RowGrammar

    tok = tiny_tokenizer()
    listed = [{"name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in STRICT]
    fmt = ("tool_calls", json.dumps(listed))

    def verdicts(text: str, end: bool = True) -> list[str]:
        g = RowGrammar.build(fmt, tok)
        out = [g.consume(t, False) for t in tok(text, add_special_tokens=False).input_ids]
        return out + ([g.consume(tok.eos_token_id, True)] if end else [])

    assert verdicts("no call here")[-1] == "done"
    good = 'ok <tool_call>\n{"name":"add","arguments":{"a":3,"b":4}}\n</tool_call>'
    assert set(verdicts(good)[:-1]) == {"go"} and verdicts(good)[-1] == "done"
    assert "dead" in verdicts('<tool_call>\n{"name":"add","arguments":{"a":300,"b":4}}', end=False)  # maximum 99
    assert "dead" in verdicts('<tool_call>\n{"name":"nope"', end=False)
    assert verdicts('x <tool_call>\n{"name":"add"')[-1] == "dead"  # an unfinished call cannot end


def test_strict_auto_answers_are_text_or_valid_calls(oc):
    r = oc.chat.completions.create(model="base", messages=MSGS, tools=STRICT, max_tokens=64, n=4, seed=5,
                                   temperature=1.0)
    for choice in r.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and all(valid_call(c) for c in choice.message.tool_calls)
        else:
            assert "<tool_call>" not in (choice.message.content or "") or choice.finish_reason == "length"


# -- rendering -------------------------------------------------------------------------------------
def _msgs(raw: list[dict]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def test_default_format_lists_tools_and_writes_calls_and_results():
    tok = tiny_tokenizer()
    assert not tools.template_has_tools(tok)
    raw = [{"role": "system", "content": "be brief"}, *MSGS,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
           {"role": "tool", "tool_call_id": "c1", "content": "warm"}]
    text = tools.render(tok, _msgs(raw), [Tool.model_validate(t) for t in TOOLS])
    assert text.startswith("<|im_start|>system\nbe brief\n\nYou can call functions")
    assert '"name":"weather"' in text and '"name":"add"' in text  # both signatures
    assert '<|im_start|>assistant\n<tool_call>\n{"name":"weather","arguments":{"city":"Paris"}}\n</tool_call>' in text
    # consecutive results are one user turn
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_with_a_tools_section_gets_them_itself():
    tok = tiny_tokenizer()
    tok.chat_template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
                         "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                         "{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }}"
                         "({{ c.function.arguments.city }})]{% endfor %}{% endif %}|{% endfor %}")
    assert tools.template_has_tools(tok)
    raw = [*MSGS, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    text = tools.render(tok, _msgs(raw), [Tool.model_validate(t) for t in TOOLS], add_generation_prompt=False)
    assert text == "TOOLS:weather;add;|user:what is the weather in Paris?|assistant:[weather(Oslo)]|tool:cold|"


# -- auto: the parser --------------------------------------------------------------------------------
NAMES = {"weather", "add"}


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("just text", "just text", []),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', None, [("add", '{"a":1,"b":2}')]),
    (('let me see <tool_call>{"name":"weather","arguments":{"city":"x"}}</tool_call>'
     '<tool_call>{"name":"add","arguments":{}}</tool_call>'), "let me see",
     [("weather", '{"city":"x"}'), ("add", "{}")]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', None, [("add", '{"a":1}')]),  # ended by EOS before the tag
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', None, None),  # unknown tool: text
    ('<tool_call>{"name": "add", "arguments": {</tool_call>', None, None),  # not JSON: text
], ids=["text", "one", "two", "unclosed", "unknown", "broken"])
def test_auto_parser(text, content, calls):
    parsed = tools.parse_auto(text, NAMES)
    if calls is None:
        assert parsed.content == text and parsed.calls == []
        return
    assert parsed.content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.calls] == calls
    assert len({c["id"] for c in parsed.calls}) == len(calls)
    if len(calls) > 1:
        assert len(tools.parse_auto(text, NAMES, parallel=False).calls) == 1


def test_stream_splitter_passes_text_and_holds_calls():
    s = tools.StreamSplitter()
    pieces = ["Hello <", "to", "ol_call>{", '"name":"add"}', "</tool_call>"]
    out = [s.feed(p) for p in pieces]
    assert out == ["Hello ", "", "", "", ""]
    assert s.rest() == '<tool_call>{"name":"add"}</tool_call>'
    s = tools.StreamSplitter()
    assert [s.feed(p) for p in ["a <", "b", " <tool"]] == ["a ", "<b", " "]
    assert s.rest() == "<tool"


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_required_splitter_streams_each_calls_arguments(step):
    calls = [("add", {"a": 1, "b": [2, {"c": "}]"}]}), ("weather", {"city": 'say "{hi}" \\'}), ("add", {})]
    text = json.dumps([{"name": n, "parameters": a} for n, a in calls], separators=(",", ":"))
    s = tools.RequiredSplitter()
    got: dict[int, dict] = {}
    for k in range(0, len(text), step):
        for entry in s.feed(text[k:k + step]):
            e = got.setdefault(entry["index"], {"name": "", "arguments": "", "id": entry.get("id")})
            e["name"] += entry["function"].get("name", "")
            e["arguments"] += entry["function"]["arguments"]
    assert s.ok and s.streamed == 3
    assert [(e["name"], json.loads(e["arguments"])) for e in got.values()] == calls
    assert all(e["id"].startswith("call_") for e in got.values())
    other = tools.RequiredSplitter()  # keys in another order: nothing streams, the calls come whole at the end
    assert other.feed('[{"parameters":{},"name":"add"}]') == [] and not other.ok


# -- refusals: 400 naming the field, before the engine ------------------------------------------------
def _tool(name="f", parameters=None):
    fn = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": fn}


BAD = [
    ({"tools": [_tool(parameters={"type": "object", "properties": {"a": {"type": "nonsense"}}})]},
     "tools.0.function.parameters"),
    ({"tools": [_tool(parameters={"type": "string"})]}, "tools.0.function.parameters"),
    ({"tools": [_tool(), _tool()]}, "tools.1.function.name"),
    ({"tools": [_tool(name="bad name")]}, "tools.0.function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
    ({"tools": [_tool()] * 129}, "tools"),
    ({"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": "required", "stop": ["x"]}, "stop"),
    ({"tools": [_tool()], "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [*MSGS, {"role": "tool", "tool_call_id": "nope", "content": "x"}]}, "messages.1.tool_call_id"),
    ({"messages": [*MSGS, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_tools_are_400_naming_the_field_and_reach_no_engine(server, http, monkeypatch, extra, param):
    submitted = []
    engine = server.runtime.engine
    real = engine.submit
    monkeypatch.setattr(engine, "submit", lambda req: (submitted.append(req), real(req))[1])
    body = {"model": "base", "messages": MSGS, "max_tokens": 4, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert submitted == []


# -- the real default backbone ---------------------------------------------------------------------
@pytest.mark.slow
def test_default_backbone_calls_tools(tmp_path):
    """SmolLM2-135M (its template has no tools section: the default format): named and required
    calls validate; auto answers text or calls that parse; a round trip renders the result."""
    with live_server(settings_for(tmp_path, backbone="default", max_batch_rows=8)) as srv:
        assert not tools.template_has_tools(srv.runtime.tokenizer)
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
        named = oc.chat.completions.create(model="base", messages=msgs, tools=TOOLS, max_tokens=64, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "weather"}})
        (call,) = named.choices[0].message.tool_calls
        assert valid_call(call)
        required = oc.chat.completions.create(model="base", messages=msgs, tools=TOOLS, tool_choice="required",
                                              max_tokens=96, temperature=0)
        assert required.choices[0].finish_reason == "tool_calls"
        assert all(valid_call(c) for c in required.choices[0].message.tool_calls)
        auto = oc.chat.completions.create(model="base", messages=msgs, tools=TOOLS, max_tokens=96, temperature=0)
        choice = auto.choices[0]
        assert choice.message.content or choice.message.tool_calls
        assert all(c.function.name in SCHEMAS for c in choice.message.tool_calls or ())
        history = [*msgs, named.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
        final = oc.chat.completions.create(model="base", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=32, temperature=0, extra_body={"return_prompt_text": True})
        assert final.choices[0].message.content
        prompt = final.model_extra["prompt_text"]
        assert "<tool_call>" in prompt and "<tool_response>\n21 C, sunny\n</tool_response>" in prompt
