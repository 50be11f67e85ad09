"""API errors and their translation to the contract's shape, in one place:

    {"error": {"type": str, "message": str}}      (422 names the field, never echoes the input)
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters_store.errors import JobNotFound, StoreError, TaskExists, TaskNotFound

log = logging.getLogger("polyserve.api")

TYPES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
         409: "conflict", 413: "too_large", 422: "validation_error", 429: "overloaded", 503: "unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type_, message, headers or {}


def error_body(type_: str, message: str) -> dict:
    return {"error": {"type": type_, "message": message}}


def error_response(status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(type_, message), status_code=status, headers=headers)


def _field(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


def validation_message(err: RequestValidationError) -> str:
    msgs = []
    for e in err.errors()[:5]:
        if e.get("type") == "json_invalid":
            msgs.append("body: invalid JSON")
        else:
            msgs.append(f"{_field(tuple(e.get('loc', ())))}: {e.get('msg', 'invalid')}")
    return "; ".join(msgs)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.type, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "validation_error", validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, TYPES.get(exc.status_code, "error"), str(exc.detail),
                              getattr(exc, "headers", None))

    @app.exception_handler(TaskNotFound)
    async def _task_missing(_: Request, exc: TaskNotFound) -> JSONResponse:
        return error_response(404, "not_found", str(exc))

    @app.exception_handler(JobNotFound)
    async def _job_missing(_: Request, exc: JobNotFound) -> JSONResponse:
        return error_response(404, "not_found", str(exc))

    @app.exception_handler(TaskExists)
    async def _exists(_: Request, exc: TaskExists) -> JSONResponse:
        return error_response(409, "conflict", str(exc))

    @app.exception_handler(StoreError)
    async def _store(_: Request, exc: StoreError) -> JSONResponse:
        log.exception("store error")
        return error_response(500, "store_error", str(exc))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, "internal_error", "internal server error")
