"""The prefix cache seen through the official client: usage.prompt_tokens_details.cached_tokens,
the tenant rule, cache_salt, chat history, streaming usage and the Prometheus series."""

from __future__ import annotations

import httpx
import pytest

from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

openai = pytest.importorskip("openai")

SYSTEM = "You are a terse assistant. Answer with one word, never explain, and keep to the facts. " * 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    build_store(root / "store")
    settings = settings_for(root, api_keys=["acme:key-a", "globex:key-b"], max_new_tokens=16)
    with live_server(settings, tiny_backbone()) as srv:
        yield srv


def client(server, key: str):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def complete(oc, prompt: str, **extra):
    return oc.completions.create(model="alpha", prompt=prompt, max_tokens=2, temperature=0,
                                 extra_body=extra or None).usage


def test_a_repeated_prompt_reports_its_cached_tokens_to_its_own_tenant_only(server):
    a, b = client(server, "key-a"), client(server, "key-b")
    prompt = SYSTEM + "Question: the capital of France?"
    first = complete(a, prompt)
    assert cached(first) == 0 and first.prompt_tokens > 64
    again = complete(a, prompt)
    assert 0 < cached(again) < again.prompt_tokens and cached(again) % 16 == 0
    assert cached(complete(b, prompt)) == 0  # another tenant computes its own
    assert cached(complete(a, prompt, cache_salt="mine")) == 0  # a salt narrows reuse
    assert cached(complete(a, prompt, cache_salt="mine")) == cached(again)
    other = complete(a, SYSTEM + "Question: the capital of Spain?")  # the same system prompt
    assert cached(other) >= len(SYSTEM) // 16 * 16 - 16


def test_a_chat_turn_reuses_the_conversation_before_it(server):
    a = client(server, "key-a")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    first = a.chat.completions.create(model="base", messages=messages, max_tokens=4, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or "red"},
                 {"role": "user", "content": "Another one."}]
    second = a.chat.completions.create(model="base", messages=messages, max_tokens=4, temperature=0)
    assert cached(first.usage) == 0
    assert cached(second.usage) >= first.usage.prompt_tokens // 16 * 16 - 16


def test_streamed_usage_carries_the_cached_tokens(server):
    a = client(server, "key-a")
    prompt = SYSTEM + "Question: streamed?"
    complete(a, prompt)
    chunks = list(a.completions.create(model="alpha", prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert cached(chunks[-1].usage) > 0


def test_bad_salts_are_refused_naming_the_field(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer key-a"}) as http:
        for salt in ("", "x" * 257, 7):
            r = http.post("/v1/completions", json={"model": "alpha", "prompt": "hi", "cache_salt": salt})
            assert r.status_code in (400, 422) and "cache_salt" in r.text


def test_the_metrics_count_queries_and_hits(server):
    complete(client(server, "key-a"), SYSTEM + "Question: metrics?")
    complete(client(server, "key-a"), SYSTEM + "Question: metrics?")
    text = httpx.get(server.url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("polyserve_prefix_cache")}
    assert values["polyserve_prefix_cache_query_tokens_total"] > values["polyserve_prefix_cache_hit_tokens_total"] > 0
    assert values["polyserve_prefix_cache_blocks"] > 0
