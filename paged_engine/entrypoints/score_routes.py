"""vLLM's ``POST /score`` and ``POST /v1/score``: each pair's score, as ``LLM.score``
gives it (``paged_engine/score.py``: the cosine similarity of the two texts' pooled,
normalised embeddings; vLLM's pairing: 1:1, 1:N or N:N).

The pair may be named as in any of vLLM's request forms: ``queries`` / ``documents``,
``queries`` / ``items``, ``data_1`` / ``data_2`` or ``text_1`` / ``text_2``, each side a
text or a list of texts; exactly one form per request (400 naming the fields otherwise).
Texts are tokenized and pooled as ``/v1/embeddings`` pools them (``EmbeddingRoutes``: the
same checks, limits and engine calls), so a bad input is a 400 naming it and nothing
is pooled.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from paged_engine.entrypoints.openai_requests import check_model
from paged_engine.entrypoints.serving import RequestError, validation_error
from paged_engine.score import pairing

if TYPE_CHECKING:
    from paged_engine.entrypoints.embedding_routes import EmbeddingRoutes

Side = str | list[str]
PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
"""vLLM's names for a request's two sides, in the order they are looked for."""


class ScoreRequest(BaseModel):
    """Any of vLLM's score request forms (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    user: str | None = None
    queries: Side | None = None
    documents: Side | None = None
    items: Side | None = None
    data_1: Side | None = None
    data_2: Side | None = None
    text_1: Side | None = None
    text_2: Side | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


def score_sides(body: ScoreRequest) -> tuple[list[str], list[str]]:
    """The request's two sides as lists, checked against vLLM's pairing; a 400 naming the
    fields when no form, or more than one, is given."""
    given = [
        k for k, v in body.model_dump().items() if v is not None and k not in ("model", "user")
    ]
    forms = [p for p in PAIRS if p[0] in given and p[1] in given]
    if len(forms) != 1 or set(given) != set(forms[0]):
        names = " / ".join(f"{a}+{b}" for a, b in PAIRS)
        raise RequestError(f"give one pair of {names}; got {sorted(given)}", param="queries")
    first, second = (getattr(body, name) for name in forms[0])
    left = [first] if isinstance(first, str) else list(first)
    right = [second] if isinstance(second, str) else list(second)
    try:
        pairing(len(left), len(right))
    except ValueError as e:
        raise RequestError(str(e), param=forms[0][0]) from None
    return left, right


def register_score(routes: EmbeddingRoutes, app: FastAPI) -> None:
    """Add ``/score`` and ``/v1/score`` to ``app``, pooling through ``routes``."""

    async def create_score(request: Request) -> Response:
        raw = await routes_body(routes, request)
        left, right = score_sides(raw)
        ids = await routes.tokenized([*left, *right])
        vectors = await routes.embed_ids(ids, param="queries")
        a, b = vectors[: len(left)], vectors[len(left) :]
        if len(a) == 1:
            a = a * len(b)
        scores = [cosine(x, y) for x, y in zip(a, b, strict=True)]
        tokens = sum(map(len, ids))
        response = ScoreResponse(
            id=f"score-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=routes.served_model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens),
        )
        return JSONResponse(response.model_dump())

    app.post("/score")(create_score)
    app.post("/v1/score")(create_score)


async def routes_body(routes: EmbeddingRoutes, request: Request) -> ScoreRequest:
    from paged_engine.entrypoints.limits import read_body

    raw = await read_body(request, routes.max_request_body_bytes)
    try:
        body = ScoreRequest.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None
    if body.model is not None:
        check_model(body.model, routes.served_model_name)
    return body


def cosine(x: np.ndarray, y: np.ndarray) -> float:
    """The cosine similarity of two vectors (0 where either is all zeros)."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    norm = float(np.linalg.norm(x64) * np.linalg.norm(y64))
    return float(x64 @ y64 / norm) if norm > 0 else 0.0


__all__ = ["PAIRS", "ScoreRequest", "ScoreResponse", "cosine", "register_score", "score_sides"]
