"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with its status codes."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from workers.db.errors import db_transient
from workers.kafka_io.errors import kafka_transient

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.extra = status, message, param, code, extra
        self.headers = headers or {}  # of the response (429: Retry-After)

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": _TYPES.get(self.status, "server_error")}
        error.update(param=self.param, code=self.code, **self.extra)
        return {"error": error}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


def not_found(what: str, ident: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such {what}: '{ident}'", param=param, code=f"{what}_not_found")


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Unknown endpoint: {request.method} {request.url.path}"
            return error_response(APIError(404, message, code="unknown_url"))
        if exc.status_code == 405:
            message = f"Method {request.method} not allowed on {request.url.path}"
            return error_response(APIError(405, message, code="method_not_allowed"))
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # the database or the broker away is worth a retry (503); anything else is ours (500)
        if db_transient(exc):
            return error_response(
                APIError(503, "The database is unavailable; retry later", code="db_unavailable")
            )
        if kafka_transient(exc):
            return error_response(
                APIError(503, "The broker is unavailable; retry later", code="queue_unavailable")
            )
        log.exception("unexpected error")
        return error_response(APIError(500, f"Internal error: {type(exc).__name__}", code="internal_error"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid")
        return error_response(APIError(400, message, param=param, code="invalid_value"))
