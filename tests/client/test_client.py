"""The sync client against a scripted server: requests, parsing, streaming, errors, retries."""

from __future__ import annotations

import json

import httpx
import pytest

from client import (
    Generation,
    InvalidInput,
    Job,
    NotFound,
    PolyserveError,
    StreamChunk,
    Task,
    Usage,
)
from tests.support.client_fakes import GEN, TASK, FakeServer, err, job, ok, sse


@pytest.fixture
def fake() -> FakeServer:
    return FakeServer()


def test_generate_request_and_parsing(fake: FakeServer) -> None:
    fake.on("POST", "/v1/generate", ok(GEN))
    with fake.client() as c:
        out = c.generate("reverse", "abc", max_new_tokens=5, temperature=0.0, stop=["\n"], seed=None)
    assert out == Generation("gen-1", "reverse", "cba", "stop", Usage(3, 2))
    assert out.usage.total_tokens == 5 and out.raw["extra_field"] == [1, 2]
    seen = fake.last
    assert (seen.method, seen.path) == ("POST", "/v1/generate")
    assert seen.body == {
        "task": "reverse",
        "prompt": "abc",
        "max_new_tokens": 5,
        "temperature": 0.0,
        "stop": ["\n"],
        "stream": False,
    }
    assert seen.headers["authorization"] == "Bearer sk-test"


def test_no_auth_header_without_key(fake: FakeServer) -> None:
    fake.on("GET", "/health", ok({"status": "ok"}))
    with fake.client(api_key=None) as c:
        assert c.health() == {"status": "ok"}
    assert "authorization" not in fake.last.headers


def test_generate_rejects_bad_input_before_sending(fake: FakeServer) -> None:
    with fake.client() as c:
        with pytest.raises(InvalidInput, match="task id"):
            c.generate("Bad Task!", "x")
        with pytest.raises(InvalidInput, match="task id"):
            c.generate("ok\n", "x")
        with pytest.raises(InvalidInput, match="generate_stream"):
            c.generate("ok", "x", stream=True)
    assert fake.requests == []


def test_generate_stream_parses_sse(fake: FakeServer) -> None:
    fake.on(
        "POST",
        "/v1/generate",
        sse(
            ": keep-alive comment\n\n",
            {"id": "g", "task": "reverse", "text": "cb", "finish_reason": None},
            'event: message\r\ndata: {"id": "g", "task": "reverse",\r\ndata: "text": "a"}\r\n\r\n',
            {
                "id": "g",
                "task": "reverse",
                "text": "",
                "finish_reason": "length",
                "usage": {"prompt_tokens": 3, "completion_tokens": 3},
            },
            "data: [DONE]\n\n",
            {"id": "g", "task": "reverse", "text": "AFTER DONE", "finish_reason": None},
            done=False,
        ),
    )
    with fake.client() as c:
        chunks = list(c.generate_stream("reverse", "abc", max_new_tokens=3))
    assert [ch.text for ch in chunks] == ["cb", "a", ""]
    assert chunks[-1].is_final and chunks[-1].usage == Usage(3, 3) and chunks[0].usage is None
    assert all(isinstance(ch, StreamChunk) for ch in chunks)
    assert fake.last.body["stream"] is True and fake.last.body["max_new_tokens"] == 3
    assert fake.last.headers["accept"] == "text/event-stream"


def test_stream_without_final_event_raises(fake: FakeServer) -> None:
    fake.on(
        "POST", "/v1/generate", sse({"id": "g", "task": "t", "text": "x", "finish_reason": None}, done=False)
    )
    with fake.client() as c, pytest.raises(PolyserveError, match="ended before"):
        list(c.generate_stream("t", "p"))


def test_stream_error_event_is_raised_typed(fake: FakeServer) -> None:
    fake.on("POST", "/v1/generate", sse({"error": {"type": "cancelled", "message": "draining"}}))
    with fake.client() as c, pytest.raises(PolyserveError) as info:
        list(c.generate_stream("t", "p"))
    assert info.value.type == "cancelled" and info.value.status is None


def test_stream_retries_429_before_first_byte(fake: FakeServer) -> None:
    final = {"id": "g", "task": "t", "text": "hi", "finish_reason": "stop"}
    fake.on("POST", "/v1/generate", err(429, "overloaded", "queue full", retry_after="1.5"), sse(final))
    with fake.client() as c:
        assert [ch.text for ch in c.generate_stream("t", "p")] == ["hi"]
    assert fake.sleeps == [1.5]


def test_openai_compatible_endpoints(fake: FakeServer) -> None:
    completion = {"object": "text_completion", "choices": [{"text": "x", "index": 0}]}
    chat = {"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": "y"}}]}
    fake.on("POST", "/v1/completions", ok(completion))
    fake.on("POST", "/v1/chat/completions", ok(chat))
    fake.on("GET", "/v1/models", ok({"object": "list", "data": [{"id": "base"}, {"id": "reverse"}]}))
    with fake.client() as c:
        assert c.completions("base", "Once", max_tokens=4) == completion
        assert fake.last.body == {"model": "base", "prompt": "Once", "max_tokens": 4}
        msgs = [{"role": "user", "content": "hi"}]
        assert c.chat("reverse", msgs, temperature=0) == chat
        assert fake.last.path == "/v1/chat/completions"
        assert fake.last.body == {"model": "reverse", "messages": msgs, "temperature": 0}
        assert [m["id"] for m in c.models()] == ["base", "reverse"]
        with pytest.raises(InvalidInput, match="openai"):
            c.chat("reverse", msgs, stream=True)


def test_tasks_endpoints(fake: FakeServer) -> None:
    fake.on("GET", "/v1/tasks", ok({"data": [TASK, {**TASK, "id": "b", "status": "training"}]}))
    fake.on("GET", "/v1/tasks/reverse", ok(TASK))
    fake.on("DELETE", "/v1/tasks/reverse", httpx.Response(204))
    with fake.client() as c:
        tasks = c.list_tasks()
        assert [(t.id, t.status, t.ready) for t in tasks] == [
            ("reverse", "ready", True),
            ("b", "training", False),
        ]
        task = c.get_task("reverse")
        assert fake.last.method == "GET"
        assert task == Task("reverse", "ready", "routing", 2, 1714564800.0, 4096)
        assert task.raw["skills"] == 8
        assert c.delete_task("reverse") is None
        assert (fake.last.method, fake.last.path) == ("DELETE", "/v1/tasks/reverse")
        with pytest.raises(InvalidInput):
            c.get_task("../etc")


def test_register_task_with_examples(fake: FakeServer) -> None:
    fake.on("POST", "/v1/tasks", ok(job(), status=202))
    examples = [{"input": "abc", "output": "cba", "task": "reverse"}, {"input": "xy", "output": "yx"}]
    with fake.client() as c:
        created = c.register_task("reverse", examples, method="mu", steps=50, seed=7)
    assert isinstance(created, Job) and created.id == "job_123" and not created.done
    assert created.created_at == 1_700_000_000.0
    assert fake.last.body == {
        "task": "reverse",
        "method": "mu",
        "steps": 50,
        "seed": 7,
        "examples": [{"input": "abc", "output": "cba"}, {"input": "xy", "output": "yx"}],
    }


def test_register_task_from_jsonl(fake: FakeServer, tmp_path) -> None:
    path = tmp_path / "ex.jsonl"
    path.write_text('{"task": "reverse", "input": "ab", "output": "ba"}\n\n{"input": "c", "output": "c"}\n')
    fake.on("POST", "/v1/tasks", ok(job(), status=202))
    with fake.client() as c:
        c.register_task("reverse", jsonl_path=path)
    assert fake.last.body == {
        "task": "reverse",
        "method": "auto",
        "examples": [{"input": "ab", "output": "ba"}, {"input": "c", "output": "c"}],
    }


@pytest.mark.parametrize(
    ("examples", "match"),
    [
        ([], "must not be empty"),
        ([{"input": "a"}], r"examples\[0\]\.output must be a string"),
        ([{"input": "a", "output": "b"}, {"input": 3, "output": "b"}], r"examples\[1\]\.input"),
        ([{"input": "a", "output": "b", "task": "other"}], r"examples\[0\]\.task"),
        (["just text"], r"examples\[0\] must be an object"),
    ],
)
def test_register_task_validates_locally(fake: FakeServer, examples, match) -> None:
    with fake.client() as c, pytest.raises(InvalidInput, match=match):
        c.register_task("reverse", examples)
    assert fake.requests == []


def test_register_task_argument_errors(fake: FakeServer, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "output": "b"}\n{not json}\n')
    with fake.client() as c:
        with pytest.raises(InvalidInput, match="exactly one"):
            c.register_task("reverse")
        with pytest.raises(InvalidInput, match="method"):
            c.register_task("reverse", [{"input": "a", "output": "b"}], method="lora")
        with pytest.raises(InvalidInput, match="bad.jsonl:2"):
            c.register_task("reverse", jsonl_path=bad)
    assert fake.requests == []


def test_jobs_endpoints(fake: FakeServer) -> None:
    fake.on("GET", "/v1/jobs/job_123", ok(job(status="running", progress=0.5, metrics={"loss": 1.2})))
    fake.on(
        "GET",
        "/v1/jobs/job_123/events",
        ok(
            {
                "object": "list",
                "data": [
                    {"created_at": 1, "level": "info", "message": "started", "extra": 1},
                    {"message": "step 10"},
                ],
            }
        ),
    )
    fake.on("POST", "/v1/jobs/job_123/cancel", ok(job(status="cancelled")))
    with fake.client() as c:
        running = c.get_job("job_123")
        assert (running.status, running.progress, running.metrics) == ("running", 0.5, {"loss": 1.2})
        events = c.job_events("job_123")
        assert [(e.message, e.created_at, e.level) for e in events] == [
            ("started", 1.0, "info"),
            ("step 10", None, "info"),
        ]
        cancelled = c.cancel_job("job_123")
        assert cancelled.done and not cancelled.succeeded
        assert (fake.last.method, fake.last.path, fake.last.body) == ("POST", "/v1/jobs/job_123/cancel", None)


def test_job_ids_are_escaped_in_paths(fake: FakeServer) -> None:
    with fake.client() as c, pytest.raises(NotFound):
        c.get_job("a/../b")
    assert fake.last.path == "/v1/jobs/a%2F..%2Fb"


def test_failed_job_error_is_parsed() -> None:
    failed = Job.from_json(job(status="failed", error={"type": "oom", "message": "out of memory"}))
    assert failed.done and failed.error is not None and failed.error.type == "oom"


def test_wait_for_job_polls_until_done(fake: FakeServer) -> None:
    fake.on(
        "GET",
        "/v1/jobs/job_123",
        ok(job(status="queued")),
        ok(job(status="running", progress=0.4)),
        ok(job(status="succeeded", progress=1.0, metrics={"eval_loss": 0.1})),
    )
    seen: list[tuple[str, float]] = []
    with fake.client() as c:
        final = c.wait_for_job(
            "job_123", poll_interval=2.0, on_progress=lambda j: seen.append((j.status, j.progress))
        )
    assert final.succeeded and final.metrics == {"eval_loss": 0.1}
    assert seen == [("queued", 0.0), ("running", 0.4), ("succeeded", 1.0)]
    assert fake.sleeps == [2.0, 2.0]


def test_wait_for_job_times_out(fake: FakeServer) -> None:
    fake.on("GET", "/v1/jobs/job_123", ok(job(status="running")))
    with fake.client() as c, pytest.raises(TimeoutError, match="job_123"):
        c.wait_for_job("job_123", poll_interval=1.0, timeout=2.5)
    assert fake.sleeps == [1.0, 1.0, 0.5]


def test_health_and_ready(fake: FakeServer) -> None:
    fake.on("GET", "/ready", ok({"status": "ready"}), err(503, "not_ready", "warming up"))
    with fake.client() as c:
        assert c.ready() is True
        assert c.ready() is False
    assert fake.sleeps == []
    fake.on("GET", "/ready", httpx.ConnectError("refused"))
    with fake.client() as c:
        assert c.ready() is False


def test_types_tolerate_extra_and_missing_fields() -> None:
    t = Task.from_json({"id": "x", "status": "ready", "new": {"a": 1}})
    assert (t.method, t.created_at, t.raw["new"]) == (None, None, {"a": 1})
    ch = StreamChunk.from_json({"text": "a"})
    assert ch.finish_reason is None and not ch.is_final
    assert json.loads(json.dumps(Generation.from_json(GEN).raw)) == GEN
