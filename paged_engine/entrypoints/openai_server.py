"""An OpenAI-compatible HTTP server on one engine (``paged-engine serve``), on FastAPI and
uvicorn (the ``server`` extra).

Routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions``, vLLM's ``POST /tokenize`` and ``/detokenize`` (the tokenizer
alone, never the engine: ``tokenize_routes``), ``POST /v1/embeddings``
(``embedding_routes``), ``GET /health`` (200 while the engine loop
lives, else 503), ``GET /metrics`` (Prometheus). Errors have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``. With an API key every route but
``/health`` needs ``Authorization: Bearer``.

The life of a request: a body over ``max_request_body_bytes`` is a 413 before it is
parsed; it is parsed and validated (pydantic, then the route's own checks and
``SamplingParams``: ``openai_requests``), each a 400 naming the field; a text prompt (or
conversation) over ``max_prompt_chars`` is a 400 before it is tokenized (``limits``); a
request needing more sequences (prompts times ``n``) than ``max_queue`` is a 400, one that
would fit later a 503 (the server is full, or shutting down); its prompts are tokenized
(chat templates rendered) on the ``TokenizePool``'s threads, beside the event loop and the
engine; then ``EngineLoop.submit`` adds them all on the engine thread (a refusal there,
such as a prompt longer than ``max_model_len``, is a 400 and leaves nothing queued). An
unknown ``model`` is a 404. A streamed request answers with server-sent events, one chunk
per new token, then ``data: [DONE]``; the others wait for their final outputs. A client
that goes away (the stream is cancelled, or a non-streamed request sees
``http.disconnect``) has its requests aborted at once, freeing their blocks.

Shutdown (SIGTERM, SIGINT): uvicorn stops accepting connections; the engine loop refuses
new requests and lets the running ones go on for ``shutdown_timeout`` seconds, then
aborts them, so their streams end with an error event and ``[DONE]``; the process exits
with status 0 within ``shutdown_timeout`` plus a bound (``server_runtime``).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.entrypoints.core_client import CoreClient
from paged_engine.entrypoints.dp_client import DPClient
from paged_engine.entrypoints.embedding_routes import EmbeddingRoutes
from paged_engine.entrypoints.engine_loop import EngineLoop
from paged_engine.entrypoints.http_errors import ApiKeyMiddleware, add_error_handlers, refused_field
from paged_engine.entrypoints.limits import admit, prompt_char_limit, read_body
from paged_engine.entrypoints.loop_types import EngineUnavailable
from paged_engine.entrypoints.metrics import ServerMetrics
from paged_engine.entrypoints.openai_requests import (
    PreparedRequest,
    check_model,
    prepare_chat,
    prepare_completion,
)
from paged_engine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from paged_engine.entrypoints.score_routes import register_score
from paged_engine.entrypoints.serving import RequestError, validation_error
from paged_engine.entrypoints.settings import ServerSettings
from paged_engine.entrypoints.streaming import (
    EngineStream,
    collect,
    stream_events,
    until_disconnect,
)
from paged_engine.entrypoints.tokenize_pool import TokenizePool
from paged_engine.entrypoints.tokenize_routes import TokenizeRoutes

STOP_WAIT_S = 1.0
"""How long the application's shutdown waits for the engine thread to end (it is a daemon
thread: a step still running past this does not hold the process)."""


class OpenAIServer:
    """The application around one engine (see the module docstring). The engine is handed
    to the ``EngineLoop`` and touched by its thread alone; ``tokenizer`` encodes prompts
    and renders chat templates on the ``TokenizePool``'s threads (the engine thread only
    decodes with it). ``app`` is the ASGI application."""

    def __init__(
        self,
        engine: LLMEngine | CoreClient | DPClient,
        settings: ServerSettings,
        *,
        tokenizer: Any,
        max_model_len: int,
        model_root: str | None = None,
    ) -> None:
        """``engine``: an engine to step on a thread of this process, or the client of
        engine core processes (``core_client.py``, ``dp_client.py``), which then report
        to the metrics."""
        self.settings = settings
        self.metrics = ServerMetrics()
        self.loop: EngineLoop | CoreClient | DPClient
        if isinstance(engine, CoreClient | DPClient):
            engine.observer = self.metrics
            self.loop = engine
        else:
            self.loop = EngineLoop(
                engine, max_step_failures=settings.max_step_failures, observer=self.metrics
            )
        self.metrics.bind(self.loop)
        self.tokenizer = tokenizer
        self.has_chat_template = settings.chat_template is not None or bool(
            getattr(tokenizer, "chat_template", None)
        )
        self.max_model_len = max_model_len
        self.max_prompt_chars = settings.max_prompt_chars or prompt_char_limit(
            tokenizer, max_model_len
        )
        self.tokenize = TokenizePool(settings.tokenize_threads)
        self.model_root = model_root
        self.created = int(time.time())
        self.queued_sequences = 0
        """Sequences admitted and not yet ended, counted against ``max_queue`` (the event
        loop's thread alone reads and writes it)."""
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
            self.tokenize.close()
            await asyncio.to_thread(self.loop.stop, STOP_WAIT_S)

        app = FastAPI(title="paged_engine", lifespan=lifespan)
        if self.settings.api_key is not None:
            app.add_middleware(ApiKeyMiddleware, api_key=self.settings.api_key)

        add_error_handlers(app, lambda status: self.metrics.rejected.labels(str(status)).inc())

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.loop.alive else 503)

        def card() -> ModelCard:
            return ModelCard(
                id=self.settings.served_model_name,
                created=self.created,
                root=self.model_root,
                max_model_len=self.max_model_len,
            )

        @app.get("/v1/models")
        async def models() -> ModelList:
            return ModelList(data=[card()])

        @app.get("/v1/models/{model_id:path}")  # a served name may hold "/" (org/model)
        async def model(model_id: str) -> ModelCard:
            check_model(model_id, self.settings.served_model_name)
            return card()

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._completions(request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._chat(request)

        s = self.settings
        TokenizeRoutes(
            self.tokenizer, s.served_model_name, self.max_model_len, self.max_prompt_chars,
            s.max_request_body_bytes, s.chat_template, self.has_chat_template, self.tokenize,
        ).register(app)  # fmt: skip
        pooling = EmbeddingRoutes(
            self.loop, self.tokenizer, s.served_model_name, self.max_prompt_chars,
            s.max_request_body_bytes, self.tokenize,
        )  # fmt: skip
        pooling.register(app)
        register_score(pooling, app)  # /score, /v1/score: the same pooling, paired
        return app

    async def _parse(self, request: Request, model: type[Any]) -> Any:
        raw = await read_body(request, self.settings.max_request_body_bytes)
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            raise validation_error(e) from None

    async def _completions(self, request: Request) -> Response:
        arrival = time.time()
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        check_model(body.model, self.settings.served_model_name)
        work = prepare_completion(
            body,
            tokenizer=self.tokenizer,
            max_prompt_chars=self.max_prompt_chars,
            created=int(arrival),
        )
        return await self._serve(request, work, arrival)

    async def _chat(self, request: Request) -> Response:
        arrival = time.time()
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        check_model(body.model, self.settings.served_model_name)
        work = prepare_chat(
            body,
            tokenizer=self.tokenizer,
            chat_template=self.settings.chat_template,
            has_chat_template=self.has_chat_template,
            max_prompt_chars=self.max_prompt_chars,
            created=int(arrival),
            tool_call_parser=self.settings.tool_call_parser,
        )
        return await self._serve(request, work, arrival)

    async def _serve(self, request: Request, work: PreparedRequest, arrival: float) -> Response:
        """Admit, tokenize (``work.prepare``, on the pool), submit, and answer (a stream or
        a whole response); the same for both routes. Whatever raises or ends the request,
        ``release`` gives its room in ``max_queue`` back and aborts what is still queued."""
        ids, rename = work.ids, work.rename
        loop = self.loop
        unavailable = (
            None
            if loop.alive and not loop.draining
            else loop.fatal or "the server is shutting down"
        )
        sequences = admit(
            len(ids),
            work.params.n,
            self.settings.max_queue,
            self.queued_sequences,
            rename,
            unavailable,
        )
        self.queued_sequences += sequences
        pending = set(ids)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.queued_sequences -= sequences
                self.loop.abort([r for r in ids if r in pending])

        try:
            prompts = await self.tokenize.prepared(work.prepare, rename.get("prompt", "prompt"))
            sink = await self.loop.submit(
                list(zip(ids, prompts, [work.params] * len(ids), strict=True)), arrival
            )
        except (ValueError, TypeError) as e:
            release()
            message = re.sub(r"^add_request: ", "", str(e))
            raise RequestError(
                message, param=refused_field(e, rename), code="invalid_value"
            ) from None
        except EngineUnavailable as e:
            release()
            raise RequestError(str(e), status=503) from None
        except BaseException:
            release()
            raise
        if work.body.stream:
            options = work.body.stream_options
            usage = options is not None and options.include_usage
            events = stream_events(sink, pending, work.formatter, usage)
            return EngineStream(events, on_close=release)
        try:
            outs = await until_disconnect(request, collect(sink, pending, ids))
        finally:
            release()
        if outs is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(work.formatter.response(outs).model_dump())
