"""The client's error mapping and retry policy (sync), with time faked by the scripted server."""

from __future__ import annotations

import httpx
import pytest

from client import (
    BadRequest,
    Conflict,
    ConnectionFailed,
    DeadlineExceeded,
    Forbidden,
    InvalidInput,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    PolyserveError,
    ServerError,
    Unauthorized,
    Unavailable,
    ValidationError,
    error_from_response,
)
from client.errors import parse_retry_after
from tests.support.client_fakes import GEN, FakeServer, err, ok


@pytest.fixture
def fake() -> FakeServer:
    return FakeServer()


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, BadRequest),
        (401, Unauthorized),
        (403, Forbidden),
        (404, NotFound),
        (409, Conflict),
        (413, PayloadTooLarge),
        (422, ValidationError),
        (429, Overloaded),
        (503, Unavailable),
        (500, ServerError),
        (504, DeadlineExceeded),
        (502, ServerError),
        (418, PolyserveError),
    ],
)
def test_error_mapping(fake: FakeServer, status: int, cls: type[PolyserveError]) -> None:
    fake.on("GET", "/v1/tasks/x", err(status, "some_type", "field 'prompt' is bad"))
    with fake.client(max_retries=0) as c, pytest.raises(cls) as info:
        c.get_task("x")
    assert type(info.value) is cls
    assert (info.value.status, info.value.type, info.value.message) == (
        status,
        "some_type",
        "field 'prompt' is bad",
    )
    assert "some_type" in str(info.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"<html><body>502 Bad Gateway</body></html>", "<html><body>502 Bad Gateway</body></html>"),
        (b"", "Bad Gateway"),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b"[1, 2]", "Bad Gateway"),
    ],
)
def test_error_from_non_contract_bodies(body: bytes, message: str) -> None:
    err_ = error_from_response(httpx.Response(502, content=body))
    assert isinstance(err_, ServerError) and err_.message == message and err_.type == "http_502"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"error": {"type": "conflict", "message": "task is training", "job_id": "job_9"}}, "job_9"),
        ({"error": {"type": "conflict", "message": "task 'x' is training (job job_abc12)"}}, "job_abc12"),
        ({"error": {"type": "conflict", "message": "not ready, job id: 7f3e9a"}}, "7f3e9a"),
        ({"error": {"type": "conflict", "message": "task already exists"}}, None),
    ],
)
def test_conflict_carries_job_id(fake: FakeServer, body, expected) -> None:
    fake.on("POST", "/v1/generate", httpx.Response(409, json=body))
    with fake.client() as c, pytest.raises(Conflict) as info:
        c.generate("x", "p")
    assert info.value.job_id == expected


def test_retry_honours_retry_after(fake: FakeServer) -> None:
    fake.on(
        "POST",
        "/v1/generate",
        err(429, "overloaded", "queue full", retry_after="2.5"),
        err(503, "draining", "busy", retry_after="0"),
        ok(GEN),
    )
    with fake.client(backoff=10.0) as c:
        assert c.generate("reverse", "abc").text == "cba"
    assert fake.sleeps == [2.5, 0.0]
    assert len(fake.requests) == 3


def test_retry_backoff_then_gives_up(fake: FakeServer) -> None:
    fake.on("POST", "/v1/generate", err(429, "overloaded", "queue full"))
    with fake.client(max_retries=3, backoff=0.5) as c, pytest.raises(Overloaded) as info:
        c.generate("reverse", "abc")
    assert fake.sleeps == [0.5, 1.0, 2.0]
    assert len(fake.requests) == 4 and info.value.retry_after is None


def test_gives_up_with_retry_after_on_error(fake: FakeServer) -> None:
    fake.on("GET", "/v1/tasks", err(503, "not_ready", "loading", retry_after="4"))
    with fake.client(max_retries=1) as c, pytest.raises(Unavailable) as info:
        c.list_tasks()
    assert info.value.retry_after == 4.0 and fake.sleeps == [4.0]


def test_other_errors_are_not_retried(fake: FakeServer) -> None:
    fake.on("POST", "/v1/generate", err(500, "internal", "bug"))
    with fake.client() as c, pytest.raises(ServerError):
        c.generate("reverse", "abc")
    assert len(fake.requests) == 1 and fake.sleeps == []


def test_connection_errors_retried_for_gets_only(fake: FakeServer) -> None:
    fake.on("GET", "/v1/tasks", httpx.ReadError("reset"), ok({"data": []}))
    fake.on("POST", "/v1/generate", httpx.ReadError("reset"), ok(GEN))
    with fake.client() as c:
        assert c.list_tasks() == []
        assert fake.sleeps == [0.5]
        with pytest.raises(ConnectionFailed, match="reset"):
            c.generate("reverse", "abc")  # the request may have run: not retried
    assert fake.sleeps == [0.5]


def test_connect_error_retried_for_post_then_fails(fake: FakeServer) -> None:
    fake.on("POST", "/v1/generate", httpx.ConnectError("refused"))
    with fake.client(max_retries=2) as c, pytest.raises(ConnectionFailed) as info:
        c.generate("reverse", "abc")
    assert fake.sleeps == [0.5, 1.0] and info.value.type == "connection_error"


def test_retry_after_http_date() -> None:
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert parse_retry_after("soon") is None and parse_retry_after("-3") == 0.0


def test_timeout_setting_reaches_httpx(fake: FakeServer) -> None:
    with fake.client(timeout=3.0) as c:
        assert c._http.timeout.read == 3.0
    with pytest.raises(InvalidInput):
        fake.client(base_url="localhost:8000")


@pytest.mark.parametrize(
    "error",
    [
        {"type": "validation_error", "message": "n: too many", "param": "n", "code": None},
        {"message": "n: too many", "type": "invalid_request_error", "param": "n", "code": "bad_n"},
    ],
)
def test_error_param_and_code(error: dict) -> None:
    """Both of the server's shapes (polyserve's routes, the OpenAI routes) keep param and code."""
    exc = error_from_response(httpx.Response(400, json={"error": error}))
    assert isinstance(exc, BadRequest)
    assert (exc.param, exc.code, exc.message) == ("n", error["code"], "n: too many")


def test_error_without_param_or_code() -> None:
    exc = error_from_response(httpx.Response(404, json={"error": {"type": "not_found", "message": "m"}}))
    assert exc.param is None and exc.code is None
