"""API errors and their translation to HTTP, in one place. Two shapes, chosen by the route:

    polyserve's own routes (contract):  {"error": {"type", "message", "param", "code"}}
    OpenAI routes (/v1/completions, /v1/chat/completions, /v1/models...):
                                        {"error": {"message", "type", "param", "code"}}

`param` names the offending request field (null when none), `code` is a stable machine-readable
reason (null when none). On the OpenAI routes `type` is OpenAI's class of error
(`invalid_request_error`, `authentication_error`, `rate_limit_error`, `server_error`), `code`
carries polyserve's own type unless a more specific OpenAI code applies (`model_not_found`,
`context_length_exceeded`, `invalid_api_key`), and bad input is 400 (OpenAI's status) where
polyserve's routes answer 422. A too long prompt is 413 `too_large` on polyserve's routes and 400
`context_length_exceeded` on the OpenAI routes.

Messages name the field and never echo the input; they never carry filesystem paths (anything
that looks like one is replaced by `<path>`: store and start-up failures are logged in full and
answered in general terms).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters_store.store.errors import (
    JobNotFound,
    StoreError,
    StoreUnavailable,
    TaskExists,
    TaskLimit,
    TaskNotFound,
)
from server.registry.errors import (
    JobsBusy,
    RegistryError,
    TaskForbidden,
    TaskNotReady,
    TenantJobLimit,
    TenantTaskLimit,
)

log = logging.getLogger("polyserve.api")


class ApiError(Exception):
    """How a request ends in an HTTP error, raised by the HTTP layer where the reason is known.
    The domain code below it raises its own errors (DOMAIN_ERRORS), mapped here."""

    def __init__(self, status: int, type_: str, message: str, headers: dict[str, str] | None = None, *,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type_, message, headers or {}
        self.param, self.code = param, code


# every domain error the API answers, and its status and type (the most specific class wins)
DOMAIN_ERRORS: dict[type[Exception], tuple[int, str]] = {
    TaskNotFound: (404, "not_found"),
    JobNotFound: (404, "not_found"),
    TaskExists: (409, "conflict"),
    TaskLimit: (409, "task_limit"),
    TaskNotReady: (409, "task_not_ready"),
    TaskForbidden: (403, "forbidden"),
    JobsBusy: (429, "overloaded"),
    TenantJobLimit: (429, "tenant_job_limit"),
    TenantTaskLimit: (409, "tenant_task_limit"),
}


def api_error(exc: Exception) -> ApiError | None:
    """The ApiError a domain error answers as; None for an exception the table does not name."""
    if isinstance(exc, ApiError):
        return exc
    for cls in type(exc).__mro__:
        if cls in DOMAIN_ERRORS:
            status, type_ = DOMAIN_ERRORS[cls]
            retry = getattr(exc, "retry_after", None) if isinstance(exc, RegistryError) else None
            return ApiError(status, type_, str(exc), {"Retry-After": str(retry)} if retry else None)
    return None

TYPES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
         409: "conflict", 413: "too_large", 422: "validation_error", 429: "overloaded", 500: "internal_error",
         503: "unavailable", 504: "timeout"}

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize",
                "/version")
OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
# polyserve type -> OpenAI code, where OpenAI has a name for it
OPENAI_CODES = {"not_found": "model_not_found", "unauthorized": "invalid_api_key"}

_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
_NAMED = re.compile(r"^([a-z_][a-z0-9_.]*): ")
_PATH = re.compile(r"(?<![\w.:/])(?:~|\.{1,2})?/(?:[\w.@+-]+/)+[\w.@+-]*")


def scrub(message: str) -> str:
    """The message without anything that looks like a filesystem path."""
    return _PATH.sub("<path>", message)


def is_openai_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


def error_body(type_: str, message: str, param: str | None = None, code: str | None = None) -> dict:
    """polyserve's shape."""
    return {"error": {"type": type_, "message": scrub(message), "param": param, "code": code}}


def openai_error(status: int, type_: str, message: str, param: str | None = None,
                 code: str | None = None) -> tuple[int, dict]:
    """(status, body) in OpenAI's shape for an error polyserve calls `type_`."""
    if code == "context_length_exceeded" or status == 422:
        status = 400
    if status >= 500:
        kind = "server_error"
    else:
        kind = OPENAI_TYPES.get(status, "invalid_request_error")
    code = code or OPENAI_CODES.get(type_, type_)
    return status, {"error": {"message": scrub(message), "type": kind, "param": param, "code": code}}


def error_payload(path: str, status: int, type_: str, message: str, param: str | None = None,
                  code: str | None = None) -> tuple[int, dict]:
    """(status, body) for the route at `path`."""
    if is_openai_path(path):
        return openai_error(status, type_, message, param, code)
    return status, error_body(type_, message, param, code)


def error_response(status: int, type_: str, message: str, headers: dict[str, str] | None = None, *,
                   path: str = "", param: str | None = None, code: str | None = None) -> JSONResponse:
    status, body = error_payload(path, status, type_, message, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


def _is_tag(part: object) -> bool:
    """pydantic's union-member tags in an error location ("str", "list[constrained-str]")."""
    return isinstance(part, str) and (bool(re.search(r"[\[\],-]", part)) or part in _TAGS)


def _field(loc: tuple) -> str:
    parts: list[str] = []
    for p in loc:
        if p == "[key]" and parts:  # a bad dict key: name the dict, not the key
            parts.pop()
        elif p not in ("body", "query", "path") and not _is_tag(p):
            parts.append(str(p))
    return ".".join(parts) or "body"


def is_json(content_type: str | None) -> bool:
    """application/json or a +json type (what FastAPI parses a body from)."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _body_message(e: dict, content_type: str | None) -> str | None:
    """What is wrong with the body as a whole, in words a person reads (None: a field's error)."""
    kind, loc = e.get("type"), tuple(e.get("loc", ()))
    if kind == "json_invalid":
        return "body: not valid JSON; send one JSON object"
    if loc != ("body",):
        return None
    if not is_json(content_type):
        got = (content_type or "").split(";")[0].strip() or "none"
        return f"body: send a JSON object with the header Content-Type: application/json (got {got})"
    if kind == "missing":
        return "body: empty; send a JSON object"
    if kind in ("model_attributes_type", "dict_type", "model_type"):
        return "body: must be a JSON object"
    return None


def _friendly(e: dict) -> str:
    """pydantic's message, except where a plainer one says the same."""
    kind, ctx = e.get("type"), e.get("ctx") or {}
    if kind in ("string_too_short", "too_short") and ctx.get("min_length") == 1:
        return "must not be empty"
    if kind in ("model_attributes_type", "model_type", "dict_type"):
        return "must be a JSON object"
    return str(e.get("msg", "invalid")).removeprefix("Value error, ")


def _relevant(errors: list[dict]) -> list[dict]:
    """A field of a union type fails once per member; where one member's check failed on the value
    (e.g. an empty string, or an empty one in a list), the other members' "not my type" errors
    under the same top-level field say nothing more."""
    def top(e: dict) -> str:
        return _field(tuple(e.get("loc", ()))).split(".")[0]

    def typed(e: dict) -> bool:
        return str(e.get("type", "")).endswith("_type")

    checked = {top(e) for e in errors if not typed(e)}
    return [e for e in errors if not (typed(e) and top(e) in checked)]


def validation_message(err: RequestValidationError, content_type: str | None = None) -> tuple[str, str | None]:
    """A message naming each bad field (never its value) and the first field's name; a body that
    is not a JSON object (or is not sent as JSON) is said so in plain words."""
    errors = list(err.errors())
    for e in _relevant(errors):
        body = _body_message(e, content_type)
        if body is not None:
            return body, "body"
    msgs, first = [], None
    for e in errors[:1] + _relevant(errors)[:5]:  # `param`: the first error's field, as always
        field = _field(tuple(e.get("loc", ())))
        msg = _friendly(e)
        named = _NAMED.match(msg)
        if field == "body" and named:  # a model-level check names its field first
            field, msg = named.group(1), msg[named.end():]
        if first is None:
            first = field
            if e not in _relevant(errors):
                continue
        if f"{field}: {msg}" not in msgs:
            msgs.append(f"{field}: {msg}")
    return "; ".join(msgs), first


def allowed_methods(app: Any, scope: Mapping[str, Any]) -> list[str]:
    """Every method some route serves at this scope's path (for the Allow header of a 405)."""
    methods: set[str] = set()
    path = scope.get("path", "")
    for route in all_routes(app.routes):
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(path):
            methods |= set(route.methods or ())
    return sorted(methods)


def all_routes(routes: list) -> list:
    """Every route: FastAPI >= 0.160 keeps included routers apart (route contexts); older ones
    (vLLM's environment pins one) copy their routes into the app."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:
        return list(routes)
    return list(iter_route_contexts(routes))


def install_handlers(app: FastAPI) -> None:
    def respond(request: Request, status: int, type_: str, message: str, headers: dict | None = None,
                param: str | None = None, code: str | None = None) -> JSONResponse:
        return error_response(status, type_, message, headers, path=request.url.path, param=param, code=code)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return respond(request, exc.status, exc.type, exc.message, exc.headers, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc, request.headers.get("content-type"))
        return respond(request, 422, "validation_error", message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(request.app, request.scope))
        return respond(request, exc.status_code, TYPES.get(exc.status_code, "error"), str(exc.detail), headers)

    async def _domain(request: Request, exc: Exception) -> JSONResponse:
        err = api_error(exc)
        assert err is not None  # registered for DOMAIN_ERRORS' classes only
        return respond(request, err.status, err.type, err.message, err.headers, err.param, err.code)

    for cls in DOMAIN_ERRORS:
        app.add_exception_handler(cls, _domain)

    @app.exception_handler(StoreUnavailable)
    async def _store_down(request: Request, exc: StoreUnavailable) -> JSONResponse:
        log.warning("store unavailable: %s", exc)
        return respond(request, 503, "store_unavailable", "the adapter store is unreachable; retry shortly",
                       headers={"Retry-After": "2"})

    @app.exception_handler(StoreError)
    async def _store(request: Request, exc: StoreError) -> JSONResponse:
        log.exception("store error")
        return respond(request, 500, "store_error", "the adapter store failed (details in the server log)")

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return respond(request, 500, "internal_error", "internal server error")
