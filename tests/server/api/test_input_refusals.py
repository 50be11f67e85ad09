"""Inputs refused with a clear error (tiny backbone, real HTTP): an empty prompt or input on every
generating route, a registration below the minimum number of examples, a body that is not a JSON
object, an unknown task named by the route's own field. Each refusal: its status, the field
named in `param` and the message, and nothing stored (no task record, no job)."""

from __future__ import annotations

import httpx
import pytest

from adapters_store.store.directory import DirectoryStore
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

EXAMPLES = [{"input": f"w{i} x{i}", "output": f"x{i} w{i}"} for i in range(8)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    store = build_store(root / "store")
    with live_server(settings_for(root, min_examples_per_task=4, warmup=False), tiny_backbone()) as srv:
        yield srv, store


@pytest.fixture
def client(served):
    with httpx.Client(base_url=served[0].url, timeout=30) as c:
        yield c


@pytest.fixture
def store(served) -> DirectoryStore:
    return served[1]


def refused(r: httpx.Response, status: int, field: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == field, error
    assert field in error["message"], error
    return error


def nothing_stored(store: DirectoryStore, task: str, jobs_before: int) -> None:
    assert task not in {t.id for t in store.list_tasks()}
    assert len(store.list_jobs()) == jobs_before


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_an_empty_prompt_on_generate_is_422_naming_prompt(client, prompt):
    error = refused(client.post("/v1/generate", json={"task": "alpha", "prompt": prompt}), 422, "prompt")
    assert "empty" in error["message"]


def test_an_empty_prompt_on_completions_is_400_naming_prompt_once(client):
    # OpenAI's status for bad input; one plain message, not one per member of the prompt's union type
    error = refused(client.post("/v1/completions", json={"model": "alpha", "prompt": ""}), 400, "prompt")
    assert error["message"] == "prompt: must not be empty", error
    refused(client.post("/v1/completions", json={"model": "alpha", "prompt": []}), 400, "prompt")
    error = refused(client.post("/v1/completions", json={"model": "alpha", "prompt": ["ok", ""]}), 400, "prompt")
    assert error["message"] == "prompt.1: must not be empty", error


@pytest.mark.parametrize(("model", "messages", "why"), [
    ("alpha", [], "must not be empty"),
    ("alpha", [{"role": "user", "content": ""}], "empty"),
    ("alpha", [{"role": "user", "content": "hello"}, {"role": "user", "content": "  "}], "empty"),
    ("alpha", [{"role": "user", "content": [{"type": "text", "text": ""}]}], "empty"),
    ("base", [{"role": "system", "content": ""}, {"role": "user", "content": ""}], "every message is empty"),
])
def test_chat_with_nothing_to_answer_is_400_naming_messages(client, model, messages, why):
    error = refused(client.post("/v1/chat/completions", json={"model": model, "messages": messages}),
                    400, "messages")
    assert why in error["message"], error


def test_chat_where_an_empty_message_makes_sense_is_served(client):
    # base: an empty system message beside a real question is an ordinary conversation
    r = client.post("/v1/chat/completions", json={"model": "base", "max_tokens": 2, "messages": [
        {"role": "system", "content": ""}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    # a task answers the last user message: an empty earlier turn is not its input
    r = client.post("/v1/chat/completions", json={"model": "alpha", "max_tokens": 2, "messages": [
        {"role": "user", "content": ""}, {"role": "user", "content": "w1 x1"}]})
    assert r.status_code == 200, r.text


def test_an_unknown_task_names_the_routes_own_field(client):
    error = refused(client.post("/v1/generate", json={"task": "no-such-task", "prompt": "x"}), 404, "task")
    assert error["type"] == "not_found"
    error = refused(client.post("/v1/completions", json={"model": "no-such-task", "prompt": "x"}), 404, "model")
    assert error["code"] == "model_not_found"
    refused(client.post("/v1/chat/completions", json={"model": "no-such-task", "messages": [
        {"role": "user", "content": "x"}]}), 404, "model")
    # a mix whose member is unknown: the same field
    refused(client.post("/v1/generate", json={"task": "mix:alpha=1,nope=1", "prompt": "x"}), 404, "task")


@pytest.mark.parametrize("n", [1, 3])
def test_registration_below_the_minimum_is_422_naming_it_and_stores_nothing(client, store, n):
    before = len(store.list_jobs())
    r = client.post("/v1/tasks", json={"task": "too-few", "examples": EXAMPLES[:n]})
    error = refused(r, 422, "examples")
    assert "at least 4" in error["message"] and f"got {n}" in error["message"], error
    nothing_stored(store, "too-few", before)
    assert client.get("/v1/tasks/too-few").status_code == 404


def test_the_minimum_is_stated_in_the_openapi_document(client):
    schema = client.get("/openapi.json").json()["components"]["schemas"]["RegisterRequest"]
    (array,) = [b for b in schema["properties"]["examples"]["anyOf"] if b.get("type") == "array"]
    assert array["minItems"] == 4


def test_registration_with_an_empty_input_or_output_stores_nothing(client, store):
    before = len(store.list_jobs())
    for i, side in enumerate(("input", "output")):
        examples = [dict(e) for e in EXAMPLES]
        examples[2][side] = ""
        error = refused(client.post("/v1/tasks", json={"task": "blank", "examples": examples}), 422,
                        f"examples.2.{side}")
        assert error["message"] == f"examples.2.{side}: must not be empty", error
    nothing_stored(store, "blank", before)


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"content": b'{"task": "alpha", "prompt": "x"}'}, "Content-Type: application/json (got none)"),
    ({"content": b'{"task": "alpha", "prompt": "x"}', "headers": {"content-type": "text/plain"}},
     "Content-Type: application/json (got text/plain)"),
    ({"content": b"task=alpha&prompt=x", "headers": {"content-type": "application/x-www-form-urlencoded"}},
     "(got application/x-www-form-urlencoded)"),
    ({"content": b'{"task": "alpha",', "headers": {"content-type": "application/json"}}, "not valid JSON"),
    ({"content": b"", "headers": {"content-type": "application/json"}}, "body: empty"),
    ({"content": b'["alpha", "x"]', "headers": {"content-type": "application/json"}}, "must be a JSON object"),
])
@pytest.mark.parametrize("path", ["/v1/generate", "/v1/tasks"])
def test_a_body_that_is_not_a_json_object_is_said_so_in_words(client, store, kwargs, says, path):
    before = len(store.list_jobs())
    error = refused(client.post(path, **kwargs), 422, "body")
    assert says in error["message"], error
    assert "dictionary" not in error["message"] and "extract fields" not in error["message"]
    nothing_stored(store, "alpha-new", before)


def test_a_body_that_is_not_json_on_an_openai_route_is_400_in_words(client):
    error = refused(client.post("/v1/completions", content=b'{"model": "alpha", "prompt": "x"}'), 400, "body")
    assert "Content-Type: application/json" in error["message"], error
