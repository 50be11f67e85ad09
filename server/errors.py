"""ApiError: how a request ends in an HTTP error, raised wherever the reason is known (the routes,
task resolution, registration) and answered by server/api/errors.py in the route's error shape.
It lives outside server/api/ so that the domain code that raises it need not import the HTTP layer."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, type_: str, message: str, headers: dict[str, str] | None = None, *,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type_, message, headers or {}
        self.param, self.code = param, code
