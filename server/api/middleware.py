"""Pure-ASGI middleware: a request-body byte cap, and per-endpoint request metrics."""

from __future__ import annotations

import json
import time
from typing import Any

from server.api.errors import error_payload
from server.infra.metrics import Metrics


async def _send_error(send: Any, scope: dict, status: int, type_: str, message: str) -> None:
    status, body = error_payload(scope.get("path", ""), status, type_, message)
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class BodyLimit:
    """413 when Content-Length or the streamed body exceeds max_bytes. The body is buffered (it is
    at most max_bytes) and replayed; later receive() calls (disconnects) pass through."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        too_large = (413, "too_large", f"request body exceeds {self.max_bytes} bytes")
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        return await _send_error(send, scope, *too_large)
                except ValueError:
                    return await _send_error(send, scope, 400, "invalid_request", "bad Content-Length")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # client went away before sending the body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _send_error(send, scope, *too_large)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class RequestMetrics:
    """requests_total{endpoint,status,tenant} and request_duration_seconds{endpoint}; endpoint = the
    route template (`/v1/tasks/{task}`, never a raw path or a task id), "other" where none matched."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "other"
            # the auth dependency names the tenant in the request's state ("" = none identified)
            tenant = scope.get("state", {}).get("tenant", "")
            self.metrics.requests.labels(endpoint=endpoint, status=str(status), tenant=tenant).inc()
            self.metrics.request_duration.labels(endpoint=endpoint).observe(time.perf_counter() - started)
