"""Reliability on the HTTP side, over a live server: the server-side deadline, failures after a
stream started, and a non-streaming client that disconnects."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest

from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("rel")
    build_store(root / "store")
    settings = settings_for(root, max_new_tokens=500, request_timeout_seconds=1.0)
    with live_server(settings, tiny_backbone()) as srv:
        yield srv


@contextlib.contextmanager
def slow_engine(server, delay: float = 0.01, fail_after: int | None = None):
    """Every decode step takes `delay` s and the random model never stops on its own; with
    fail_after, the decode step raises after that many steps (an engine bug)."""
    engine = server.runtime.engine
    eos, engine.eos_ids = engine.eos_ids, frozenset()
    run_step, steps = engine._run_step, [0]

    def patched(items, owners) -> None:
        steps[0] += 1
        if fail_after is not None and steps[0] > fail_after:
            raise RuntimeError("injected engine failure")
        time.sleep(delay)
        run_step(items, owners)

    engine._run_step = patched
    try:
        yield engine
    finally:
        engine.eos_ids = eos
        del engine._run_step


def wait_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while (engine.running or engine.waiting) and time.time() < deadline:
        time.sleep(0.01)
    assert engine.running == 0 and engine.waiting == 0


def events(text: str) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in text.splitlines() if line.startswith("data: ")]


def finishes(got: list) -> list:
    """Every finish_reason in polyserve's or OpenAI's chunks."""
    return [e.get("finish_reason") for e in got] + [ch.get("finish_reason") for e in got for ch in e.get("choices", [])]


LONG = {"task": "alpha", "prompt": "x", "max_new_tokens": 500}


def test_deadline_answers_504_and_cancels_the_row(server):
    with slow_engine(server) as engine, httpx.Client(base_url=server.url, timeout=30) as c:
        started = time.time()
        r = c.post("/v1/generate", json=LONG)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
        assert time.time() - started < 5
        oai = c.post("/v1/completions", json={"model": "alpha", "prompt": "x", "max_tokens": 500})
        assert oai.status_code == 504 and oai.json()["error"]["type"] == "server_error"
        wait_idle(engine)


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/generate", {**LONG, "stream": True}),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "x"}], "max_tokens": 500,
                              "stream": True}),
])
def test_deadline_ends_a_stream_with_an_error_event(server, route, body):
    with slow_engine(server) as engine, httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post(route, json=body)
        got = events(r.text)
        assert r.status_code == 200 and got[-1] == "[DONE]"
        error = got[-2]["error"]
        assert error["type"] == "timeout" if route == "/v1/generate" else error["code"] == "timeout"
        assert not any(finishes(got[:-2]))
        wait_idle(engine)


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/generate", {**LONG, "max_new_tokens": 50, "stream": True}),
    ("/v1/completions", {"model": "alpha", "prompt": "x", "max_tokens": 50, "stream": True}),
])
def test_engine_failure_mid_stream_is_an_error_event_not_stop(server, route, body):
    with slow_engine(server, delay=0.0, fail_after=3) as engine, httpx.Client(base_url=server.url, timeout=30) as c:
        got = events(c.post(route, json=body).text)
        assert got[-1] == "[DONE]" and got[-2]["error"]["message"]
        assert not any(finishes(got[:-2])), "a failed stream must not end with a finish_reason"
        r = c.post("/v1/generate", json={**LONG, "max_new_tokens": 50})
        assert r.status_code == 500 and "injected" not in r.text  # a bug; its details stay in the log
        wait_idle(engine)
    # the engine keeps serving afterwards
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/generate", json={"task": "alpha", "prompt": "x", "max_new_tokens": 2}).status_code == 200


def test_non_streaming_disconnect_cancels_the_row(server):
    """A client that gives up on a non-streamed request frees its row (a path once untested)."""
    with slow_engine(server) as engine:
        host, port = server.url.removeprefix("http://").split(":")
        payload = json.dumps({**LONG, "max_new_tokens": 90}).encode()  # ~0.9 s: under the deadline
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            deadline = time.time() + 5
            while not engine.rows and time.time() < deadline:
                time.sleep(0.005)
            row = engine.rows[0]
        deadline = time.time() + 5
        while row.finish is None and time.time() < deadline:
            time.sleep(0.005)
        assert row.finish == "cancelled" and row.generated < 90
        wait_idle(engine)
