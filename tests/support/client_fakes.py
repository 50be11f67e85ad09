"""A scripted in-memory polyserve server for the client tests (``httpx.MockTransport``).

Routes answer queued responses in order (the last one repeats); every request is recorded, and
the clients get a fake ``sleep``/``clock`` pair so retry delays are measured, never slept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from client import AsyncPolyserveClient, PolyserveClient

Answer = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


def ok(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, json=body, headers=headers)


def err(status: int, type_: str = "error", message: str = "boom", **headers: str) -> httpx.Response:
    hdrs = {k.replace("_", "-"): v for k, v in headers.items()}
    return httpx.Response(status, json={"error": {"type": type_, "message": message}}, headers=hdrs)


def sse(*events: Any, done: bool = True) -> httpx.Response:
    """A ``text/event-stream`` answer: dicts become ``data: {json}`` events, strings go verbatim."""
    lines = [e if isinstance(e, str) else f"data: {json.dumps(e)}\n\n" for e in events]
    if done:
        lines.append("data: [DONE]\n\n")
    return httpx.Response(200, content="".join(lines).encode(), headers={"content-type": "text/event-stream"})


@dataclass
class Seen:
    """One recorded request."""

    method: str
    path: str
    body: Any
    headers: httpx.Headers
    params: dict[str, str] = field(default_factory=dict)


@dataclass
class FakeServer:
    routes: dict[tuple[str, str], list[Answer]] = field(default_factory=dict)
    requests: list[Seen] = field(default_factory=list)
    sleeps: list[float] = field(default_factory=list)
    now: float = 1000.0

    def on(self, method: str, path: str, *answers: Answer) -> FakeServer:
        self.routes[(method, path)] = list(answers)
        return self

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.raw_path.decode().split("?")[0]
        body = json.loads(request.content) if request.content else None
        self.requests.append(Seen(request.method, path, body, request.headers, dict(request.url.params)))
        queue = self.routes.get((request.method, path))
        if not queue:
            return err(404, "not_found", f"no route {request.method} {path}")
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, Exception):
            raise answer
        if callable(answer) and not isinstance(answer, httpx.Response):
            return answer(request)
        return answer

    # -- fake time: sleeping advances the clock, and is recorded --------------------------------

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)

    def clock(self) -> float:
        return self.now

    @property
    def last(self) -> Seen:
        return self.requests[-1]

    def client(self, **kwargs: Any) -> PolyserveClient:
        kwargs.setdefault("api_key", "sk-test")
        return PolyserveClient(
            transport=httpx.MockTransport(self.handle), sleep=self.sleep, clock=self.clock, **kwargs
        )

    def aclient(self, **kwargs: Any) -> AsyncPolyserveClient:
        kwargs.setdefault("api_key", "sk-test")
        return AsyncPolyserveClient(
            transport=httpx.MockTransport(self.handle), sleep=self.asleep, clock=self.clock, **kwargs
        )


JOB = {
    "id": "job_123",
    "task": "reverse",
    "status": "queued",
    "created_at": 1_700_000_000,
    "started_at": None,
    "finished_at": None,
    "progress": 0.0,
    "metrics": {},
    "error": None,
}


def job(**changes: Any) -> dict[str, Any]:
    return {**JOB, **changes}


TASK = {
    "id": "reverse",
    "status": "ready",
    "method": "routing",
    "version": 2,
    "created_at": "2024-05-01T12:00:00Z",
    "params": 4096,
    "skills": 8,
}

GEN = {
    "id": "gen-1",
    "task": "reverse",
    "text": "cba",
    "finish_reason": "stop",
    "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    "extra_field": [1, 2],
}
