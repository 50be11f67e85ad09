"""A task's demonstrations through the real HTTP server (native engine, tiny backbone): they go
before every prompt of the task on every route, count in usage, are never echoed, hit the prefix
cache from the second request on, and stay their owner's."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import torch

from adapters_store.backbone.prompt import format_prompt, format_target
from adapters_store.backbone.tiny import tiny_tokenizer
from adapters_store.store.directory import DirectoryStore
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

DEMOS = [{"input": f"word{i} and more", "output": f"answer {i}"} for i in range(6)]
TEXT = "".join(format_prompt(d["input"]) + format_target(d["output"]) + "\n\n" for d in DEMOS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("demos")
    store: DirectoryStore = build_store(root / "store")
    row = store.load_routing("alpha")
    store.put_routing("told", row, method="auto", demonstrations=DEMOS)  # alpha's row and demonstrations
    shown = store.put_demonstrations("shown", DEMOS, method="demos")  # the bare backbone and them
    store.put_record(replace(store.put_demonstrations("mine", DEMOS, method="demos"), owner="acme"))
    assert shown.kind == "demos"
    settings = settings_for(root, api_keys=["acme:key-a", "globex:key-b"], max_new_tokens=8)
    with live_server(settings, tiny_backbone()) as srv:
        yield srv


def http(server, key="key-a"):
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def ids(text: str, special: bool = True) -> list[int]:
    return list(tiny_tokenizer()(text, add_special_tokens=special).input_ids)


def complete(c, model, prompt, **extra):
    r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                        **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_demonstrations_tokenise_as_training_encodes_them():
    # training encodes context + prompt as one string (training.batching.encode_prompt); serving puts
    # the demonstrations' own ids first: the same tokens
    for text in ("cat dog 3", "Maria drove to Lisbon", "  spaced", "ünï"):
        assert ids(TEXT) + ids(format_prompt(text), special=False) == ids(TEXT + format_prompt(text))


@pytest.mark.parametrize("task, bare", [("told", "alpha"), ("shown", "base")])
def test_a_generation_answers_as_the_adapter_after_the_demonstrations_would(server, task, bare):
    with http(server) as c:
        r = c.post("/v1/generate", json={"task": task, "prompt": "word9 and more", "max_new_tokens": 6})
        assert r.status_code == 200, r.text
        got = r.json()
        # the same adapter (or none), fed the demonstrations and the formatted prompt raw
        raw = complete(c, bare, TEXT + format_prompt("word9 and more"))
    assert (got["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
            == len(ids(TEXT + format_prompt("word9 and more"))))
    assert got["text"].strip() == raw["choices"][0]["text"].strip()


def test_chat_and_completions_carry_them_too_and_echo_only_the_callers_prompt(server):
    with http(server) as c:
        chat = c.post("/v1/chat/completions", json={"model": "shown", "max_tokens": 4, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "word9 and more"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(ids(TEXT + format_prompt("word9 and more")))
        echoed = complete(c, "shown", "hello there", echo=True, logprobs=1, return_token_ids=True)
    choice = echoed["choices"][0]
    assert choice["text"].startswith("hello there") and "word0" not in choice["text"]
    assert choice["prompt_token_ids"] == ids("hello there", special=False)
    assert choice["logprobs"]["tokens"][0] == tiny_tokenizer().decode(ids("hello there", special=False)[:1])
    assert echoed["usage"]["prompt_tokens"] == len(ids(TEXT)) + len(ids("hello there", special=False))


def test_from_the_second_request_on_the_demonstrations_come_from_the_prefix_cache(server):
    with http(server) as c:
        complete(c, "told", format_prompt("first"))
        second = complete(c, "told", format_prompt("second one"))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids(TEXT)) // 16 * 16


def test_they_are_shown_with_the_task_to_whoever_may_see_it_and_to_nobody_else(server):
    with http(server, "key-a") as a, http(server, "key-b") as b:
        task = a.get("/v1/tasks/mine").json()
        assert [d["input"] for d in task["demonstrations"]] == [d["input"] for d in DEMOS]
        assert task["kind"] == "demos"
        assert b.get("/v1/tasks/mine").status_code == 404
        assert "mine" not in [t["id"] for t in b.get("/v1/tasks").json()["data"]]
        r = b.post("/v1/generate", json={"task": "mine", "prompt": "x", "max_new_tokens": 2})
        assert r.status_code == 404 and "word0" not in r.text


def test_a_demos_task_needs_no_adapter_and_its_row_less_version_is_not_a_retrieval_candidate(server):
    store = server.runtime.store
    assert "shown" not in store.routing_rows(limit=100)
    assert torch.is_tensor(store.load_routing("told"))
