"""Start-up off the event loop (server/wiring/startup.py), through both apps' /health and /ready: loading,
ready, a failed start-up that keeps only the error's kind, and shutdown that closes what was built or
cancels what is still loading."""

from __future__ import annotations

import logging
import threading

from fastapi.testclient import TestClient

from server.api.app import create_app
from server.fleet.worker import app as worker_app
from server.wiring.settings import Settings


class Built:
    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_a_failed_server_start_up_says_its_kind_and_keeps_the_message_out(monkeypatch, tmp_path, caplog):
    from server.wiring import runtime

    def boom(*args, **kwargs):
        raise FileNotFoundError("/secret/path/of/the/store")

    monkeypatch.setattr(runtime.Runtime, "build", staticmethod(boom))
    app = create_app(Settings(store=str(tmp_path)))
    with caplog.at_level(logging.ERROR), TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok"}
        for _ in range(200):
            ready = client.get("/ready")
            if "failed" in ready.text:
                break
        assert ready.status_code == 503 and "Retry-After" not in ready.headers
        body = ready.json()["error"]
        assert body["type"] == "unavailable" and "FileNotFoundError" in body["message"]
        assert "/secret" not in ready.text
    assert "/secret/path/of/the/store" in caplog.text  # the traceback is in the log


def test_the_server_closes_what_it_built_on_shutdown(monkeypatch, tmp_path):
    from server.wiring import runtime

    built = Built()
    gate = threading.Event()

    def build(*args, **kwargs):
        gate.wait(10)
        return built

    monkeypatch.setattr(runtime.Runtime, "build", staticmethod(build))
    app = create_app(Settings(store=str(tmp_path)))
    with TestClient(app) as client:
        loading = client.get("/ready")
        assert loading.status_code == 503 and loading.headers["Retry-After"] == "5"
        gate.set()
        for _ in range(200):
            if app.state.runtime is built:
                break
            threading.Event().wait(0.01)
        assert app.state.runtime is built and not built.closed.is_set()
    assert built.closed.is_set() and app.state.runtime is None


def test_a_failed_worker_start_up_says_its_kind_and_keeps_the_dsn_out(monkeypatch):
    def boom(settings, metrics):
        raise ConnectionError("postgresql://admin:hunter2@db/polyserve refused")

    monkeypatch.setattr(worker_app, "build_worker", boom)
    app = worker_app.create_worker_app(Settings())
    with TestClient(app) as client:
        for _ in range(200):
            ready = client.get("/ready")
            if "failed" in ready.text:
                break
        assert ready.status_code == 503 and "ConnectionError" in ready.json()["error"]["message"]
        assert "hunter2" not in ready.text


def test_a_worker_still_loading_at_shutdown_is_cancelled_not_started(monkeypatch):
    started = threading.Event()
    release = threading.Event()

    class Worker:
        def start(self) -> None:
            started.set()

        def stop(self) -> None:
            raise AssertionError("nothing was started, nothing to stop")

    def slow(settings, metrics):
        release.wait(10)
        return Worker()

    monkeypatch.setattr(worker_app, "build_worker", slow)
    app = worker_app.create_worker_app(Settings())
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 503
    release.set()
    assert app.state.worker is None and not started.wait(0.5)


def test_shutdown_while_loading_cancels_the_load_even_if_the_loop_runs_on():
    import asyncio

    from fastapi import FastAPI

    from server.wiring.startup import built_in_background, init_state

    app = FastAPI(title="t")
    init_state(app, "thing")

    async def main() -> None:
        release = asyncio.Event()

        async def build() -> Built:
            await release.wait()
            return Built()

        async with built_in_background(app, "thing", build, Built.close, logging.getLogger("t")):
            await asyncio.sleep(0)
        release.set()
        await asyncio.sleep(0.05)  # a load that was not cancelled would land now

    asyncio.run(main())
    assert app.state.thing is None and app.state.load_error is None
