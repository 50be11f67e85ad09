"""I/O-free logic shared by the sync and async clients.

Request building, response parsing and the retry and polling policies live here (the SSE decoder
in :mod:`client._sse`), so that :mod:`client.sync` and :mod:`client.aio` only differ in how they
send and wait.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from .errors import ConnectionFailed, InvalidInput, PolyserveError, parse_retry_after
from .types import Generation, Job, JobEvent, Model, SimilarTask, Task, UsageRow

DEFAULT_URL = "http://127.0.0.1:8000"
USER_AGENT = "polyserve-client/0.1"
RETRY_STATUSES = frozenset({429, 503})
METHODS = ("auto", "routing", "retrieve", "demos", "demos+routing", "mu", "full")
SERVE_EARLY_METHODS = ("auto", "routing", "mu", "full")  # those with a form to serve before training ends
# POST /v1/tasks with "method": "lora" is import_lora_request's (a LoRA, not examples)
TASK_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
MIX_RE = re.compile(r"^mix:[a-z0-9._=,+-]{3,720}$")
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass(frozen=True)
class RequestSpec:
    """One HTTP request, before it is sent."""

    method: str
    path: str
    json: Any = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def idempotent(self) -> bool:
        return self.method in ("GET", "HEAD", "OPTIONS")


@dataclass(frozen=True)
class ClientSettings:
    """The connection settings both clients share (validated once, here)."""

    base_url: str = DEFAULT_URL
    api_key: str | None = None
    timeout: float | None = 60.0
    max_retries: int = 3
    backoff: float = 0.5

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise InvalidInput(f"base_url {self.base_url!r} must start with http:// or https://")
        if self.max_retries < 0:
            raise InvalidInput(f"max_retries must be >= 0, got {self.max_retries}")
        if self.backoff < 0:
            raise InvalidInput(f"backoff must be >= 0, got {self.backoff}")

    def http_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``httpx.Client`` / ``httpx.AsyncClient``."""
        return {
            "base_url": self.base_url.rstrip("/"),
            "headers": build_headers(self.api_key),
            "timeout": httpx.Timeout(self.timeout),
        }


def connection_failed(exc: httpx.TransportError, spec: RequestSpec) -> ConnectionFailed:
    kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "connection_error"
    detail = str(exc) or type(exc).__name__
    return ConnectionFailed(None, kind, f"{spec.method} {spec.path}: {detail}")


def poll_delay(job: Job, deadline: float | None, now: float, interval: float) -> float | None:
    """How long to sleep before polling ``job`` again; ``None`` once it is done.

    Raises ``TimeoutError`` once ``deadline`` (a clock value) has passed.
    """
    if job.done:
        return None
    if deadline is not None:
        if now >= deadline:
            raise TimeoutError(f"job {job.id} still {job.status} when the wait timed out")
        return max(0.0, min(interval, deadline - now))
    return interval


def ready_from_status(status: int) -> bool | None:
    """``/ready``: True for 2xx, False for 503 (not ready / draining), None for anything else."""
    if 200 <= status < 300:
        return True
    if status == 503:
        return False
    return None


def check_task_id(task: str) -> str:
    """Return ``task`` if it is a valid task id (contract: ``^[a-z0-9][a-z0-9._-]{0,63}$``)."""
    if not isinstance(task, str) or not TASK_ID_RE.fullmatch(task):
        raise InvalidInput(f"task id {task!r} must match {TASK_ID_RE.pattern}")
    return task


def check_model_id(task: str) -> str:
    """A task id, or a mix ``mix:ID=W,...`` (checked in full by the server)."""
    if isinstance(task, str) and task.startswith("mix:") and MIX_RE.fullmatch(task):
        return task
    return check_task_id(task)


def similar_path(task: str) -> str:
    return f"{task_path(task)}/similar"


def _seg(value: str, what: str) -> str:
    """A URL path segment, percent-encoded so an id can never escape its route."""
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{what} must be a non-empty string, got {value!r}")
    return quote(value, safe="")


def build_headers(api_key: str | None) -> dict[str, str]:
    headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def retry_delay(
    attempt: int,
    max_retries: int,
    backoff: float,
    spec: RequestSpec,
    *,
    response: httpx.Response | None = None,
    exc: Exception | None = None,
) -> float | None:
    """Seconds to wait before retrying after ``attempt`` (0-based) failed, or ``None`` to give up.

    Retried: 429 and 503 answers (the server did not run the request), for any method, waiting for
    ``Retry-After`` when the server sends it, else ``backoff * 2**attempt``; connection failures
    (the request never left) for any method; other transport errors only for idempotent requests.
    """
    if attempt >= max_retries:
        return None
    if response is not None:
        if response.status_code not in RETRY_STATUSES:
            return None
        hint = parse_retry_after(response.headers.get("retry-after"))
        if hint is not None:
            return hint
    elif exc is not None and not (
        isinstance(exc, _CONNECT_ERRORS) or (spec.idempotent and isinstance(exc, httpx.TransportError))
    ):
        return None
    return backoff * (1 << attempt)


def json_body(response: httpx.Response) -> Any:
    """The decoded JSON of a successful response (``None`` for an empty body)."""
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError as exc:
        raise PolyserveError(
            response.status_code, "invalid_response", "the server answered non-JSON"
        ) from exc


def _drop_none(params: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


# ---- requests -----------------------------------------------------------------------------------


def generate_request(task: str, prompt: str, params: Mapping[str, Any], *, stream: bool) -> RequestSpec:
    if not isinstance(prompt, str):
        raise InvalidInput("prompt must be a string")
    if "stream" in params:
        raise InvalidInput("use generate_stream() to stream instead of passing stream=")
    body = {"task": check_model_id(task), "prompt": prompt, **_drop_none(params), "stream": stream}
    return RequestSpec("POST", "/v1/generate", body)


def openai_request(path: str, key: str, value: Any, model: str, params: Mapping[str, Any]) -> RequestSpec:
    if params.get("stream"):
        raise InvalidInput("streaming OpenAI-compatible calls: use the official `openai` client")
    return RequestSpec("POST", path, {"model": model, key: value, **_drop_none(params)})


def task_path(task: str) -> str:
    return f"/v1/tasks/{_seg(check_task_id(task), 'task')}"


def job_path(job_id: str, suffix: str = "") -> str:
    return f"/v1/jobs/{_seg(job_id, 'job id')}{suffix}"


def register_request(
    task: str,
    examples: list[dict[str, Any]] | None,
    jsonl_path: str | PathLike[str] | None,
    method: str,
    steps: int | None,
    seed: int | None,
    serve_early: bool = False,
    shared: bool = False,
    description: str | None = None,
) -> RequestSpec:
    """``serve_early``, ``shared`` and ``description`` are sent only when set, so a server that
    predates them still accepts the default request."""
    check_task_id(task)
    if (examples is None) == (jsonl_path is None):
        raise InvalidInput("pass exactly one of examples= or jsonl_path=")
    if method not in METHODS:
        raise InvalidInput(f"method {method!r} must be one of {', '.join(METHODS)}")
    for name, value in (("steps", steps), ("seed", seed)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise InvalidInput(f"{name} must be a non-negative integer, got {value!r}")
    rows = load_jsonl(jsonl_path) if jsonl_path is not None else list(examples or [])
    if serve_early and method not in SERVE_EARLY_METHODS:
        raise InvalidInput(f"serve_early needs a method with a form to serve before training "
                           f"({', '.join(SERVE_EARLY_METHODS)}), not {method}")
    body = {"task": task, "examples": validate_examples(rows, task), "method": method}
    if description is not None and not (isinstance(description, str) and description.strip()):
        raise InvalidInput("description must be a non-empty string")
    flags = {"serve_early": True if serve_early else None, "shared": True if shared else None,
             "description": description}
    return RequestSpec("POST", "/v1/tasks", {**body, **_drop_none({"steps": steps, "seed": seed, **flags})})


def import_lora_request(task: str, src: str | PathLike[str], project: bool, shared: bool) -> RequestSpec:
    """``POST /v1/tasks`` with ``"method": "lora"``: a PEFT LoRA directory's adapter_config.json
    and adapter_model.safetensors, the weights' bytes sent as they are (base64); the server parses
    them as safetensors only."""
    check_task_id(task)
    root = Path(src)
    config_path, weights_path = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not config_path.is_file():
        raise InvalidInput(f"{root}: no adapter_config.json")
    if not weights_path.is_file():
        raise InvalidInput(f"{root}: no adapter_model.safetensors (a .bin checkpoint is never sent)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise InvalidInput(f"{config_path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InvalidInput(f"{config_path}: not a JSON object")
    body: dict[str, Any] = {
        "task": task,
        "method": "lora",
        "adapter": base64.b64encode(weights_path.read_bytes()).decode("ascii"),
        "adapter_config": config,
    }
    if project:
        body["project"] = True
    if shared:
        body["shared"] = True
    return RequestSpec("POST", "/v1/tasks", body)


def usage_request(window: int | None) -> RequestSpec:
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise InvalidInput(f"window must be a positive number of seconds, got {window!r}")
    return RequestSpec("GET", "/v1/usage", params=_drop_none({"window": window}))


def model_path(model: str) -> str:
    return f"/v1/models/{_seg(check_model_id(model), 'model')}"


def load_jsonl(path: str | PathLike[str]) -> list[dict[str, Any]]:
    """Read a JSONL file of ``{"task"?, "input", "output"}`` objects (blank lines skipped)."""
    rows: list[dict[str, Any]] = []
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidInput(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise InvalidInput(f"{path}:{lineno}: expected a JSON object")
            rows.append(row)
    return rows


def validate_examples(rows: Iterable[Any], task: str) -> list[dict[str, str]]:
    """Check examples locally and keep only ``input``/``output`` (error messages name the field)."""
    clean: list[dict[str, str]] = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise InvalidInput(f"examples[{i}] must be an object with 'input' and 'output'")
        for key in ("input", "output"):
            if not isinstance(row.get(key), str):
                raise InvalidInput(f"examples[{i}].{key} must be a string")
        if "task" in row and row["task"] != task:
            raise InvalidInput(f"examples[{i}].task does not match the task {task!r}")
        clean.append({"input": row["input"], "output": row["output"]})
    if not clean:
        raise InvalidInput("examples must not be empty")
    return clean


# ---- responses ----------------------------------------------------------------------------------


def json_object(payload: Any) -> dict[str, Any]:
    """A response that must be a JSON object (the OpenAI-compatible endpoints)."""
    if not isinstance(payload, dict):
        raise PolyserveError(None, "invalid_response", "expected a JSON object")
    return payload


def data_list(payload: Any) -> list[Any]:
    """The items of a ``{"data": [...]}`` list object (or of a bare JSON list)."""
    if isinstance(payload, dict):
        payload = payload.get("data", [])
    if not isinstance(payload, list):
        raise PolyserveError(None, "invalid_response", "expected a list of objects")
    return payload


def parse_tasks(payload: Any) -> list[Task]:
    return [Task.from_json(item) for item in data_list(payload)]


def parse_models(payload: Any) -> list[Model]:
    return [Model.from_json(item) for item in data_list(payload)]


def parse_similar(payload: Any) -> list[SimilarTask]:
    return [SimilarTask.from_json(item) for item in data_list(payload)]


def parse_usage(payload: Any) -> list[UsageRow]:
    return [UsageRow.from_json(item) for item in data_list(payload)]


def parse_events(payload: Any) -> list[JobEvent]:
    return [JobEvent.from_json(item) for item in data_list(payload)]


def parse_generation(payload: Any) -> Generation:
    return Generation.from_json(payload)


def parse_job(payload: Any) -> Job:
    if isinstance(payload, dict) and isinstance(payload.get("job"), dict) and "status" not in payload:
        payload = payload["job"]
    return Job.from_json(payload)
