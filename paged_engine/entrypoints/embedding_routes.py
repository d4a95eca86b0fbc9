"""vLLM's ``POST /v1/embeddings`` (OpenAI's shape): each input's pooled, normalised last
hidden state (``paged_engine/pooling.py``, ``LLM.embed``'s vectors).

Why through ``EngineLoop.call``: the engine is not thread-safe, so each input is pooled on
the engine loop's thread between two steps, one input per call, so that the requests
being generated go on stepping between the inputs of a large batch. Every input is checked
(one call) before any is pooled: a bad one is a 400 naming it, and nothing ran. An input
whose KV blocks are not free at that moment (running requests hold the pool) is a 503.

With ``--engine-core process`` (and data parallelism) the engine lives in another process:
a function does not cross the pipe, so the route asks the core by name (``core_calls``:
``check_inputs``, then ``pool`` per input, each run on the core's loop thread between two
steps, the vector sent back as float32 bytes); with several replicas each call goes to the
least loaded one (``DPClient.call_core``). The same checks, answers and errors in every
mode; a core that dies while an input is being pooled fails the request with a 503.

The checks before the engine, as the completion routes make them: the body size, the
fields (a 400 naming one; ``dimensions`` is refused, as vLLM refuses it for a model that
was not trained for shortened embeddings), an unknown ``model`` (404), a text over
``max_prompt_chars`` (400, before tokenizing); texts are tokenized on the
``TokenizePool``'s threads (special tokens added, as ``LLM.embed`` and vLLM do).
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from paged_engine.entrypoints.core_calls import check_inputs
from paged_engine.entrypoints.engine_loop import EngineLoop
from paged_engine.entrypoints.limits import prompt_too_long, read_body
from paged_engine.entrypoints.loop_types import EngineUnavailable
from paged_engine.entrypoints.openai_requests import check_model
from paged_engine.entrypoints.serving import RequestError, validation_error
from paged_engine.entrypoints.tokenize_pool import TokenizePool
from paged_engine.pooling import PoolBusy, PoolingParams, pool_now

if TYPE_CHECKING:
    from paged_engine.entrypoints.core_client import CoreClient
    from paged_engine.entrypoints.dp_client import DPClient


class EmbeddingRequest(BaseModel):
    """OpenAI's (and vLLM's) embedding body; ``user`` is accepted and ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """The floats, or with ``encoding_format: "base64"`` their little-endian float32
    bytes in base64 (what OpenAI's client decodes)."""


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def request_inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    """The body's inputs, one per embedding: a text, texts, one list of token ids, or
    lists of them; an empty list (or an empty one inside) is a 400 naming ``input``."""
    raw = body.input
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise RequestError("input: at least one input is needed", param="input")
    ints = [t for t in raw if isinstance(t, int)]
    if len(ints) == len(raw):
        return [ints]
    inputs = [x for x in raw if not isinstance(x, int)]
    empty = next((i for i, x in enumerate(inputs) if isinstance(x, list) and not x), None)
    if empty is not None:
        raise RequestError(f"input {empty}: the list of token ids is empty", param="input")
    return inputs


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A pooled vector (float32, as every mode returns it) as the response carries it."""
    if encoding_format == "base64":
        raw = np.asarray(vector, dtype="<f4").tobytes()
        return base64.b64encode(raw).decode("ascii")
    return list(vector.tolist())


@dataclass
class EmbeddingRoutes:
    """What the route needs of the server: its engine loop (or its client of engine core
    processes), tokenizer, model name, limits and ``TokenizePool``."""

    loop: EngineLoop | CoreClient | DPClient
    tokenizer: Any
    served_model_name: str
    max_prompt_chars: int
    max_request_body_bytes: int
    pool: TokenizePool

    def register(self, app: FastAPI) -> None:
        @app.post("/v1/embeddings")
        async def embeddings(request: Request) -> Response:
            return await self.embeddings(request)

    async def embeddings(self, request: Request) -> Response:
        raw = await read_body(request, self.max_request_body_bytes)
        try:
            body = EmbeddingRequest.model_validate_json(raw)
        except ValidationError as e:
            raise validation_error(e) from None
        if body.model is not None:
            check_model(body.model, self.served_model_name)
        if body.dimensions is not None:
            raise RequestError(
                "dimensions is not supported: this model's embeddings are not trained to "
                "be shortened (matryoshka); leave it out for the full vector",
                param="dimensions",
            )
        inputs = request_inputs(body)
        ids = await self.tokenized(inputs)
        vectors = await self.embed_ids(ids, param="input")
        data = [
            EmbeddingData(index=i, embedding=encoded(v, body.encoding_format))
            for i, v in enumerate(vectors)
        ]
        tokens = sum(map(len, ids))
        response = EmbeddingResponse(
            id=f"embd-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.served_model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )
        return JSONResponse(response.model_dump())

    async def embed_ids(self, ids: list[list[int]], *, param: str) -> list[np.ndarray]:
        """Each prompt's embedding (last token, normalised), the engine's refusals as the
        HTTP errors a route answers: 503 while the engine is down or the pool is busy,
        400 naming ``param`` for an input the engine refuses."""
        try:
            return await self._pooled(ids, PoolingParams())
        except EngineUnavailable as e:
            raise RequestError(str(e), status=503) from None
        except PoolBusy as e:
            raise RequestError(f"{e}: try again shortly", status=503) from None
        except (ValueError, TypeError) as e:
            raise RequestError(str(e), param=param, code="invalid_value") from None

    async def _pooled(self, ids: list[list[int]], params: PoolingParams) -> list[np.ndarray]:
        """Every input checked (one call), then each pooled (one call each), in this
        process's engine thread or, by name, in an engine core's (``core_calls``)."""
        loop = self.loop
        if isinstance(loop, EngineLoop):
            await loop.call(_checking_job(ids))
            tensors = [await loop.call(_pooling_job(one, params)) for one in ids]
            return [t.float().numpy() for t in tensors]
        await loop.call_core("check_inputs", ids)
        fields = (params.normalize, params.pooling_type)
        raw = [await loop.call_core("pool", one, *fields) for one in ids]
        return [np.frombuffer(r, dtype="<f4") for r in raw]

    async def tokenized(self, inputs: list[str | list[int]]) -> list[list[int]]:
        """Each input's token ids: texts checked for length, then encoded on the pool."""
        for i, x in enumerate(inputs):
            if isinstance(x, str) and len(x) > self.max_prompt_chars:
                what = "the input" if len(inputs) == 1 else f"input {i}"
                raise prompt_too_long(what, len(x), self.max_prompt_chars, "input")
        texts = [x for x in inputs if isinstance(x, str)]
        if texts and self.tokenizer is None:
            raise RequestError(
                "this model has no tokenizer (its directory holds none): send token ids",
                param="input",
            )
        tokenizer = self.tokenizer

        def encode() -> list[list[int]]:
            return [list(tokenizer.encode(x)) if isinstance(x, str) else x for x in inputs]

        try:
            return await self.pool.run(encode)
        except Exception as exc:
            raise RequestError(f"the input could not be tokenized: {exc}", param="input") from exc


def _checking_job(ids: list[list[int]]) -> Any:
    return lambda engine: check_inputs(engine, ids)


def _pooling_job(ids: list[int], params: PoolingParams) -> Any:
    return lambda engine: pool_now(engine, ids, params)
