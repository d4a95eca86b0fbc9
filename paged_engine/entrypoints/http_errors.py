"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: the
application's handlers that answer every refusal and failure with one, the API-key check,
and the request field an engine refusal is about."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from paged_engine.entrypoints.protocol import error_body
from paged_engine.entrypoints.serving import RequestError, param_of

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error"}
"""OpenAI's error ``type`` by status; other statuses below 500 are invalid requests too
(413), those from 500 up ``server_error``."""


def error_response(
    status: int, message: str, param: str | None = None, code: Any = None
) -> JSONResponse:
    type_ = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def add_error_handlers(app: FastAPI, rejected: Callable[[int], None]) -> None:
    """A ``RequestError`` as its status (counted by ``rejected``), Starlette's own errors
    (404 for an unknown route) and anything unexpected (500), all in OpenAI's shape."""

    async def request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        rejected(exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.code)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(exc.status_code, str(exc.detail))

    async def unexpected(request: Request, exc: Exception) -> Response:
        return error_response(500, f"internal error: {exc!r}")

    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def refused_field(e: Exception, rename: dict[str, str]) -> str:
    """The request field the engine refused, as the client spelled it."""
    field = getattr(e, "field", None)  # an InvalidRequestError names it
    if field is None:
        return param_of(str(e), rename)
    if field == "prompt_token_ids":  # the ids this server made of the prompt
        field = "prompt"
    return rename.get(field, field)


class ApiKeyMiddleware:
    """401 for every request but ``/health`` without ``Authorization: Bearer <api_key>``
    (compared in constant time). Plain ASGI, so streaming is untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(
                    401, "a valid API key is needed: Authorization: Bearer KEY",
                    code="invalid_api_key",
                )  # fmt: skip
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
