"""Defaults and prompt formats said plainly: the OpenAPI document says what each generating route
does by default and which wraps a task's input in its trained format; a task's prompt format is
readable from /v1/tasks/{task} and /v1/models/{model}, and it is the one /v1/generate applies
(a raw /v1/completions prompt formatted with it gives /v1/generate's answer)."""

from __future__ import annotations

import httpx
import pytest

from adapters_store.backbone.prompt import PROMPT_FORMAT, PROMPT_TEMPLATE
from tests.support.server_fixtures import TASKS, build_store, live_server, settings_for, tiny_backbone


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    build_store(root / "store")
    with live_server(settings_for(root, warmup=False), tiny_backbone()) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def test_openapi_says_each_routes_default_and_format(client):
    paths = client.get("/openapi.json").json()["paths"]
    generate = paths["/v1/generate"]["post"]["description"]
    completions = paths["/v1/completions"]["post"]["description"]
    chat = paths["/v1/chat/completions"]["post"]["description"]
    assert "Greedy by default" in generate and "wrapped in the prompt format" in generate
    assert "temperature 1 by default" in completions and "sent raw" in completions
    assert "prompt_template" in completions
    assert "temperature 1 by default" in chat and "trained prompt format" in chat


def test_the_openai_defaults_are_what_the_descriptions_say(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["GenerateRequest"]["properties"]["temperature"]["default"] == 0.0
    for name in ("CompletionRequest", "ChatRequest"):
        schema = next(s for n, s in schemas.items() if n == name or n.startswith(name + "-"))
        assert schema["properties"]["temperature"]["default"] == 1.0, name


def test_a_task_shows_its_prompt_format(client):
    task = client.get(f"/v1/tasks/{TASKS[0]}").json()
    assert task["prompt_format"] == PROMPT_FORMAT and task["prompt_template"] == PROMPT_TEMPLATE
    listed = {t["id"]: t for t in client.get("/v1/tasks").json()["data"]}
    assert listed[TASKS[0]]["prompt_template"] == PROMPT_TEMPLATE
    model = client.get(f"/v1/models/{TASKS[0]}").json()
    assert model["prompt_format"] == PROMPT_FORMAT and model["prompt_template"] == PROMPT_TEMPLATE
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models[TASKS[1]]["prompt_template"] == PROMPT_TEMPLATE
    assert models["base"]["prompt_template"] is None  # base: the chat template or the raw prompt
    assert client.get("/v1/tasks/base").json()["prompt_template"] is None


@pytest.mark.parametrize("text", ["w1 x1", "apple river"])
def test_completions_with_the_template_answer_as_generate_does(client, text):
    task = client.get(f"/v1/tasks/{TASKS[0]}").json()
    prompt = task["prompt_template"].format(input=text)
    generated = client.post("/v1/generate", json={"task": TASKS[0], "prompt": text, "max_new_tokens": 6}).json()
    raw = client.post("/v1/completions", json={"model": TASKS[0], "prompt": prompt, "max_tokens": 6,
                                               "temperature": 0}).json()
    assert raw["choices"][0]["text"].removeprefix(" ") == generated["text"]
    # the raw input alone is another prompt: /v1/completions does not add the format
    bare = client.post("/v1/completions", json={"model": TASKS[0], "prompt": text, "max_tokens": 6,
                                                "temperature": 0}).json()
    assert bare["usage"]["prompt_tokens"] < raw["usage"]["prompt_tokens"]
