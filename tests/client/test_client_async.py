"""The asyncio client against the same scripted server (run with ``asyncio.run``, no plugin needed)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from client import (
    AsyncPolyserveClient,
    Conflict,
    ConnectionFailed,
    InvalidInput,
    NotFound,
    Overloaded,
    PolyserveClient,
    Unauthorized,
    Usage,
)
from tests.support.client_fakes import GEN, TASK, FakeServer, err, job, ok, sse


@pytest.fixture
def fake() -> FakeServer:
    return FakeServer()


def run(fake: FakeServer, body: Callable[[AsyncPolyserveClient], Awaitable[Any]], **kwargs: Any) -> Any:
    async def main() -> Any:
        async with fake.aclient(**kwargs) as c:
            return await body(c)

    return asyncio.run(main())


def test_generate_and_auth(fake: FakeServer) -> None:
    fake.on("POST", "/v1/generate", ok(GEN))
    out = run(fake, lambda c: c.generate("reverse", "abc", top_k=5))
    assert out.text == "cba" and out.usage == Usage(3, 2)
    assert fake.last.body == {"task": "reverse", "prompt": "abc", "top_k": 5, "stream": False}
    assert fake.last.headers["authorization"] == "Bearer sk-test"


def test_stream(fake: FakeServer) -> None:
    fake.on(
        "POST",
        "/v1/generate",
        err(503, "not_ready", "loading", retry_after="3"),
        sse(
            {"id": "g", "task": "t", "text": "he", "finish_reason": None},
            {
                "id": "g",
                "task": "t",
                "text": "llo",
                "finish_reason": "stop",
                "usage": {"prompt_tokens": 1, "completion_tokens": 2},
            },
        ),
    )

    async def body(c: AsyncPolyserveClient) -> list[Any]:
        return [ch async for ch in c.generate_stream("t", "p")]

    chunks = run(fake, body)
    assert "".join(ch.text for ch in chunks) == "hello" and chunks[-1].usage == Usage(1, 2)
    assert fake.sleeps == [3.0] and fake.last.body["stream"] is True


def test_stream_checks_input_at_call_time(fake: FakeServer) -> None:
    async def body(c: AsyncPolyserveClient) -> None:
        c.generate_stream("NOT VALID", "p")

    with pytest.raises(InvalidInput):
        run(fake, body)


def test_openai_and_models(fake: FakeServer) -> None:
    fake.on("POST", "/v1/completions", ok({"choices": [{"text": "x"}]}))
    fake.on("POST", "/v1/chat/completions", ok({"choices": []}))
    fake.on("GET", "/v1/models", ok({"data": [{"id": "base"}]}))

    async def body(c: AsyncPolyserveClient) -> tuple[Any, ...]:
        return (
            await c.completions("base", "a", max_tokens=2),
            await c.chat("base", [{"role": "user", "content": "hi"}]),
            await c.models(),
        )

    comp, chat, models = run(fake, body)
    assert comp["choices"][0]["text"] == "x" and chat == {"choices": []} and models == [{"id": "base"}]
    assert fake.requests[0].body == {"model": "base", "prompt": "a", "max_tokens": 2}


def test_tasks_and_jobs(fake: FakeServer) -> None:
    fake.on("GET", "/v1/tasks", ok({"data": [TASK]}))
    fake.on("GET", "/v1/tasks/reverse", ok(TASK))
    fake.on("DELETE", "/v1/tasks/reverse", httpx.Response(204))
    fake.on("POST", "/v1/tasks", ok(job(), status=202))
    fake.on("GET", "/v1/jobs/job_123/events", ok({"data": [{"message": "queued"}]}))
    fake.on("POST", "/v1/jobs/job_123/cancel", ok(job(status="cancelled")))
    fake.on(
        "GET",
        "/v1/jobs/job_123",
        ok(job(status="running", progress=0.5)),
        ok(job(status="succeeded", progress=1.0, metrics={"acc": 0.9})),
    )
    polled: list[str] = []

    async def body(c: AsyncPolyserveClient) -> tuple[Any, ...]:
        tasks = await c.list_tasks()
        task = await c.get_task("reverse")
        await c.delete_task("reverse")
        created = await c.register_task("reverse", [{"input": "a", "output": "b"}], steps=3)
        events = await c.job_events(created.id)
        cancelled = await c.cancel_job(created.id)
        final = await c.wait_for_job(
            created.id, poll_interval=0.25, on_progress=lambda j: polled.append(j.status)
        )
        return tasks, task, created, events, cancelled, final

    tasks, task, created, events, cancelled, final = run(fake, body)
    assert [t.id for t in tasks] == ["reverse"] and task.params == 4096
    assert created.status == "queued" and events[0].message == "queued" and cancelled.status == "cancelled"
    assert final.succeeded and final.metrics == {"acc": 0.9} and polled == ["running", "succeeded"]
    assert fake.sleeps == [0.25]
    methods = [(r.method, r.path) for r in fake.requests]
    assert ("DELETE", "/v1/tasks/reverse") in methods and ("POST", "/v1/tasks") in methods
    register = next(r for r in fake.requests if r.path == "/v1/tasks" and r.method == "POST")
    assert register.body == {
        "task": "reverse",
        "examples": [{"input": "a", "output": "b"}],
        "method": "auto",
        "steps": 3,
    }


def test_wait_timeout(fake: FakeServer) -> None:
    fake.on("GET", "/v1/jobs/j1", ok(job(id="j1", status="queued")))
    with pytest.raises(TimeoutError):
        run(fake, lambda c: c.wait_for_job("j1", poll_interval=1.0, timeout=1.5))
    assert fake.sleeps == [1.0, 0.5]


def test_retries_and_errors(fake: FakeServer) -> None:
    fake.on("POST", "/v1/generate", err(429, "overloaded", "full", retry_after="1.25"), ok(GEN))
    assert run(fake, lambda c: c.generate("reverse", "abc")).text == "cba"
    assert fake.sleeps == [1.25]

    fake.on("POST", "/v1/generate", err(429, "overloaded", "full"))
    with pytest.raises(Overloaded):
        run(fake, lambda c: c.generate("reverse", "abc"), max_retries=2, backoff=1.0)
    assert fake.sleeps == [1.25, 1.0, 2.0]

    fake.on("GET", "/v1/tasks/x", err(404, "not_found", "task 'x' not found"))
    with pytest.raises(NotFound, match="not found"):
        run(fake, lambda c: c.get_task("x"))

    fake.on("POST", "/v1/generate", err(409, "task_not_ready", "task 'x' is training (job job_77)"))
    with pytest.raises(Conflict) as info:
        run(fake, lambda c: c.generate("x", "p"))
    assert info.value.job_id == "job_77"


def test_connection_errors(fake: FakeServer) -> None:
    fake.on("GET", "/v1/tasks", httpx.ConnectError("refused"))
    with pytest.raises(ConnectionFailed):
        run(fake, lambda c: c.list_tasks(), max_retries=1)
    assert fake.sleeps == [0.5]


def test_ready(fake: FakeServer) -> None:
    fake.on("GET", "/ready", ok({}), err(503, "not_ready", "loading"))
    assert run(fake, lambda c: c.ready()) is True
    assert run(fake, lambda c: c.ready()) is False
    fake.on("GET", "/ready", err(401, "unauthorized", "?"))
    with pytest.raises(Unauthorized):
        run(fake, lambda c: c.ready())


class _SSEHandler(BaseHTTPRequestHandler):
    """Streams three events over a real socket, cutting lines across writes."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        events = [
            {"id": "g", "task": "t", "text": "hé", "finish_reason": None},
            {"id": "g", "task": "t", "text": "llo", "finish_reason": "stop"},
        ]
        payload = (
            "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events) + "data: [DONE]\n\n"
        )
        data = payload.encode()
        for i in range(0, len(data), 7):  # split inside lines and inside the UTF-8 "é"
            self.wfile.write(data[i : i + 7])
            self.wfile.flush()

    def log_message(self, *args: Any) -> None:
        pass


def test_stream_over_a_real_loopback_socket() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SSEHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with PolyserveClient(url, timeout=10) as c:
            assert "".join(ch.text for ch in c.generate_stream("t", "p")) == "héllo"

        async def main() -> str:
            async with AsyncPolyserveClient(url, timeout=10) as c:
                return "".join([ch.text async for ch in c.generate_stream("t", "p")])

        assert asyncio.run(main()) == "héllo"
    finally:
        server.shutdown()
        server.server_close()
    with PolyserveClient(url, timeout=2, max_retries=0) as c:
        assert c.ready() is False  # nothing listens any more


def test_models_usage_similar_and_import_lora_match_the_sync_client(fake: FakeServer, tmp_path) -> None:
    """The async client has the sync client's new calls, with the same requests and types."""
    model = {"id": "reverse", "object": "model", "created": 1, "owned_by": "polyserve", "parent": "base", "new": 1}
    row = {"tenant": "alice", "task": "reverse", "requests": 2, "prompt_tokens": 9, "completion_tokens": 4,
           "refused": 0, "new": 2}
    def script(server: FakeServer) -> FakeServer:
        server.on("GET", "/v1/models", ok({"data": [model]}))
        server.on("GET", "/v1/models/reverse", ok(model))
        server.on("GET", "/v1/usage", ok({"data": [row]}))
        server.on("GET", "/v1/tasks/reverse/similar", ok({"data": [{"id": "other", "score": 0.5}]}))
        return server.on("POST", "/v1/tasks", ok({"task": TASK, "import": {"kind": "lora"}}, status=201))

    script(fake)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x00weights")

    async def calls(c: AsyncPolyserveClient) -> Any:
        return (await c.list_models(), await c.get_model("reverse"), await c.usage(60), await c.similar("reverse", 2),
                await c.import_lora("mine", tmp_path, project=True))

    models, one, usage, similar, imported = run(fake, calls)
    sent = fake.last.body
    other = script(FakeServer())
    sync = other.client()
    assert models == sync.list_models() and one == sync.get_model("reverse") and one.raw["new"] == 1
    assert usage == sync.usage(60) and usage[0].requests == 2 and usage[0].raw["new"] == 2
    assert similar == sync.similar("reverse", 2) and similar[0].score == 0.5
    assert imported == sync.import_lora("mine", tmp_path, project=True) and imported["import"]["kind"] == "lora"
    assert sent == other.last.body == {"task": "mine", "method": "lora", "adapter": "AHdlaWdodHM=",
                                       "adapter_config": {"peft_type": "LORA"}, "project": True}
    assert [(r.method, r.path) for r in fake.requests] == [(r.method, r.path) for r in other.requests]


def test_new_register_flags_and_local_refusals(fake: FakeServer, tmp_path) -> None:
    fake.on("POST", "/v1/tasks", ok(job()))
    sync = fake.client()
    sync.register_task("t", [{"input": "a", "output": "b"}])
    assert "serve_early" not in fake.last.body and "shared" not in fake.last.body  # old servers accept it
    sync.register_task("t", [{"input": "a", "output": "b"}], method="routing", serve_early=True, shared=True)
    assert fake.last.body["serve_early"] is True and fake.last.body["shared"] is True
    sync.register_task("t", [{"input": "a", "output": "b"}], method="auto", serve_early=True)
    assert fake.last.body["serve_early"] is True and fake.last.body["method"] == "auto"
    for method in ("retrieve", "demos", "demos+routing"):
        with pytest.raises(InvalidInput, match="serve_early"):
            sync.register_task("t", [{"input": "a", "output": "b"}], method=method, serve_early=True)
    with pytest.raises(InvalidInput, match="window"):
        sync.usage(0)
    with pytest.raises(InvalidInput, match="no adapter_config.json"):
        sync.import_lora("t", tmp_path)
    (tmp_path / "adapter_config.json").write_text("[1]")
    (tmp_path / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(InvalidInput, match="no adapter_model.safetensors"):
        sync.import_lora("t", tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(InvalidInput, match="not a JSON object"):
        sync.import_lora("t", tmp_path)
