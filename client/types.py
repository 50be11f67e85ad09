"""Typed, immutable views of the server's JSON responses.

Every type has a ``from_json`` classmethod that ignores fields it does not know (the server may add
fields at any time) and keeps the whole object in ``raw``, so nothing the server sent is lost.
Timestamps are normalised to Unix seconds (``float``), whether the server sends numbers or
ISO-8601 strings.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any, Literal, Self

__all__ = [
    "TERMINAL_JOB_STATUSES",
    "ErrorInfo",
    "Generation",
    "Job",
    "JobEvent",
    "Model",
    "SimilarTask",
    "StreamChunk",
    "Task",
    "Usage",
    "UsageRow",
    "timestamp",
]

FinishReason = Literal["stop", "length", "cancelled"]
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL_JOB_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


def _obj(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object for {what}, got {type(data).__name__}")
    return data


def _str(value: Any, default: str = "") -> str:
    return default if value is None else str(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _float(value: Any, default: float = 0.0) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def timestamp(value: Any) -> float | None:
    """Unix seconds from a number or an ISO-8601 string; ``None`` when absent or unreadable."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
        try:
            parsed = _dt.datetime.fromisoformat(value)
        except ValueError:
            return None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=_dt.UTC)
        return parsed.timestamp()
    return None


@dataclass(frozen=True)
class Usage:
    """Token counts of one generation."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_json(cls, data: Any) -> Self:
        data = _obj(data, "usage")
        return cls(_int(data.get("prompt_tokens")), _int(data.get("completion_tokens")))


@dataclass(frozen=True)
class ErrorInfo:
    """The ``{"type", "message"}`` error a failed job carries."""

    type: str
    message: str

    @classmethod
    def from_json(cls, data: Any) -> Self:
        if isinstance(data, str):
            return cls("error", data)
        data = _obj(data, "error")
        return cls(_str(data.get("type"), "error"), _str(data.get("message")))


@dataclass(frozen=True)
class Generation:
    """The answer of ``POST /v1/generate``."""

    id: str
    task: str
    text: str
    finish_reason: str | None
    usage: Usage
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Any) -> Self:
        data = _obj(data, "generation")
        usage = data.get("usage")
        return cls(
            id=_str(data.get("id")),
            task=_str(data.get("task")),
            text=_str(data.get("text")),
            finish_reason=_opt_str(data.get("finish_reason")),
            usage=Usage.from_json(usage) if isinstance(usage, dict) else Usage(),
            raw=data,
        )


@dataclass(frozen=True)
class StreamChunk:
    """One Server-Sent Event of a streamed generation: new ``text``; the last one has
    ``finish_reason`` and ``usage``."""

    id: str
    task: str
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_json(cls, data: Any) -> Self:
        data = _obj(data, "stream chunk")
        usage = data.get("usage")
        return cls(
            id=_str(data.get("id")),
            task=_str(data.get("task")),
            text=_str(data.get("text")),
            finish_reason=_opt_str(data.get("finish_reason")),
            usage=Usage.from_json(usage) if isinstance(usage, dict) else None,
            raw=data,
        )


@dataclass(frozen=True)
class Quality:
    """A shipped task's measured exact match: on held-out words, and on sentences for a word-level
    task (None for the others), over ``n`` inputs each. ``below_floor``: under the server's floor,
    installed only on request."""

    heldout_exact: float
    n: int
    measured: str | None = None
    sentences_exact: float | None = None
    below_floor: bool = False

    @classmethod
    def from_json(cls, data: Any) -> Quality | None:
        """None for a missing or unreadable quality (a registered task has none)."""
        if not isinstance(data, dict) or data.get("heldout_exact") is None:
            return None
        sentences = data.get("sentences_exact")
        return cls(heldout_exact=_float(data.get("heldout_exact")), n=_int(data.get("n")),
                   measured=_opt_str(data.get("measured")),
                   sentences_exact=None if sentences is None else _float(sentences),
                   below_floor=data.get("below_floor") is True)


@dataclass(frozen=True)
class Task:
    """A registered task (``GET /v1/tasks/{task}``)."""

    id: str
    status: str
    method: str | None = None
    version: int | str | None = None
    created_at: float | None = None
    params: int | None = None
    updated_at: float | None = None
    kind: str | None = None
    job_id: str | None = None
    description: str | None = None
    quality: Quality | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    @classmethod
    def from_json(cls, data: Any) -> Self:
        data = _obj(data, "task")
        version = data.get("version")
        params = data.get("params")
        return cls(
            id=_str(data.get("id", data.get("task"))),
            status=_str(data.get("status"), "unknown"),
            method=_opt_str(data.get("method")),
            version=version if isinstance(version, int | str) and not isinstance(version, bool) else None,
            created_at=timestamp(data.get("created_at")),
            params=_int(params) if params is not None else None,
            updated_at=timestamp(data.get("updated_at")),
            kind=_opt_str(data.get("kind")),
            job_id=_opt_str(data.get("job_id")),
            description=_opt_str(data.get("description")),
            quality=Quality.from_json(data.get("quality")),
            raw=data,
        )


@dataclass(frozen=True)
class Job:
    """A training job registering a task (shaped after OpenAI fine-tuning jobs)."""

    id: str
    task: str
    status: str
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    progress: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: ErrorInfo | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def done(self) -> bool:
        """Whether the job reached a terminal status (succeeded, failed or cancelled)."""
        return self.status in TERMINAL_JOB_STATUSES

    @property
    def succeeded(self) -> bool:
        return self.status == "succeeded"

    @classmethod
    def from_json(cls, data: Any) -> Self:
        data = _obj(data, "job")
        metrics = data.get("metrics")
        error = data.get("error")
        return cls(
            id=_str(data.get("id")),
            task=_str(data.get("task")),
            status=_str(data.get("status"), "unknown"),
            created_at=timestamp(data.get("created_at")),
            started_at=timestamp(data.get("started_at")),
            finished_at=timestamp(data.get("finished_at")),
            progress=min(1.0, max(0.0, _float(data.get("progress")))),
            metrics=dict(metrics) if isinstance(metrics, dict) else {},
            error=ErrorInfo.from_json(error) if isinstance(error, dict | str) and error else None,
            raw=data,
        )


@dataclass(frozen=True)
class JobEvent:
    """One entry of ``GET /v1/jobs/{id}/events`` (shaped after OpenAI fine-tuning job events)."""

    message: str
    created_at: float | None = None
    level: str = "info"
    type: str | None = None
    id: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Any) -> Self:
        if isinstance(data, str):
            return cls(message=data, raw={"message": data})
        data = _obj(data, "job event")
        payload = data.get("data")
        return cls(
            message=_str(data.get("message", data.get("event"))),
            created_at=timestamp(data.get("created_at", data.get("time"))),
            level=_str(data.get("level"), "info"),
            type=_opt_str(data.get("type")),
            id=_opt_str(data.get("id")),
            data=dict(payload) if isinstance(payload, dict) else {},
            raw=data,
        )


@dataclass(frozen=True)
class Model:
    """An OpenAI model object of ``GET /v1/models`` (a ready task, or ``base``)."""

    id: str
    created: float | None = None
    owned_by: str | None = None
    parent: str | None = None
    description: str | None = None
    quality: Quality | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Any) -> Self:
        data = _obj(data, "model")
        return cls(
            id=_str(data.get("id")),
            created=timestamp(data.get("created")),
            owned_by=_opt_str(data.get("owned_by")),
            parent=_opt_str(data.get("parent")),
            description=_opt_str(data.get("description")),
            quality=Quality.from_json(data.get("quality")),
            raw=data,
        )


@dataclass(frozen=True)
class SimilarTask:
    """One answer of ``GET /v1/tasks/{task}/similar``: a task and its cosine in skill space."""

    id: str
    score: float
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Any) -> Self:
        data = _obj(data, "similar task")
        return cls(id=_str(data.get("id")), score=_float(data.get("score")), raw=data)


@dataclass(frozen=True)
class UsageRow:
    """One (tenant, task) row of ``GET /v1/usage``."""

    tenant: str
    task: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    refused: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Any) -> Self:
        data = _obj(data, "usage row")
        return cls(
            tenant=_str(data.get("tenant")),
            task=_str(data.get("task")),
            requests=_int(data.get("requests")),
            prompt_tokens=_int(data.get("prompt_tokens")),
            completion_tokens=_int(data.get("completion_tokens")),
            refused=_int(data.get("refused")),
            raw=data,
        )
