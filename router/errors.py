"""OpenAI-format errors. Every failure a client can cause or meet is an :class:`APIError`, rendered as
``{"error": {"message", "type", "param", "code"}}`` -- never a traceback, never a bare 500."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error this gateway answers (but the Anthropic Messages routes'), validation failures included."""

    error: ErrorDetail


_MEANINGS = {
    400: "Bad request: not JSON, or a field the gateway cannot use", 401: "No or wrong bearer token",
    403: "No admin token configured and the client is not on loopback", 404: "Not found",
    409: "Conflicts with the gateway's state", 422: "A field fails validation",
    503: "The index (Redis) or every worker is unavailable",
}


def error_responses(*statuses: int) -> dict:
    """OpenAPI ``responses`` for the error statuses a route answers, each in the OpenAI error shape."""
    return {s: {"model": ErrorBody, "description": _MEANINGS[s]} for s in statuses}


def document_errors(app: FastAPI) -> None:
    """FastAPI declares its own 422 body (``HTTPValidationError``) on every route with parameters; this app
    answers those in the OpenAI shape (:func:`install_handlers`), so its OpenAPI document says so."""
    make = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = make()
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        body = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in body.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas.setdefault("ErrorBody", body)
        ref = {"$ref": "#/components/schemas/ErrorBody"}
        for ops in spec.get("paths", {}).values():
            for op in ops.values():
                r422 = op.get("responses", {}).get("422") if isinstance(op, dict) else None
                if r422 is not None:
                    r422["description"] = _MEANINGS[422]
                    r422["content"] = {"application/json": {"schema": ref}}
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = spec
        return spec

    app.openapi = openapi


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
        if first.get("type") == "json_invalid":  # not JSON at all: the 400 the data routes answer, no param
            why = (first.get("ctx") or {}).get("error") or first.get("msg", "")
            return error_response(APIError(400, f"Invalid JSON body: {why}", code="invalid_json"))
        parts = list(first.get("loc", ()))
        if parts and parts[0] in ("body", "query", "path", "header"):  # FastAPI's location, not a field
            parts = parts[1:]
        loc = ".".join(str(p) for p in parts) or None
        return error_response(APIError(422, first.get("msg", "invalid request"), param=loc))

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error: %s", exc)
        return error_response(APIError(500, "internal gateway error", type_="api_error"))
