"""Blocking client for the polyserve HTTP API (see docs/contract.md)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from os import PathLike
from types import TracebackType
from typing import Any, Self

import httpx

from . import _core
from ._core import DEFAULT_URL, RequestSpec
from ._sse import ChunkParser
from .errors import error_from_response
from .types import Generation, Job, JobEvent, Model, SimilarTask, StreamChunk, Task, UsageRow

__all__ = ["PolyserveClient"]


class PolyserveClient:
    """Talks to one polyserve server (or a load balancer in front of several).

    Answers 429 and 503 are retried up to ``max_retries`` times, waiting for the server's
    ``Retry-After`` when it sends one and ``backoff * 2**attempt`` seconds otherwise; connection
    failures are retried the same way (any transport error, for GETs).  Then the typed error from
    :mod:`client.errors` is raised.  ``sleep`` and ``clock`` are injectable for tests.

    >>> with PolyserveClient() as c:                                        # doctest: +SKIP
    ...     print(c.generate("sentiment", "great movie!").text)
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float | None = 60.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        transport: httpx.BaseTransport | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = _core.ClientSettings(base_url, api_key, timeout, max_retries, backoff)
        self._http = httpx.Client(transport=transport, **self.settings.http_kwargs())
        self._sleep = sleep
        self._clock = clock

    # ---- plumbing -------------------------------------------------------------------------------

    def _send(self, spec: RequestSpec) -> httpx.Response:
        """Send ``spec`` with retries; return the successful response or raise the typed error."""
        attempt = 0
        while True:
            try:
                response = self._http.request(spec.method, spec.path, json=spec.json, params=spec.params)
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
            self._sleep(delay)
            attempt += 1

    def _delay(self, attempt: int, spec: RequestSpec, **why: Any) -> float | None:
        s = self.settings
        return _core.retry_delay(attempt, s.max_retries, s.backoff, spec, **why)

    def _json(self, spec: RequestSpec) -> Any:
        return _core.json_body(self._send(spec))

    def _stream(self, spec: RequestSpec) -> Iterator[StreamChunk]:
        attempt = 0
        while True:
            try:
                with self._http.stream(
                    spec.method, spec.path, json=spec.json, headers={"Accept": "text/event-stream"}
                ) as response:
                    if response.is_success:
                        parser = ChunkParser()
                        for line in response.iter_lines():
                            yield from parser.feed(line)
                            if parser.done:
                                return
                        yield from parser.close()
                        return
                    response.read()
                    delay = self._delay(attempt, spec, response=response)
                    if delay is None:
                        raise error_from_response(response)
            except httpx.TransportError as exc:
                # Only a failed connect is retried for this POST: nothing was yielded before it.
                delay = self._delay(attempt, spec, exc=exc)
                if delay is None:
                    raise _core.connection_failed(exc, spec) from exc
            self._sleep(delay)
            attempt += 1

    # ---- generation -----------------------------------------------------------------------------

    def generate(self, task: str, prompt: str, **params: Any) -> Generation:
        """``POST /v1/generate``: ``params`` are max_new_tokens, temperature, top_p, top_k, stop, seed."""
        return _core.parse_generation(self._json(_core.generate_request(task, prompt, params, stream=False)))

    def generate_stream(self, task: str, prompt: str, **params: Any) -> Iterator[StreamChunk]:
        """Stream ``POST /v1/generate``: yields chunks of new text, the last with finish_reason/usage."""
        return self._stream(_core.generate_request(task, prompt, params, stream=True))

    def completions(self, model: str, prompt: str | list[str], **params: Any) -> dict[str, Any]:
        """OpenAI-compatible ``POST /v1/completions`` (``model`` = task id or ``base``)."""
        spec = _core.openai_request("/v1/completions", "prompt", prompt, model, params)
        return _core.json_object(self._json(spec))

    def chat(self, model: str, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """OpenAI-compatible ``POST /v1/chat/completions``."""
        spec = _core.openai_request("/v1/chat/completions", "messages", messages, model, params)
        return _core.json_object(self._json(spec))

    def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models``: the OpenAI model objects (one per ready task, plus ``base``)."""
        return _core.data_list(self._json(RequestSpec("GET", "/v1/models")))

    def list_models(self) -> list[Model]:
        """``GET /v1/models`` as typed :class:`Model` objects (unknown fields kept in ``raw``)."""
        return _core.parse_models(self._json(RequestSpec("GET", "/v1/models")))

    def get_model(self, model: str) -> Model:
        """``GET /v1/models/{model}``."""
        return Model.from_json(self._json(RequestSpec("GET", _core.model_path(model))))

    def usage(self, window: int | None = None) -> list[UsageRow]:
        """``GET /v1/usage``: requests and tokens by (tenant, task) over the last ``window`` seconds
        [server default]. Every tenant's rows for an admin key, the caller's own for a tenant key."""
        return _core.parse_usage(self._json(_core.usage_request(window)))

    # ---- tasks and jobs -------------------------------------------------------------------------

    def list_tasks(self, search: str | None = None) -> list[Task]:
        """Every task; with ``search``, those whose id or description holds each of its words."""
        params = {"search": search} if search else {}
        return _core.parse_tasks(self._json(RequestSpec("GET", "/v1/tasks", params=params)))

    def get_task(self, task: str) -> Task:
        return Task.from_json(self._json(RequestSpec("GET", _core.task_path(task))))

    def similar_tasks(self, task: str, k: int = 5) -> list[tuple[str, float]]:
        """The k tasks nearest to ``task`` by routing row, best first: (id, score)."""
        items = _core.data_list(self._json(RequestSpec("GET", _core.similar_path(task), params={"k": k})))
        return [(str(item["id"]), float(item["score"])) for item in items]

    def similar(self, task: str, k: int = 5) -> list[SimilarTask]:
        """Like :meth:`similar_tasks`, as typed :class:`SimilarTask` objects (fields kept in ``raw``)."""
        return _core.parse_similar(self._json(RequestSpec("GET", _core.similar_path(task), params={"k": k})))

    def delete_task(self, task: str) -> None:
        self._send(RequestSpec("DELETE", _core.task_path(task)))

    def register_task(
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
        """``POST /v1/tasks``: start a job that trains ``task`` from examples (a list or a JSONL file).

        Examples are validated locally first (non-empty; ``input`` and ``output`` are strings).
        ``method``: auto (the default), routing, retrieve (no training, ready in seconds), demos,
        demos+routing, mu or full. ``serve_early``: serve a first form while training goes on (auto:
        the demonstrations; routing, mu, full: the retrieved starting routing). ``shared`` (admin keys): the
        task is usable by every tenant. ``description``: what the task does, in words (shown in
        listings and searched by ``list_tasks(search=...)``).
        """
        spec = _core.register_request(task, examples, jsonl_path, method, steps, seed, serve_early, shared,
                                      description)
        return _core.parse_job(self._json(spec))

    def import_lora(
        self, task: str, src: str | PathLike[str], *, project: bool = False, shared: bool = False
    ) -> dict[str, Any]:
        """``POST /v1/tasks`` with ``"method": "lora"`` (admin keys): register the PEFT LoRA
        directory ``src`` as a plain-LoRA task (``project``: as the routing row fitted to it).
        Returns ``{"task": <task object>, "import": <report>}``."""
        return _core.json_object(self._json(_core.import_lora_request(task, src, project, shared)))

    def get_job(self, job_id: str) -> Job:
        return _core.parse_job(self._json(RequestSpec("GET", _core.job_path(job_id))))

    def job_events(self, job_id: str) -> list[JobEvent]:
        return _core.parse_events(self._json(RequestSpec("GET", _core.job_path(job_id, "/events"))))

    def cancel_job(self, job_id: str) -> Job:
        return _core.parse_job(self._json(RequestSpec("POST", _core.job_path(job_id, "/cancel"))))

    def wait_for_job(
        self,
        job_id: str,
        poll_interval: float = 0.5,
        timeout: float | None = None,
        on_progress: Callable[[Job], None] | None = None,
    ) -> Job:
        """Poll the job until it succeeds, fails or is cancelled; return its final state.

        ``on_progress`` is called with every polled state.  Raises ``TimeoutError`` after
        ``timeout`` seconds (the job goes on on the server).
        """
        deadline = None if timeout is None else self._clock() + timeout
        while True:
            job = self.get_job(job_id)
            if on_progress is not None:
                on_progress(job)
            delay = _core.poll_delay(job, deadline, self._clock(), poll_interval)
            if delay is None:
                return job
            self._sleep(delay)

    # ---- health ---------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """``GET /health`` (liveness)."""
        body = self._json(RequestSpec("GET", "/health"))
        return body if isinstance(body, dict) else {"status": body}

    def ready(self) -> bool:
        """``GET /ready``, asked once: True when the backbone is loaded and warm; False when the
        server answers 503 or cannot be reached."""
        try:
            response = self._http.get("/ready")
        except httpx.TransportError:
            return False
        ok = _core.ready_from_status(response.status_code)
        if ok is None:
            raise error_from_response(response)
        return ok

    # ---- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
