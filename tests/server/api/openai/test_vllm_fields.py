"""Every request field of vLLM's OpenAI server (0.32: ChatCompletionRequest, CompletionRequest,
StreamOptions, read field by field from its protocol) is accepted here or refused with a row of
docs/openai.md saying why; the ones polyserve honours do what vLLM does with them (live tiny server)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from server.api.openai.schemas import ChatRequest, CompletionRequest, StreamOptions
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

OPENAI_DOC = Path(__file__).resolve().parents[4] / "docs" / "openai.md"

# vLLM 0.32's request fields, in its order
VLLM_CHAT = [
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "thinking_token_budget", "include_reasoning",
    "parallel_tool_calls", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side",
    "prompt_logprobs", "logprob_token_ids", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "media_io_kwargs", "mm_processor_kwargs", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
    "return_prompt_text", "mm_payload", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "repetition_detection", "stream_interval",
]
VLLM_COMPLETION = [
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
    "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words", "prompt_embeds",
    "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
    "mm_payload", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "thinking_token_budget", "stream_interval",
]
VLLM_STREAM_OPTIONS = ["include_usage", "continuous_usage_stats"]

# vLLM's defaults, sent as a client that spells them out would (each must be accepted)
DEFAULTS = {
    "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": False, "top_logprobs": 0, "n": 1, "presence_penalty": 0.0,
    "response_format": {"type": "text"}, "seed": 1, "stop": [], "stream": False, "temperature": 0.0, "top_p": 1.0,
    "tool_choice": "none", "include_reasoning": True, "parallel_tool_calls": True, "use_beam_search": False,
    "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "length_penalty": 1.0, "stop_token_ids": [],
    "include_stop_str_in_output": False, "ignore_eos": False, "min_tokens": 0, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "bad_words": [], "echo": False, "add_generation_prompt": True,
    "continue_final_message": False, "add_special_tokens": False, "priority": 0, "request_id": "r-1",
    "routed_experts_prompt_start": 0, "return_token_offsets": False, "mm_payload": "tensors",
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


def refused_rows() -> str:
    rows = [line for line in OPENAI_DOC.read_text().splitlines()
            if line.startswith("|") and "refused" in line.split("|")[1]]
    return "\n".join(rows)


@pytest.mark.parametrize(("vllm", "ours"), [(VLLM_CHAT, ChatRequest), (VLLM_COMPLETION, CompletionRequest),
                                            (VLLM_STREAM_OPTIONS, StreamOptions)],
                         ids=["chat", "completions", "stream_options"])
def test_every_vllm_field_is_accepted_or_refused_with_a_doc_row(vllm, ours):
    refused = refused_rows()
    doc = OPENAI_DOC.read_text()
    for name in vllm:
        mentioned = re.search(rf"`{re.escape(name)}[`:. ]", doc) or (
            ours is StreamOptions and f"`stream_options.{name}`" in doc)
        if name in ours.model_fields:
            assert mentioned or name in ("messages", "model", "prompt", "cache_salt"), \
                f"{name}: accepted but not in docs/openai.md"
        else:
            assert re.search(rf"`{re.escape(name)}[`:. ]", refused), \
                f"{name}: vLLM accepts it, polyserve refuses it, and no 'refused' row of docs/openai.md says so"


# -- live ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_fields")
    build_store(root / "store")
    with live_server(settings_for(root, max_new_tokens=32, max_prompt_tokens=64, max_n=4), tiny_backbone()) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


MSGS = [{"role": "user", "content": "hello there"}]


def chunks(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_vllms_defaults_spelled_out_are_accepted(http, route):
    own = ChatRequest.model_fields if route == "chat" else CompletionRequest.model_fields
    body = {k: v for k, v in DEFAULTS.items() if k in own}
    if route == "completions":  # its own defaults there
        body.update({"logprobs": None, "add_special_tokens": True})
    body.update({"model": "base", "max_tokens": 4, "stream": False})
    body.pop("stream_options")
    if route == "chat":
        r = http.post("/v1/chat/completions", json={**body, "messages": MSGS})
    else:
        r = http.post("/v1/completions", json={**body, "prompt": "hello"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_is_in_every_chunk(http, route):
    body = {"model": "base", "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = http.post(path, json={**body, **({"messages": MSGS} if route == "chat" else {"prompt": "hello"})})
    assert r.status_code == 200, r.text
    events = chunks(r)
    assert all("usage" in e for e in events)
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 12
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    prompt = {e["usage"]["prompt_tokens"] for e in events}
    assert len(prompt) == 1
    plain = http.post(path, json={**body, "stream_options": {"include_usage": True},
                                  **({"messages": MSGS} if route == "chat" else {"prompt": "hello"})})
    assert all("usage" not in e for e in chunks(plain) if e["choices"])  # only with continuous_usage_stats


def test_return_token_ids_match_the_text_and_the_prompt(server, http):
    tok = server.runtime.tokenizer
    for route, extra in (("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "hello"})):
        body = {"model": "base", "max_tokens": 10, "temperature": 0, "return_token_ids": True, **extra}
        r = http.post(route, json=body).json()
        choice = r["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert tok.decode(choice["token_ids"], skip_special_tokens=True) == text
        assert len(choice["token_ids"]) == r["usage"]["completion_tokens"]
        prompt_ids = r.get("prompt_token_ids") or choice["prompt_token_ids"]
        assert len(prompt_ids) == r["usage"]["prompt_tokens"]
        streamed = chunks(http.post(route, json={**body, "stream": True}))
        ids = [t for e in streamed for c in e["choices"] for t in c.get("token_ids", [])]
        assert ids == choice["token_ids"]
        firsts = [e.get("prompt_token_ids") or e["choices"][0].get("prompt_token_ids") for e in streamed[:1]]
        assert firsts == [prompt_ids]


def test_prompt_logprobs_cover_the_prompt(http):
    for route, extra in (("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "hello"})):
        r = http.post(route, json={"model": "base", "max_tokens": 2, "prompt_logprobs": 2, "return_token_ids": True,
                                   **extra}).json()
        entries = r.get("prompt_logprobs") or r["choices"][0]["prompt_logprobs"]
        ids = r.get("prompt_token_ids") or r["choices"][0]["prompt_token_ids"]
        assert len(entries) == len(ids) and entries[0] is None
        for token, entry in zip(ids[1:], entries[1:], strict=True):
            assert str(token) in entry and 1 <= len(entry) <= 3
            assert all(v["logprob"] <= 0 and "decoded_token" in v for v in entry.values())
        refused = http.post(route, json={"model": "base", "max_tokens": 2, "prompt_logprobs": 1, "stream": True,
                                         **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_truncate_prompt_tokens(http):
    long = "word " * 40  # over POLYSERVE_MAX_PROMPT_TOKENS=64 byte tokens
    assert http.post("/v1/completions", json={"model": "base", "prompt": long, "max_tokens": 1}).status_code == 400
    for n, want in ((-1, 64), (10, 10)):
        r = http.post("/v1/completions", json={"model": "base", "prompt": long, "max_tokens": 1,
                                               "return_prompt_text": True, "truncate_prompt_tokens": n}).json()
        assert r["usage"]["prompt_tokens"] == want
        assert long.endswith(r["choices"][0]["prompt_text"])  # left: the last tokens are kept
    right = http.post("/v1/completions", json={"model": "base", "prompt": long, "max_tokens": 1,
                                               "return_prompt_text": True, "truncate_prompt_tokens": 10,
                                               "truncation_side": "right"}).json()
    assert right["choices"][0]["prompt_text"] == long[:10]
    chat = http.post("/v1/chat/completions", json={"model": "base", "messages": [{"role": "user", "content": long}],
                                                   "max_tokens": 1, "truncate_prompt_tokens": 20}).json()
    assert chat["usage"]["prompt_tokens"] == 20


def test_tokens_as_token_ids(http):
    r = http.post("/v1/chat/completions", json={"model": "base", "messages": MSGS, "max_tokens": 3, "logprobs": True,
                                                "top_logprobs": 1, "return_tokens_as_token_ids": True}).json()
    tokens = [e["token"] for e in r["choices"][0]["logprobs"]["content"]]
    assert tokens and all(re.fullmatch(r"token_id:\d+", t) for t in tokens)


def test_chat_template_extensions(http):
    convo = [*MSGS, {"role": "assistant", "content": "Hi, I am"}]
    base = {"model": "base", "messages": convo, "max_tokens": 4, "temperature": 0, "return_prompt_text": True}
    cont = http.post("/v1/chat/completions", json={**base, "add_generation_prompt": False,
                                                   "continue_final_message": True, "echo": True}).json()
    assert cont["prompt_text"].endswith("<|im_start|>assistant\nHi, I am")
    implied = http.post("/v1/chat/completions", json={**base, "continue_final_message": True}).json()
    assert implied["prompt_text"] == cont["prompt_text"]  # continuing adds no generation prompt
    assert cont["choices"][0]["message"]["content"].startswith("Hi, I am")
    plain = http.post("/v1/chat/completions", json={**base, "add_generation_prompt": False}).json()
    assert plain["prompt_text"].endswith("Hi, I am<|im_end|>\n")
    new_turn = http.post("/v1/chat/completions", json=base).json()
    assert new_turn["prompt_text"].endswith("<|im_end|>\n<|im_start|>assistant\n")
    kwargs = http.post("/v1/chat/completions", json={**base, "chat_template_kwargs": {"enable_thinking": False},
                                                     "documents": [{"title": "t", "text": "x"}]})
    assert kwargs.status_code == 200, kwargs.text


def test_structured_outputs_is_response_format(http):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for so in ({"json": schema}, {"json_object": True}):
        for route, extra in (("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "x"})):
            r = http.post(route, json={"model": "base", "max_tokens": 32, "temperature": 0, "structured_outputs": so,
                                       **extra})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            if choice["finish_reason"] == "stop":
                value = json.loads(text)
                assert isinstance(value, dict) and ("json" not in so or set(value) == {"ok"})


REFUSED = [
    ({"priority": 1}, "priority"), ({"use_beam_search": True}, "use_beam_search"),
    ({"allowed_token_ids": [1]}, "allowed_token_ids"), ({"bad_words": ["x"]}, "bad_words"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"),
    ({"chat_template": "{{ x }}"}, "chat_template"),
    ({"structured_outputs": {"json": {}, "json_object": True}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{}"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "messages"),  # the last message is the user's
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"stream_options": {"include_usage": True, "bogus": 1}}, "stream_options.bogus"),
]


@pytest.mark.parametrize(("extra", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_refused_extensions_are_400_naming_the_field(http, extra, param):
    r = http.post("/v1/chat/completions", json={"model": "base", "messages": MSGS, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
