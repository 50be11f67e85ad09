"""The HTTP API over a real uvicorn server (tiny backbone, random inventory)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_fixtures import TASKS, build_store, live_server, settings_for, tiny_backbone

PROMPTS = ["hello world", "a", "the quick brown fox", "0123456789", "xyz", "polyserve!", "mixed", "b c d"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    store = build_store(root / "store")
    from adapters_store.store.records import TaskRecord

    store.put_record(TaskRecord(id="pending", method="routing", status="training", version=0,
                                created_at=time.time(), updated_at=time.time()))
    # float32: concurrent == sequential is asserted bit for bit; a bfloat16 GEMM's rounding depends on
    # how many rows share it (scripts/dtype_quality.py measures what that changes)
    settings = settings_for(root, max_prompt_tokens=256, max_new_tokens=512, max_body_bytes=64 * 1024,
                            dtype="float32")
    with live_server(settings, tiny_backbone()) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def body(i: int, **kw) -> dict:
    tasks = [*TASKS, "base"]
    return {"task": tasks[i % len(tasks)], "prompt": PROMPTS[i], "max_new_tokens": 16, **kw}


def sse_events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_concurrent_mixed_requests_equal_sequential(server, client):
    sequential = [client.post("/v1/generate", json=body(i)).json() for i in range(8)]

    async def together():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as ac:
            return await asyncio.gather(*(ac.post("/v1/generate", json=body(i)) for i in range(8)))

    concurrent = [r.json() for r in asyncio.run(together())]
    assert [r["text"] for r in concurrent] == [r["text"] for r in sequential]
    assert len({r["text"] for r in sequential}) >= 5
    assert all(r["finish_reason"] in ("length", "stop") for r in concurrent)


def test_streaming_yields_the_same_text(client):
    for i in (0, 3, 4):
        plain = client.post("/v1/generate", json=body(i)).json()
        r = client.post("/v1/generate", json=body(i, stream=True))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        final = events[-2]
        assert final["finish_reason"] == plain["finish_reason"] and final["usage"] == plain["usage"]
        assert all(e["finish_reason"] is None for e in events[:-2])
        assert "".join(e["text"] for e in events[:-1]) == plain["text"]


def test_openai_client_completions_and_chat(server):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    models = [m.id for m in oc.models.list().data]
    assert "base" in models and set(TASKS) <= set(models) and "pending" not in models

    c = oc.completions.create(model="alpha", prompt="Hello", max_tokens=8, temperature=0)
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens >= 1
    chunks = list(oc.completions.create(model="alpha", prompt="Hello", max_tokens=8, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text

    msgs = [{"role": "user", "content": "Say hi"}]
    chat = oc.chat.completions.create(model="beta", messages=msgs, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    stream = oc.chat.completions.create(model="beta", messages=msgs, max_tokens=8, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    parts, usage = [], None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for choice in ch.choices:
            parts.append(choice.delta.content or "")
    assert "".join(parts) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens

    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="no-such-task", prompt="x", max_tokens=2)


def test_completions_feed_the_prompt_verbatim(client):
    verbatim = client.post("/v1/completions", json={"model": "gamma", "prompt": "Input: abc\nOutput:",
                                                    "max_tokens": 12, "temperature": 0}).json()
    gen = client.post("/v1/generate", json={"task": "gamma", "prompt": "abc", "max_new_tokens": 12}).json()
    assert verbatim["choices"][0]["text"] == gen["text"]
    assert verbatim["usage"]["prompt_tokens"] == gen["usage"]["prompt_tokens"]


def test_disconnect_cancels_the_row(server):
    engine = server.runtime.engine
    eos, engine.eos_ids = engine.eos_ids, frozenset()  # the random model must not stop on its own
    run_step = engine._run_step

    def slow_step(items, owners) -> None:  # the tiny model decodes 500 tokens in well under a second: the
        time.sleep(0.01)  # row must still be running when the client goes away (>= 5 s for 500 steps)
        run_step(items, owners)

    engine._run_step = slow_step
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c, \
                c.stream("POST", "/v1/generate", json=body(0, max_new_tokens=500, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
            deadline = time.time() + 5
            while not engine.rows and time.time() < deadline:
                time.sleep(0.005)
            row = engine.rows[0]
        deadline = time.time() + 5
        while row.finish is None and time.time() < deadline:
            time.sleep(0.005)
        assert row.finish == "cancelled" and row.generated < 500
        while engine.running and time.time() < deadline:
            time.sleep(0.005)
        assert engine.running == 0
    finally:
        engine.eos_ids = eos
        del engine._run_step  # back to the class's method


def test_errors_have_the_contract_shape(client):
    def err(r, status, type_=None):
        assert r.status_code == status, r.text
        e = r.json()["error"]
        assert set(e) == {"type", "message", "param", "code"}
        if type_:
            assert e["type"] == type_
        return e["message"]

    err(client.post("/v1/generate", json={"task": "nope", "prompt": "x"}), 404, "not_found")
    err(client.get("/v1/tasks/nope"), 404)
    secret = "SECRET-PROMPT-" * 50
    msg = err(client.post("/v1/generate", json={"task": "alpha", "prompt": secret, "temperature": -1}), 422)
    assert "temperature" in msg and "SECRET" not in msg
    assert "max_new_tokens" in err(client.post("/v1/generate", json=body(0, max_new_tokens=10_000)), 422)
    assert "task" in err(client.post("/v1/generate", json={"task": "Bad/Id", "prompt": "x"}), 422)
    assert "prompt" in err(client.post("/v1/generate", json={"task": "alpha"}), 422)
    assert "stop" in err(client.post("/v1/generate", json=body(0, stop=[""])), 422)
    err(client.post("/v1/generate", content=b"{not json", headers={"content-type": "application/json"}), 422)
    err(client.post("/v1/generate", json={"task": "alpha", "prompt": "word " * 300}), 413, "too_large")
    err(client.post("/v1/generate", json={"task": "alpha", "prompt": "x" * 70_000}), 413, "too_large")
    err(client.post("/v1/generate", json={"task": "pending", "prompt": "x"}), 409, "task_not_ready")
    err(client.get("/v1/nothing-here"), 404)


def test_streamed_body_over_the_cap_is_413(server):
    def chunks():
        for _ in range(100):
            yield b"x" * 1024

    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "too_large"


def test_tasks_endpoints(client):
    data = client.get("/v1/tasks").json()["data"]
    assert {t["id"] for t in data} == {*TASKS, "pending"}
    alpha = client.get("/v1/tasks/alpha").json()
    assert alpha["status"] == "ready" and alpha["version"] == 1 and alpha["params"] > 0
    assert {"id", "status", "method", "version", "created_at", "params"} <= set(alpha)
    assert client.get("/v1/tasks/base").json()["status"] == "ready"
    assert client.get("/v1/tasks/pending").json()["status"] == "training"


def test_metrics_parse_and_move(client):
    def families():
        text = client.get("/metrics").text
        return {f.name: f for f in text_string_to_metric_families(text)}

    def hist_count(fams, name):
        return sum(s.value for s in fams[name].samples if s.name == f"{name}_count")

    before = families()
    client.post("/v1/generate", json=body(1, max_new_tokens=4))
    client.post("/v1/generate", json=body(2, max_new_tokens=4))
    after = families()
    for name in ("polyserve_time_to_first_token_seconds", "polyserve_inter_token_latency_seconds",
                 "polyserve_queue_wait_seconds", "polyserve_batch_size", "polyserve_request_duration_seconds"):
        assert hist_count(after, name) > hist_count(before, name), name
    expected = {"polyserve_requests", "polyserve_request_duration_seconds", "polyserve_time_to_first_token_seconds",
                "polyserve_inter_token_latency_seconds", "polyserve_queue_wait_seconds", "polyserve_batch_size",
                "polyserve_requests_running", "polyserve_requests_waiting", "polyserve_prompt_tokens",
                "polyserve_generation_tokens", "polyserve_adapter_cache_requests",
                "polyserve_adapter_materialize_seconds", "polyserve_tasks_registered", "polyserve_jobs",
                "polyserve_redis_errors"}
    assert expected <= set(after)
    for fam in after.values():
        for s in fam.samples:
            assert "task" not in s.labels
    gen = [s for s in after["polyserve_requests"].samples
           if s.labels.get("endpoint") == "/v1/generate" and s.labels.get("status") == "200"]
    assert gen and gen[0].value >= 2
    assert after["polyserve_tasks_registered"].samples[0].value == len(TASKS) + 1


def test_queue_full_is_429_with_retry_after(tmp_path):
    import threading

    build_store(tmp_path / "store")
    settings = settings_for(tmp_path, max_batch_rows=1, max_queue=1, warmup=False)
    with live_server(settings, tiny_backbone()) as srv:
        engine = srv.runtime.engine
        gate = threading.Event()
        engine.add_background_task(lambda: gate.wait(20) and False)  # holds the engine thread

        async def scenario():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as ac:
                queued = asyncio.create_task(ac.post("/v1/generate", json=body(1, max_new_tokens=2)))
                while engine.waiting == 0:
                    await asyncio.sleep(0.005)
                rejected = await ac.post("/v1/generate", json=body(2))
                gate.set()
                return rejected, await queued

        rejected, queued = asyncio.run(scenario())
    assert rejected.status_code == 429 and int(rejected.headers["retry-after"]) >= 1
    assert rejected.json()["error"]["type"] == "overloaded"
    assert queued.status_code == 200


def test_api_keys(tmp_path):
    settings = settings_for(tmp_path, api_keys=["k1", "k2"], warmup=False)
    with live_server(settings, tiny_backbone()) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = c.post("/v1/generate", json={"task": "base", "prompt": "x", "max_new_tokens": 2},
                    headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200
        # empty store: only base is servable
        assert [m["id"] for m in c.get("/v1/models", headers={"Authorization": "Bearer k1"}).json()["data"]] == ["base"]


def test_generate_returns_the_answer_without_the_format_separator(client):
    """/v1/generate = /v1/completions on the formatted prompt, minus the one separator space
    that training puts between "Output:" and the answer (streamed or not)."""
    from adapters_store.backbone.prompt import format_prompt, strip_separator

    for i in range(4):
        b = body(i)
        raw = client.post("/v1/completions", json={"model": b["task"], "prompt": format_prompt(b["prompt"]),
                                                   "max_tokens": 16, "temperature": 0}).json()
        plain = client.post("/v1/generate", json=b).json()
        assert plain["text"] == strip_separator(raw["choices"][0]["text"])
        events = sse_events(client.post("/v1/generate", json=body(i, stream=True)).text)
        assert "".join(e["text"] for e in events[:-1]) == plain["text"]
