"""vLLM's ``POST /score`` and ``/v1/score`` on a live in-process server: each of vLLM's
request forms (queries/documents, queries/items, data_1/data_2, text_1/text_2) with 1:1,
1:N and N:N pairing gives ``LLM.score``'s scores for the same pairs, in vLLM's response
shape; a bad body is a 400 naming the field (404 for another model), and nothing is
pooled for it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from paged_engine import LLM
from paged_engine.entrypoints import embedding_routes
from paged_engine.pooling import PoolingParams, pool_now
from tests.test_server_support import MODEL, Live, live_server

pytestmark = pytest.mark.timeout(180)
Q = ["What is the capital of France?", "Bananas are yellow"]
D = ["The capital of France is Paris.", "hi"]


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[Live]:
    with live_server(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, max_model_len=128, num_gpu_blocks_override=64)


def post(live: Live, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=60)


@pytest.mark.parametrize(
    ("path", "names", "first", "second"),
    [
        ("/score", ("queries", "documents"), Q[0], D[0]),
        ("/v1/score", ("queries", "items"), Q[0], D),
        ("/score", ("data_1", "data_2"), Q, D),
        ("/v1/score", ("text_1", "text_2"), Q[1], D),
    ],
)
def test_scores_equal_llm_score(
    live: Live, llm: LLM, path: str, names: tuple[str, str], first: Any, second: Any
) -> None:
    r = post(live, path, {"model": MODEL, names[0]: first, names[1]: second})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL
    want = [o.outputs.score for o in llm.score(first, second)]
    assert [d["index"] for d in body["data"]] == list(range(len(want)))
    assert all(d["object"] == "score" for d in body["data"])
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-4)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


def test_bad_bodies_are_refused_by_name(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def spy(engine: Any, ids: list[int], params: PoolingParams) -> Any:
        seen.append(len(ids))
        return pool_now(engine, ids, params)

    monkeypatch.setattr(embedding_routes, "pool_now", spy)
    cases = [
        ({"queries": Q[0]}, "give one pair"),
        ({"queries": Q[0], "documents": D, "text_1": "x", "text_2": "y"}, "give one pair"),
        ({"data_1": Q, "data_2": [*D, "z"]}, "data_1"),
        ({"queries": Q[0], "documents": []}, "data_2"),
        ({"queries": 3, "documents": D}, "queries"),
        ({"queries": Q[0], "documents": D, "top_k": 1}, "top_k"),
    ]
    for body, name in cases:
        r = post(live, "/score", body)
        assert r.status_code == 400, (body, r.text)
        assert name in r.text, (body, r.text)
    r = post(live, "/score", {"model": "other", "queries": Q[0], "documents": D})
    assert r.status_code == 404
    assert seen == []  # nothing pooled for any refused body
    ok = post(live, "/score", {"queries": Q[0], "documents": D[0]})
    assert ok.status_code == 200 and seen  # the same server scores a good body after them
