"""Prompts are checked before any work is done for them: a token-id prompt's length and ids (a
huge integer is out of range, never a 500), and text with an unpaired UTF-16 surrogate (valid
JSON, no Unicode) is a 400 naming the field, on every generating route."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    build_store(root / "store")
    with live_server(settings_for(root, warmup=False, max_prompt_tokens=64), tiny_backbone()) as srv:
        resolved: list[str] = []
        registry = srv.runtime.registry
        real = registry.resolve
        registry.resolve = lambda task, tenant=None: resolved.append(task) or real(task, tenant)
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            yield c, resolved


def post(c: httpx.Client, path: str, raw: str) -> httpx.Response:
    return c.post(path, content=raw.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize("ids", ["[100000000000000000000000000000]", "[9223372036854775808]", "[" + "9" * 400 + "]",
                                 "[259]", "[1, 2, 300]"], ids=["1e29", "2^63", "400-digits", "vocab", "third"])
def test_a_token_id_outside_the_vocabulary_is_refused_before_any_work(server, ids):
    c, resolved = server
    before = len(resolved)
    r = post(c, "/v1/completions", f'{{"model": "alpha", "prompt": {ids}, "max_tokens": 2}}')
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and "[0, 259)" in r.json()["error"]["message"]
    assert len(resolved) == before, "the task's adapter was resolved for a prompt that is refused"


def test_a_token_id_prompt_over_the_limit_is_413_before_any_work(server):
    c, resolved = server
    before = len(resolved)
    r = post(c, "/v1/completions", json.dumps({"model": "alpha", "prompt": [1] * 65, "max_tokens": 2}))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # OpenAI's 400
    assert len(resolved) == before
    r = post(c, "/v1/completions", json.dumps({"model": "alpha", "prompt": [1] * 10, "max_tokens": 2}))
    assert r.status_code == 200 and len(resolved) == before + 1


@pytest.mark.parametrize("path,body,field", [
    ("/v1/generate", '{"task": "alpha", "prompt": "a\\ud800b", "max_new_tokens": 2}', "prompt"),
    ("/v1/generate", '{"task": "base", "prompt": "\\udc00", "max_new_tokens": 2}', "prompt"),
    ("/v1/chat/completions", ('{"model": "base", "messages": [{"role": "user", "content": "x\\ud83d"}], '
     '"max_tokens": 2}'), "messages"),
    ("/v1/completions", '{"model": "base", "prompt": "x\\ud83d", "max_tokens": 2}', "prompt"),
], ids=["generate-high", "generate-low", "chat", "completions"])
def test_an_unpaired_surrogate_is_a_4xx_naming_the_field(server, path, body, field):
    c, _ = server
    r = post(c, path, body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == field
    # a paired one is an ordinary character
    ok = post(c, path, body.replace("\\ud800", "\\ud83d\\ude00").replace("\\udc00", "\\ud83d\\ude00")
              .replace("x\\ud83d", "x\\ud83d\\ude00"))
    assert ok.status_code == 200, ok.text
