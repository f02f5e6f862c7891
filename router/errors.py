"""OpenAI-format errors. Every failure a client can cause or meet is an :class:`APIError`, rendered as
``{"error": {"message", "type", "param", "code"}}`` -- never a traceback, never a bare 500."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger("kvgate.errors")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class APIError(Exception):
    """An error with an HTTP status, rendered in the OpenAI error format."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "api_error")


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_ or _TYPES.get(status, "api_error"),
                      "param": param, "code": code}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> Response:
    body = error_body(err.status, err.message, param=err.param, code=err.code, type_=err.type)
    return Response(json.dumps(body), status_code=err.status, media_type="application/json", headers=headers)


def sse_error_event(message: str, code: str = "upstream_error", status: int = 502) -> bytes:
    """The event that ends a stream whose upstream failed after the first byte, then ``[DONE]``."""
    body = error_body(status, message, code=code)
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


def install_handlers(app: FastAPI) -> None:
    """Map every exception to an OpenAI error body; unexpected ones are logged and answered 500 plainly."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(APIError(exc.status_code, msg), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        errs = exc.errors()
        first = errs[0] if errs else {}
        parts = list(first.get("loc", ()))
        if parts and parts[0] in ("body", "query", "path", "header"):  # FastAPI's location, not a field
            parts = parts[1:]
        loc = ".".join(str(p) for p in parts) or None
        return error_response(APIError(422, first.get("msg", "invalid request"), param=loc))

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error: %s", exc)
        return error_response(APIError(500, "internal gateway error", type_="api_error"))
