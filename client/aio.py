"""Asyncio client for the polyserve HTTP API: the same methods as :class:`client.PolyserveClient`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from os import PathLike
from types import TracebackType
from typing import Any, Self

import httpx

from . import _core
from ._core import DEFAULT_URL, RequestSpec
from ._sse import ChunkParser
from .errors import error_from_response
from .types import Generation, Job, JobEvent, Model, SimilarTask, StreamChunk, Task, UsageRow

__all__ = ["AsyncPolyserveClient"]


class AsyncPolyserveClient:
    """Async twin of :class:`client.sync.PolyserveClient` (same retry policy and errors).

    ``transport`` is an ``httpx.AsyncBaseTransport`` (``httpx.MockTransport`` works for tests);
    ``sleep`` is an async callable (default ``asyncio.sleep``).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float | None = 60.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = _core.ClientSettings(base_url, api_key, timeout, max_retries, backoff)
        self._http = httpx.AsyncClient(transport=transport, **self.settings.http_kwargs())
        self._sleep = sleep
        self._clock = clock

    # ---- plumbing -------------------------------------------------------------------------------

    async def _send(self, spec: RequestSpec) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = await self._http.request(
                    spec.method, spec.path, json=spec.json, params=spec.params
                )
            except httpx.TransportError as exc:
                delay = self._delay(attempt, spec, exc=exc)
                if delay is None:
                    raise _core.connection_failed(exc, spec) from exc
            else:
                if response.is_success:
                    return response
                delay = self._delay(attempt, spec, response=response)
                if delay is None:
                    raise error_from_response(response)
            await self._sleep(delay)
            attempt += 1

    def _delay(self, attempt: int, spec: RequestSpec, **why: Any) -> float | None:
        s = self.settings
        return _core.retry_delay(attempt, s.max_retries, s.backoff, spec, **why)

    async def _json(self, spec: RequestSpec) -> Any:
        return _core.json_body(await self._send(spec))

    async def _stream(self, spec: RequestSpec) -> AsyncIterator[StreamChunk]:
        attempt = 0
        while True:
            try:
                async with self._http.stream(
                    spec.method, spec.path, json=spec.json, headers={"Accept": "text/event-stream"}
                ) as response:
                    if response.is_success:
                        parser = ChunkParser()
                        async for line in response.aiter_lines():
                            for chunk in parser.feed(line):
                                yield chunk
                            if parser.done:
                                return
                        for chunk in parser.close():
                            yield chunk
                        return
                    await response.aread()
                    delay = self._delay(attempt, spec, response=response)
                    if delay is None:
                        raise error_from_response(response)
            except httpx.TransportError as exc:
                delay = self._delay(attempt, spec, exc=exc)
                if delay is None:
                    raise _core.connection_failed(exc, spec) from exc
            await self._sleep(delay)
            attempt += 1

    # ---- generation -----------------------------------------------------------------------------

    async def generate(self, task: str, prompt: str, **params: Any) -> Generation:
        """``POST /v1/generate``: ``params`` are max_new_tokens, temperature, top_p, top_k, stop, seed."""
        spec = _core.generate_request(task, prompt, params, stream=False)
        return _core.parse_generation(await self._json(spec))

    def generate_stream(self, task: str, prompt: str, **params: Any) -> AsyncIterator[StreamChunk]:
        """``async for chunk in client.generate_stream(...)`` (input is checked at call time)."""
        return self._stream(_core.generate_request(task, prompt, params, stream=True))

    async def completions(self, model: str, prompt: str | list[str], **params: Any) -> dict[str, Any]:
        """OpenAI-compatible ``POST /v1/completions``."""
        spec = _core.openai_request("/v1/completions", "prompt", prompt, model, params)
        return _core.json_object(await self._json(spec))

    async def chat(self, model: str, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """OpenAI-compatible ``POST /v1/chat/completions``."""
        spec = _core.openai_request("/v1/chat/completions", "messages", messages, model, params)
        return _core.json_object(await self._json(spec))

    async def models(self) -> list[dict[str, Any]]:
        return _core.data_list(await self._json(RequestSpec("GET", "/v1/models")))

    async def list_models(self) -> list[Model]:
        """``GET /v1/models`` as typed :class:`Model` objects (unknown fields kept in ``raw``)."""
        return _core.parse_models(await self._json(RequestSpec("GET", "/v1/models")))

    async def get_model(self, model: str) -> Model:
        """``GET /v1/models/{model}``."""
        return Model.from_json(await self._json(RequestSpec("GET", _core.model_path(model))))

    async def usage(self, window: int | None = None) -> list[UsageRow]:
        """``GET /v1/usage``: requests and tokens by (tenant, task) over the last ``window`` seconds
        [server default]. Every tenant's rows for an admin key, the caller's own for a tenant key."""
        return _core.parse_usage(await self._json(_core.usage_request(window)))

    # ---- tasks and jobs -------------------------------------------------------------------------

    async def list_tasks(self, search: str | None = None) -> list[Task]:
        """Every task; with ``search``, those whose id or description holds each of its words."""
        params = {"search": search} if search else {}
        return _core.parse_tasks(await self._json(RequestSpec("GET", "/v1/tasks", params=params)))

    async def get_task(self, task: str) -> Task:
        return Task.from_json(await self._json(RequestSpec("GET", _core.task_path(task))))

    async def similar_tasks(self, task: str, k: int = 5) -> list[tuple[str, float]]:
        """The k tasks nearest to ``task`` by routing row, best first: (id, score)."""
        items = _core.data_list(await self._json(RequestSpec("GET", _core.similar_path(task), params={"k": k})))
        return [(str(item["id"]), float(item["score"])) for item in items]

    async def similar(self, task: str, k: int = 5) -> list[SimilarTask]:
        """Like :meth:`similar_tasks`, as typed :class:`SimilarTask` objects (fields kept in ``raw``)."""
        return _core.parse_similar(await self._json(RequestSpec("GET", _core.similar_path(task), params={"k": k})))

    async def delete_task(self, task: str) -> None:
        await self._send(RequestSpec("DELETE", _core.task_path(task)))

    async def register_task(
        self,
        task: str,
        examples: list[dict[str, Any]] | None = None,
        *,
        jsonl_path: str | PathLike[str] | None = None,
        method: str = "auto",
        steps: int | None = None,
        seed: int | None = None,
        serve_early: bool = False,
        shared: bool = False,
        description: str | None = None,
    ) -> Job:
        """``POST /v1/tasks`` (examples validated locally first); returns the queued job."""
        spec = _core.register_request(task, examples, jsonl_path, method, steps, seed, serve_early, shared,
                                      description)
        return _core.parse_job(await self._json(spec))

    async def import_lora(
        self, task: str, src: str | PathLike[str], *, project: bool = False, shared: bool = False
    ) -> dict[str, Any]:
        """``POST /v1/tasks`` with ``"method": "lora"`` (admin keys): register the PEFT LoRA
        directory ``src`` as a plain-LoRA task (``project``: as the routing row fitted to it).
        Returns ``{"task": <task object>, "import": <report>}``."""
        return _core.json_object(await self._json(_core.import_lora_request(task, src, project, shared)))

    async def get_job(self, job_id: str) -> Job:
        return _core.parse_job(await self._json(RequestSpec("GET", _core.job_path(job_id))))

    async def job_events(self, job_id: str) -> list[JobEvent]:
        spec = RequestSpec("GET", _core.job_path(job_id, "/events"))
        return _core.parse_events(await self._json(spec))

    async def cancel_job(self, job_id: str) -> Job:
        return _core.parse_job(await self._json(RequestSpec("POST", _core.job_path(job_id, "/cancel"))))

    async def wait_for_job(
        self,
        job_id: str,
        poll_interval: float = 0.5,
        timeout: float | None = None,
        on_progress: Callable[[Job], None] | None = None,
    ) -> Job:
        """Poll until the job is done (see :meth:`client.PolyserveClient.wait_for_job`)."""
        deadline = None if timeout is None else self._clock() + timeout
        while True:
            job = await self.get_job(job_id)
            if on_progress is not None:
                on_progress(job)
            delay = _core.poll_delay(job, deadline, self._clock(), poll_interval)
            if delay is None:
                return job
            await self._sleep(delay)

    # ---- health ---------------------------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        body = await self._json(RequestSpec("GET", "/health"))
        return body if isinstance(body, dict) else {"status": body}

    async def ready(self) -> bool:
        """``GET /ready`` once: False on 503 or when the server cannot be reached."""
        try:
            response = await self._http.get("/ready")
        except httpx.TransportError:
            return False
        ok = _core.ready_from_status(response.status_code)
        if ok is None:
            raise error_from_response(response)
        return ok

    # ---- lifecycle ------------------------------------------------------------------------------

    async def aclose(self) -> None:
        await self._http.aclose()

    close = aclose

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
