"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and the
API-key check that answers with one: what every route and middleware of the server
answers a refusal with."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from paged_engine.entrypoints.protocol import error_body

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error"}
"""OpenAI's error ``type`` by status; other statuses below 500 are invalid requests too
(413), those from 500 up ``server_error``."""


def error_response(
    status: int, message: str, param: str | None = None, code: Any = None
) -> JSONResponse:
    type_ = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


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
