"""An OpenAI-compatible HTTP server on one engine (``paged-engine serve``), on FastAPI and
uvicorn (the ``server`` extra).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /health`` (200 while the engine loop lives, else 503), ``GET /metrics``
(Prometheus). Errors have OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``. With an API key every route but ``/health`` needs ``Authorization: Bearer``.

The life of a request: the body is parsed and validated (pydantic, then
``SamplingParams``), each a 400 naming the field; the server refuses it with 503 when it
already holds ``max_queue`` prompts or is shutting down; then ``EngineLoop.submit`` adds
all its prompts on the engine thread (a refusal there, such as a prompt longer than
``max_model_len``, is a 400 and leaves nothing queued). A streamed request answers with
server-sent events, one chunk per new token, then ``data: [DONE]``; the others wait for
their final outputs. A client that goes away (the stream is cancelled, or a non-streamed
request sees ``http.disconnect``) has its requests aborted at once, freeing their blocks.

Shutdown (SIGTERM, SIGINT): uvicorn stops accepting connections; the engine loop refuses
new requests and lets the running ones go on for ``shutdown_timeout`` seconds, then
aborts them, so their streams end with an error event and ``[DONE]``; the process exits
with status 0 once the connections are closed (uvicorn's own limit is that plus 5 s).
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.entrypoints.engine_loop import EngineLoop
from paged_engine.entrypoints.formatters import ChatFormatter, CompletionFormatter
from paged_engine.entrypoints.loop_types import EngineUnavailable, PromptError
from paged_engine.entrypoints.metrics import ServerMetrics
from paged_engine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    error_body,
)
from paged_engine.entrypoints.serving import (
    RequestError,
    chat_prompt,
    completion_prompts,
    param_of,
    sampling_params,
    validation_error,
)
from paged_engine.entrypoints.settings import ServerSettings
from paged_engine.entrypoints.streaming import (
    EngineStream,
    collect,
    stream_events,
    until_disconnect,
)
from paged_engine.sampling_params import SamplingParams

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error"}


def _error(status: int, message: str, param: str | None = None, code: Any = None) -> JSONResponse:
    type_ = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


class OpenAIServer:
    """The application around one engine (see the module docstring). The engine is handed
    to the ``EngineLoop`` and touched by its thread alone; ``tokenizer`` is used only
    there too (chat templates). ``app`` is the ASGI application."""

    def __init__(
        self,
        engine: LLMEngine,
        settings: ServerSettings,
        *,
        tokenizer: Any,
        max_model_len: int,
        model_root: str | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(
            engine, max_step_failures=settings.max_step_failures, observer=self.metrics
        )
        self.metrics.bind(self.loop)
        self.tokenizer = tokenizer
        self.has_chat_template = settings.chat_template is not None or bool(
            getattr(tokenizer, "chat_template", None)
        )
        self.max_model_len = max_model_len
        self.model_root = model_root
        self.created = int(time.time())
        self.held = 0
        """Prompts admitted and not yet ended (event-loop thread only), for ``max_queue``."""
        self.app = self._build_app()

    @classmethod
    def from_llm(
        cls, llm: Any, settings: ServerSettings, model_root: str | None = None
    ) -> OpenAIServer:
        """The server of an ``LLM`` (which it then owns: use ``llm`` no more)."""
        return cls(
            llm.llm_engine,
            settings,
            tokenizer=llm.tokenizer,
            max_model_len=llm.config.max_model_len,
            model_root=model_root,
        )

    # ---- the application ---------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            self.loop.start(asyncio.get_running_loop())
            yield
            await asyncio.to_thread(self.loop.stop, 10.0)

        app = FastAPI(title="paged_engine", lifespan=lifespan)
        if self.settings.api_key is not None:
            app.add_middleware(ApiKeyMiddleware, api_key=self.settings.api_key)

        async def request_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, RequestError)
            self.metrics.rejected.labels(str(exc.status)).inc()
            return _error(exc.status, exc.message, exc.param, exc.code)

        async def http_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, StarletteHTTPException)
            return _error(exc.status_code, str(exc.detail))

        async def unexpected(request: Request, exc: Exception) -> Response:
            return _error(500, f"internal error: {exc!r}")

        app.add_exception_handler(RequestError, request_error)
        app.add_exception_handler(StarletteHTTPException, http_error)
        app.add_exception_handler(Exception, unexpected)

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.loop.alive else 503)

        @app.get("/v1/models")
        async def models() -> ModelList:
            card = ModelCard(
                id=self.settings.served_model_name,
                created=self.created,
                root=self.model_root,
                max_model_len=self.max_model_len,
            )
            return ModelList(data=[card])

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._completions(request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._chat(request)

        return app

    async def _parse(self, request: Request, model: type[Any]) -> Any:
        raw = await request.body()
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            raise validation_error(e) from None

    def _check_model(self, name: str) -> None:
        if name != self.settings.served_model_name:
            raise RequestError(
                f"the model {name!r} does not exist; this server serves "
                f"{self.settings.served_model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def _completions(self, request: Request) -> Response:
        arrival = time.time()
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        self._check_model(body.model)
        if body.suffix is not None:
            raise RequestError("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise RequestError("best_of must equal n (or be omitted)", param="best_of")
        if body.echo and body.logprobs is not None:
            raise RequestError("echo with logprobs is not supported", param="echo")
        prompts = completion_prompts(body)
        max_tokens = 16 if "max_tokens" not in body.model_fields_set else body.max_tokens
        params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, rename={})
        rid = f"cmpl-{uuid.uuid4().hex}"
        ids = [f"{rid}-{i}" for i in range(len(prompts))]
        fmt = CompletionFormatter(
            rid,
            body.model,
            int(arrival),
            ids,
            body.n,
            echo_texts=[str(p) for p in prompts] if body.echo else None,
            logprobs=body.logprobs is not None,
            return_token_ids=body.return_token_ids,
        )
        reqs: list[tuple[str, object, SamplingParams]] = [
            (i, p, params) for i, p in zip(ids, prompts, strict=True)
        ]
        return await self._serve(request, body, reqs, fmt, arrival, rename={})

    async def _chat(self, request: Request) -> Response:
        arrival = time.time()
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        if not self.has_chat_template or self.tokenizer is None:
            raise RequestError(
                "this model has no chat template: start the server with --chat-template "
                "(a Jinja template or a file holding one), or use /v1/completions",
                param="messages",
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        given = {"max_tokens", "max_completion_tokens"} & body.model_fields_set
        limit_name = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
        max_tokens = getattr(body, limit_name)
        k = (body.top_logprobs or 0) if body.logprobs else None
        rename = {"prompt": "messages", "max_tokens": limit_name, "logprobs": "top_logprobs"}
        params = sampling_params(body, max_tokens=max_tokens, logprobs=k, rename=rename)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = chat_prompt(self.tokenizer, body, self.settings.chat_template)
        fmt = ChatFormatter(
            rid,
            body.model,
            int(arrival),
            [rid],
            body.n,
            top_logprobs=k,
            return_token_ids=body.return_token_ids,
        )
        return await self._serve(request, body, [(rid, prompt, params)], fmt, arrival, rename)

    async def _serve(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        reqs: list[tuple[str, object, SamplingParams]],
        fmt: CompletionFormatter | ChatFormatter,
        arrival: float,
        rename: dict[str, str],
    ) -> Response:
        """Admit, submit, and answer (a stream or a whole response)."""
        n = len(reqs)
        if self.loop.draining or not self.loop.alive:
            raise RequestError(self.loop.fatal or "the server is shutting down", status=503)
        if self.held + n > self.settings.max_queue:
            raise RequestError(
                f"the server is full: it holds {self.held} of at most "
                f"{self.settings.max_queue} requests (--max-queue); retry later",
                status=503,
                code="overloaded",
            )
        self.held += n
        ids = [r for r, _, _ in reqs]
        pending = set(ids)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.held -= n
                self.loop.abort([r for r in ids if r in pending])

        try:
            sink = await self.loop.submit(reqs, arrival)
        except PromptError as e:
            release()
            raise RequestError(str(e), param=rename.get("prompt", "prompt")) from None
        except (ValueError, TypeError) as e:
            release()
            message = re.sub(r"^add_request: ", "", str(e))
            raise RequestError(
                message, param=param_of(message, rename), code="invalid_value"
            ) from None
        except EngineUnavailable as e:
            release()
            raise RequestError(str(e), status=503) from None
        except BaseException:
            release()
            raise
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            events = stream_events(sink, pending, fmt, usage)
            return EngineStream(events, on_close=release)
        try:
            outs = await until_disconnect(request, collect(sink, pending, ids))
        finally:
            release()
        if outs is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(fmt.response(outs).model_dump())


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
                response = _error(401, "a valid API key is needed: Authorization: Bearer KEY",
                                  code="invalid_api_key")  # fmt: skip
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
