"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with its status codes.

Every error response says whether a retry can help (`x-should-retry`, which OpenAI's SDKs obey before their
own rule of retrying 408, 409, 429 and 5xx): yes for a limit (429), a database or broker that is away (503),
an answer not ready in time (504: the retry reattaches to the same job) and a job not finished yet (409
`job_not_finished`); no for everything the same request would meet again (4xx, a job that failed or was
cancelled, an internal error).
"""

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

_RETRYABLE_STATUSES = (429, 503, 504)
_RETRYABLE_CODES = ("job_not_finished",)

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
        should_retry: bool | None = None,
        **extra: Any,
    ) -> None:
        """`should_retry`: whether the same request may succeed later (None: by status and code)."""
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.extra = status, message, param, code, extra
        if should_retry is None:
            should_retry = status in _RETRYABLE_STATUSES or code in _RETRYABLE_CODES
        self.should_retry = should_retry
        self.headers = {**(headers or {}), "x-should-retry": "true" if should_retry else "false"}

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": _TYPES.get(self.status, "server_error")}
        error.update(param=self.param, code=self.code, **self.extra)
        return {"error": error}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


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
