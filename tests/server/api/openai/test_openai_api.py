"""The OpenAI-compatible routes with the official `openai` client against a live server (tiny
backbone, random inventory): refused fields, error shapes, models, chat to a task, specials,
and the features the engine implements (n, logprobs, echo, penalties, logit_bias, seed)."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from tests.support.server_fixtures import TASKS, build_store, live_server, settings_for, tiny_backbone

openai = pytest.importorskip("openai")


def engine_supports(*names: str) -> bool:
    """Whether the native engine honours these SamplingParams fields (it once refused them at
    submit)."""
    try:
        from server.engines.native.core.engine import unsupported_fields
    except ImportError:
        return True
    from server.engines.request import SamplingParams

    probe = SamplingParams(n=2, logprobs=2, prompt_logprobs=1, presence_penalty=1.0, frequency_penalty=1.0,
                           repetition_penalty=1.5, logit_bias=((1, 1.0),))
    return not set(names) & set(unsupported_fields(probe))


def needs_engine(*names: str):
    return pytest.mark.skipif(not engine_supports(*names),
                              reason=f"the native engine does not implement {', '.join(names)} yet")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("oai")
    store = build_store(root / "store")
    from adapters_store.store.records import TaskRecord

    store.put_record(TaskRecord(id="pending", method="routing", status="training", version=0,
                                created_at=time.time(), updated_at=time.time()))
    settings = settings_for(root, max_prompt_tokens=64, max_new_tokens=64, max_n=4)
    with live_server(settings, tiny_backbone()) as srv:
        yield srv


@pytest.fixture(scope="module")
def oc(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def sse(text: str) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in text.splitlines() if line.startswith("data: ")]


# -- refused fields: 400 naming the field (OpenAI's shape) -------------------------------------------
REFUSED = [
    ("completions", {"suffix": "tail"}, "suffix"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"max_tokens": "5"}, "max_tokens"),
    ("completions", {"temperature": True}, "temperature"),
    ("completions", {"prompt": ["a"] * 65}, "prompt"),  # over POLYSERVE_MAX_PROMPTS_PER_REQUEST=64
    ("completions", {"n": 5}, "n"),  # over POLYSERVE_MAX_N=4
    ("completions", {"logit_bias": {"100000": 5}}, "logit_bias"),  # not in the vocabulary
    ("completions", {"logit_bias": {"abc": 5}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 500}}, "logit_bias.5"),
    ("completions", {"stream": True, "echo": True, "logprobs": 1}, "echo"),
    ("completions", {"stop": ["x" * 300]}, "stop"),
    ("completions", {"stop": [str(i) for i in range(9)]}, "stop"),
    ("completions", {"no_such_field": 1}, "no_such_field"),
    ("completions", {"max_tokens": 65}, "max_tokens"),
    ("completions", {"model": ""}, "model"),
    ("completions", {"prompt": [1, 2, 100000]}, "prompt"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools.0.function.parameters"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "x", "tool_call_id": "1"}]},
     "messages.1.tool_call_id"),  # answers no earlier call
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "system", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "messages"),  # chat to a task needs a user message
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
]


@pytest.mark.parametrize(("route", "extra", "param"), REFUSED, ids=[f"{r}-{p}" for r, _, p in REFUSED])
def test_refused_fields_are_400_naming_the_field(http, route, extra, param):
    if route == "completions":
        body = {"model": "alpha", "prompt": "hi", "max_tokens": 2, **extra}
        r = http.post("/v1/completions", json=body)
    else:
        body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert list(err) == ["message", "type", "param", "code"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_openai_client_sees_param_on_400(oc):
    with pytest.raises(openai.BadRequestError) as info:
        oc.completions.create(model="alpha", prompt="hi", max_tokens=2, suffix="tail")
    assert info.value.param == "suffix"


def test_ignored_fields_are_accepted(http):
    r = http.post("/v1/chat/completions", json={
        "model": "alpha", "messages": [{"role": "user", "content": "hi", "name": "ann"}], "max_tokens": 2,
        "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True,
        "tool_choice": "none", "response_format": {"type": "text"}, "temperature": 0})
    assert r.status_code == 200, r.text


def test_context_length_is_400_context_length_exceeded(oc, http):
    with pytest.raises(openai.BadRequestError) as info:
        oc.completions.create(model="alpha", prompt="word " * 100, max_tokens=2)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    # polyserve's own route keeps the contract's 413
    r = http.post("/v1/generate", json={"task": "alpha", "prompt": "word " * 100})
    assert r.status_code == 413 and r.json()["error"]["code"] == "context_length_exceeded"


def test_error_shapes_per_route_family(http):
    oai = http.post("/v1/completions", json={"model": "no-such-task", "prompt": "x"}).json()["error"]
    assert oai == {"message": oai["message"], "type": "invalid_request_error", "param": "model",
                   "code": "model_not_found"}
    own = http.post("/v1/generate", json={"task": "no-such-task", "prompt": "x"}).json()["error"]
    assert own == {"type": "not_found", "message": own["message"], "param": "task", "code": None}
    own = http.post("/v1/generate", json={"task": "alpha", "prompt": "x", "top_p": 0}).json()["error"]
    assert own["type"] == "validation_error" and own["param"] == "top_p" and set(own) == {
        "type", "message", "param", "code"}
    pending = http.post("/v1/chat/completions", json={"model": "pending", "messages": [
        {"role": "user", "content": "x"}]})
    assert pending.status_code == 409 and pending.json()["error"]["code"] == "task_not_ready"


def test_405_carries_every_allowed_method(http):
    r = http.request("OPTIONS", "/v1/tasks")
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
    r = http.put("/v1/tasks/alpha")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"  # an OpenAI route: OpenAI's shape


def test_models_list_and_retrieve(oc):
    listed = {m.id: m for m in oc.models.list().data}
    assert {"base", *TASKS} == set(listed) and all(m.owned_by and m.created > 0 for m in listed.values())
    alpha = oc.models.retrieve("alpha")
    assert alpha.id == "alpha" and alpha.created == listed["alpha"].created and alpha.object == "model"
    assert oc.models.retrieve("base").id == "base"
    for missing in ("no-such-task", "pending", "Bad!"):
        with pytest.raises(openai.NotFoundError):
            oc.models.retrieve(missing)


@pytest.mark.parametrize("task", ["alpha", "delta"])
def test_chat_to_a_task_answers_like_generate(oc, http, task):
    """The conversation's last user message is the task's input, in its training format."""
    for text in ("hello world", "0123"):
        gen = http.post("/v1/generate", json={"task": task, "prompt": text, "max_new_tokens": 12}).json()
        msgs = [{"role": "system", "content": "ignored"}, {"role": "user", "content": "earlier"},
                {"role": "assistant", "content": "turn"}, {"role": "user", "content": text}]
        chat = oc.chat.completions.create(model=task, messages=msgs, max_tokens=12, temperature=0)
        assert chat.choices[0].message.content == gen["text"]
        assert chat.usage.prompt_tokens == gen["usage"]["prompt_tokens"]
        streamed = oc.chat.completions.create(model=task, messages=msgs, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == gen["text"]


def test_base_chat_uses_the_chat_template(server, http):
    tok = server.runtime.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    chat = http.post("/v1/chat/completions", json={"model": "base", "messages": msgs, "max_tokens": 1,
                                                  "temperature": 0}).json()
    templated = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert chat["usage"]["prompt_tokens"] == len(tok(templated, add_special_tokens=False).input_ids)


def test_tiny_temperature_is_answered(http):
    """Temperature 1e-38 once made logits / T overflow and failed every row in flight."""
    for route, body in (("/v1/generate", {"task": "alpha", "prompt": "x", "temperature": 1e-38,
                                          "max_new_tokens": 4}),
                        ("/v1/completions", {"model": "alpha", "prompt": "x", "temperature": 0.5, "top_p": 5e-324,
                                             "max_tokens": 4})):
        r = http.post(route, json=body)
        assert r.status_code == 200, r.text


def test_completion_prompt_as_token_ids(server, http):
    ids = server.runtime.tokenizer("Input: abc\nOutput:").input_ids
    by_ids = http.post("/v1/completions", json={"model": "gamma", "prompt": ids, "max_tokens": 6,
                                                "temperature": 0}).json()
    by_text = http.post("/v1/completions", json={"model": "gamma", "prompt": "Input: abc\nOutput:",
                                                 "max_tokens": 6, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


# -- the engine's features through the HTTP layer ---------------------------------------------------
def token_bytes(token: str) -> bytes:
    """A legacy logprobs token's bytes (`bytes:\\xNN...` for part of a character)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode()


def joined(tokens: list[str]) -> str:
    """The text the tokens spell (invalid UTF-8 replaced, as the detokenizer does)."""
    return b"".join(token_bytes(t) for t in tokens).decode(errors="replace")


@needs_engine("n")
def test_n_choices_greedy_equal_seeded_reproducible(oc):
    greedy = oc.completions.create(model="alpha", prompt="Hello", max_tokens=8, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1
    single = oc.completions.create(model="alpha", prompt="Hello", max_tokens=8, temperature=0)
    assert greedy.usage.completion_tokens == 3 * single.usage.completion_tokens
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens
    a = oc.completions.create(model="alpha", prompt="Hello", max_tokens=12, temperature=1.0, n=3, seed=7)
    b = oc.completions.create(model="alpha", prompt="Hello", max_tokens=12, temperature=1.0, n=3, seed=7)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # choice i samples with seed + i
    chunks = list(oc.chat.completions.create(model="base", messages=[{"role": "user", "content": "x"}],
                                             max_tokens=6, temperature=1.0, n=2, seed=3, stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


@needs_engine("logprobs")
def test_logprobs_consistent_with_greedy(oc):
    chat = oc.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "abc"}],
                                      max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == chat.choices[0].message.content
    assert content and all(math.isfinite(t.logprob) and t.logprob <= 0 for t in content)
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    legacy = oc.completions.create(model="alpha", prompt="Input: abc\nOutput:", max_tokens=6, temperature=0,
                                   logprobs=2)
    lp = legacy.choices[0].logprobs
    assert joined(lp.tokens) == legacy.choices[0].text
    raw = [token_bytes(t) for t in lp.tokens]
    assert lp.text_offset == [len(b"".join(raw[:i]).decode(errors="ignore")) for i in range(len(raw))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(value) and top[token] == pytest.approx(value)


@needs_engine("prompt_logprobs")
def test_echo_returns_prompt_and_its_logprobs(oc):
    prompt = "Input: abc\nOutput:"
    c = oc.completions.create(model="alpha", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    assert c.choices[0].text.startswith(prompt)
    lp = c.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert joined(lp.tokens) == c.choices[0].text


@needs_engine("presence_penalty", "frequency_penalty", "repetition_penalty")
def test_penalties_change_a_repetitive_answer(oc):
    base = oc.completions.create(model="base", prompt="a a a a a a", max_tokens=24, temperature=0)
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        pen = oc.completions.create(model="base", prompt="a a a a a a", max_tokens=24, temperature=0, **kw)
        assert pen.choices[0].text != base.choices[0].text, kw


@needs_engine("logit_bias")
def test_logit_bias_forces_a_token(server, oc):
    token = server.runtime.tokenizer("Z", add_special_tokens=False).input_ids[0]
    c = oc.completions.create(model="alpha", prompt="hello", max_tokens=4, temperature=0,
                              logit_bias={str(token): 100})
    assert c.choices[0].text == "ZZZZ"


def test_specials_added_as_the_tokenizer_says(tmp_path):
    """A backbone whose tokenizer adds BOS: /v1/generate encodes the prompt exactly as training
    does (training.batching.encode_prompt), /v1/completions adds BOS too, chat on `base` relies on
    the template's own specials (no second BOS)."""
    from tokenizers.processors import TemplateProcessing

    from training.batching import encode_prompt

    bb = tiny_backbone()
    tok = bb.tokenizer
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    assert tok("ab").input_ids[0] == bos  # the tokenizer now adds BOS
    build_store(tmp_path / "store")
    with live_server(settings_for(tmp_path, warmup=False), bb) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        gen = c.post("/v1/generate", json={"task": "alpha", "prompt": "abc", "max_new_tokens": 1}).json()
        assert gen["usage"]["prompt_tokens"] == len(encode_prompt(tok, "abc"))
        cmpl = c.post("/v1/completions", json={"model": "alpha", "prompt": "abc", "max_tokens": 1}).json()
        assert cmpl["usage"]["prompt_tokens"] == 1 + len(tok("abc", add_special_tokens=False).input_ids)
        msgs = [{"role": "user", "content": "hi"}]
        chat = c.post("/v1/chat/completions", json={"model": "base", "messages": msgs, "max_tokens": 1}).json()
        templated = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert chat["usage"]["prompt_tokens"] == len(tok(templated, add_special_tokens=False).input_ids)


@pytest.mark.slow
def test_default_backbone_chat_to_a_task_and_specials(tmp_path):
    """SmolLM2's tokenizer adds no BOS (its config has no add_bos_token): /v1/generate feeds exactly
    training's encoding of the formatted prompt; chat to a shipped task answers as /v1/generate;
    models.retrieve works; chat with `base` uses the chat template."""
    from tests.support.server_fixtures import shipped_inventory_available
    from training.batching import encode_prompt

    if not shipped_inventory_available():
        pytest.skip("no shipped default inventory")
    settings = settings_for(tmp_path, backbone="default", max_batch_rows=8)
    with live_server(settings) as srv:
        tok = srv.runtime.tokenizer
        assert tok("x").input_ids == tok("x", add_special_tokens=False).input_ids  # no BOS added
        task = next(r.id for r in srv.runtime.registry.list() if r.status == "ready")
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert oc.models.retrieve(task).id == task
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            for text in ("apple 3 river 7", "cat dog"):
                gen = c.post("/v1/generate", json={"task": task, "prompt": text, "max_new_tokens": 16}).json()
                assert gen["usage"]["prompt_tokens"] == len(encode_prompt(tok, text))
                chat = oc.chat.completions.create(model=task, messages=[{"role": "user", "content": text}],
                                                  max_tokens=16, temperature=0)
                assert chat.choices[0].message.content == gen["text"]
        base = oc.chat.completions.create(model="base", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
        templated = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                            add_generation_prompt=True)
        assert base.usage.prompt_tokens == len(tok(templated, add_special_tokens=False).input_ids)


@pytest.mark.slow
@needs_engine("n", "logprobs", "frequency_penalty")
def test_default_backbone_n_logprobs_penalties(tmp_path):
    # float32: the penalty check needs the float32 model's looping answer to the repeated prompt
    settings = settings_for(tmp_path, backbone="default", max_batch_rows=8, dtype="float32")
    with live_server(settings) as srv:
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "Name three colours."}]
        greedy = oc.chat.completions.create(model="base", messages=msgs, max_tokens=12, temperature=0, n=2,
                                            logprobs=True, top_logprobs=2)
        assert greedy.choices[0].message.content == greedy.choices[1].message.content
        for t in greedy.choices[0].logprobs.content:
            assert math.isfinite(t.logprob) and t.top_logprobs[0].token == t.token
        rep = "the the the the the the the the"
        plain = oc.completions.create(model="base", prompt=rep, max_tokens=12, temperature=0)
        penalised = oc.completions.create(model="base", prompt=rep, max_tokens=12, temperature=0,
                                          frequency_penalty=2.0)
        assert plain.choices[0].text != penalised.choices[0].text


def test_openapi_states_the_vocabulary_bound_of_logit_bias(http):
    import re

    schema = http.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
    pattern = re.compile(schema["properties"]["logit_bias"]["propertyNames"]["pattern"])
    assert pattern.fullmatch("258") and not pattern.fullmatch("259")  # the tiny vocabulary: 259 ids
