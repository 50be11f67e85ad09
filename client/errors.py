"""Typed errors raised by the polyserve client.

The server answers every error as ``{"error": {"type": str, "message": str, "param": str | None,
"code": str | None}}`` with a meaningful HTTP status (see docs/contract.md); its OpenAI
routes use OpenAI's order of the same keys.  ``param`` names the offending request field and
``code`` is a stable machine-readable reason (``context_length_exceeded``, ``timeout``...).
:func:`error_from_response` turns such a response, or any non-JSON error body a proxy may have
produced, into the matching :class:`PolyserveError` subclass.
"""

from __future__ import annotations

import email.utils
import json
import math
import re
import time
from typing import Any

import httpx

__all__ = [
    "BadRequest",
    "Conflict",
    "ConnectionFailed",
    "DeadlineExceeded",
    "Forbidden",
    "InvalidInput",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "PolyserveError",
    "ServerError",
    "Unauthorized",
    "Unavailable",
    "ValidationError",
    "error_from_payload",
    "error_from_response",
    "parse_retry_after",
]

_MAX_MESSAGE_CHARS = 500


class PolyserveError(Exception):
    """An error answered by the server (or by a proxy in front of it).

    ``status`` is the HTTP status (``None`` for an error event inside a stream), ``type`` the
    server's machine-readable error type and ``message`` its human-readable message; ``param``
    the request field it is about and ``code`` a finer reason, when the server names them.
    """

    param: str | None = None
    code: str | None = None

    def __init__(self, status: int | None, type: str, message: str, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.body = body

    def __str__(self) -> str:
        prefix = f"{self.status} " if self.status is not None else ""
        return f"{prefix}{self.type}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status!r}, type={self.type!r}, message={self.message!r})"


class BadRequest(PolyserveError):
    """400: the request was malformed."""


class Unauthorized(PolyserveError):
    """401: missing or wrong API key."""


class Forbidden(PolyserveError):
    """403: the API key may not do this (task and job changes need an admin key)."""


class NotFound(PolyserveError):
    """404: unknown task or job."""


class Conflict(PolyserveError):
    """409: the task already exists, or is not ready yet.

    ``job_id`` is the id of the job the conflict is about, when the server names one.
    """

    def __init__(
        self, status: int | None, type: str, message: str, body: Any = None, job_id: str | None = None
    ) -> None:
        super().__init__(status, type, message, body)
        self.job_id = job_id if job_id is not None else _find_job_id(body, message)


class PayloadTooLarge(PolyserveError):
    """413: the body or the prompt is too large."""


class ValidationError(PolyserveError):
    """422: a field failed validation."""


class _RetryAfterError(PolyserveError):
    """An error the server expects to clear; ``retry_after`` is its hint in seconds, if any."""

    def __init__(
        self,
        status: int | None,
        type: str,
        message: str,
        body: Any = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, type, message, body)
        self.retry_after = retry_after


class Overloaded(_RetryAfterError):
    """429: the server's queue is full; ``retry_after`` is the server's hint in seconds."""


class Unavailable(_RetryAfterError):
    """503: the server is not ready yet, or is draining; ``retry_after`` as for 429."""


class ConnectionFailed(PolyserveError):
    """The server could not be reached, or the connection failed or timed out (no HTTP status)."""


class InvalidInput(ValueError):
    """Input the client refused to send (bad task id, empty examples...); raised before any I/O."""


class ServerError(PolyserveError):
    """Any other 5xx.  A 500 from polyserve is always a bug worth reporting."""


class DeadlineExceeded(ServerError):
    """504: the generation did not finish within the server's deadline (the row was cancelled)."""


_BY_STATUS: dict[int, type[PolyserveError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: ValidationError,
    429: Overloaded,
    503: Unavailable,
    504: DeadlineExceeded,
}

_JOB_ID_PATTERNS = (
    re.compile(r"\bjob[_ -]?id\b\s*[:=]?\s*['\"]?([A-Za-z0-9][A-Za-z0-9_.:-]*)", re.IGNORECASE),
    re.compile(r"(?<![A-Za-z0-9])((?:ft)?job[_-][A-Za-z0-9][A-Za-z0-9_-]*)"),
    re.compile(r"\bjob\s+['\"]?([0-9a-f]{8}-?[0-9a-f-]{4,}|[0-9a-f]{12,})\b", re.IGNORECASE),
)


def _find_job_id(body: Any, message: str) -> str | None:
    """The job id carried by a 409 body (``error.job_id``, ``job_id``) or named in its message."""
    if isinstance(body, dict):
        err = body.get("error")
        for holder in (err, body):
            if isinstance(holder, dict):
                for key in ("job_id", "job"):
                    value = holder.get(key)
                    if isinstance(value, str) and value:
                        return value
                    if isinstance(value, dict) and isinstance(value.get("id"), str):
                        return str(value["id"])
    for pattern in _JOB_ID_PATTERNS:
        match = pattern.search(message or "")
        if match:
            return match.group(1).rstrip(".:")
    return None


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date), or ``None``."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if math.isnan(seconds):
        return None
    return max(0.0, seconds)


def error_from_payload(
    status: int | None, payload: Any, *, fallback_message: str = "", retry_after: float | None = None
) -> PolyserveError:
    """Build the typed error for ``status`` from a decoded body (any JSON value, or ``None``)."""
    err_type, message = "", ""
    param: str | None = None
    code: str | None = None
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict):
            err_type = str(err.get("type") or "")
            message = str(err.get("message") or "")
            param = str(err["param"]) if isinstance(err.get("param"), str | int) else None
            code = str(err["code"]) if isinstance(err.get("code"), str | int) else None
        elif isinstance(err, str):
            message = err
        elif isinstance(payload.get("detail"), str):  # a bare FastAPI/Starlette error
            message = payload["detail"]
    message = (message or fallback_message or "no error message")[:_MAX_MESSAGE_CHARS]
    if status is None:
        cls: type[PolyserveError] = PolyserveError
    elif status in _BY_STATUS:
        cls = _BY_STATUS[status]
    elif status >= 500:
        cls = ServerError
    else:
        cls = PolyserveError
    err_type = err_type or (f"http_{status}" if status is not None else "stream_error")
    if issubclass(cls, _RetryAfterError):
        error: PolyserveError = cls(status, err_type, message, payload, retry_after=retry_after)
    else:
        error = cls(status, err_type, message, payload)
    error.param, error.code = param, code
    return error


def error_from_response(response: httpx.Response) -> PolyserveError:
    """Map an error :class:`httpx.Response` (already read) to a :class:`PolyserveError` subclass.

    Robust to bodies that are not JSON (an HTML page from a proxy, an empty body): the message then
    falls back to the start of the text, or to the reason phrase.
    """
    payload: Any = None
    text = ""
    try:
        text = response.text
        payload = json.loads(text) if text else None
    except (ValueError, UnicodeDecodeError, httpx.ResponseNotRead):
        payload = None
    fallback = " ".join(text.split())[:200] if text and payload is None else ""
    fallback = fallback or response.reason_phrase or f"HTTP {response.status_code}"
    return error_from_payload(
        response.status_code,
        payload,
        fallback_message=fallback,
        retry_after=parse_retry_after(response.headers.get("retry-after")),
    )
