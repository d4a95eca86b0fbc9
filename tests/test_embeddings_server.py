"""``POST /v1/embeddings`` on a live in-process server, through OpenAI's own client: each
input's vector (float or base64) equals transformers' ``last_hidden_state`` at the last
position, normalised, computed here; texts, one list of token ids, or lists of them; the
usage counts the prompts' tokens. Pooling runs on the engine loop's thread alone, also
while a completion is being generated. Bad input is a 400 (404 for another model) in
OpenAI's error shape, naming the field, before anything is pooled. A route that pools the
wrong rows fails the same check. The engine core in its own process, and data
parallelism: ``tests/test_embeddings_process.py``."""

from __future__ import annotations

import base64
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from paged_engine.entrypoints import embedding_routes
from paged_engine.entrypoints.engine_loop import EngineLoop
from paged_engine.pooling import PoolingParams, pool_now
from tests.test_server_support import MODEL, Live, live_server

pytestmark = pytest.mark.timeout(180)
TEXTS = ["The capital of France is Paris.", "Bananas are yellow", "hi", "naïve café 🙂"]


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[Live]:
    with live_server(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path, tok: Any) -> dict[str, torch.Tensor]:
    """Each text's expected embedding, from transformers (the oracle)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return {
            t: torch.nn.functional.normalize(
                model(input_ids=torch.tensor([tok.encode(t)])).last_hidden_state[0, -1], dim=0
            )
            for t in TEXTS
        }


@pytest.fixture
def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def pooled(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each pooling job the route runs, noting whether requests were running then."""
    seen: list[bool] = []

    def spy(engine: Any, ids: list[int], params: PoolingParams) -> torch.Tensor:
        seen.append(engine.has_unfinished_requests())
        return pool_now(engine, ids, params)

    monkeypatch.setattr(embedding_routes, "pool_now", spy)
    return seen


def loop_thread(live: Live) -> int | None:
    loop = live.server.loop
    assert isinstance(loop, EngineLoop)
    return loop.thread_id


def check_vectors(got: list[list[float]], texts: list[str], hf: dict[str, torch.Tensor]) -> None:
    assert len(got) == len(texts)
    for vector, text in zip(got, texts, strict=True):
        torch.testing.assert_close(torch.tensor(vector), hf[text], rtol=1e-4, atol=1e-5)


def test_vectors_equal_transformers_in_both_encodings(
    live: Live, client: openai.OpenAI, hf: dict[str, torch.Tensor], tok: Any, pooled: list[bool]
) -> None:
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert all(d.object == "embedding" for d in floats.data)
    check_vectors([d.embedding for d in floats.data], TEXTS, hf)
    tokens = sum(len(tok.encode(t)) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    b64 = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    assert [list(d.embedding) for d in b64.data] == [d.embedding for d in floats.data]
    raw = httpx.post(
        live.url + "/v1/embeddings",
        json={"input": TEXTS[2], "encoding_format": "base64"},
        timeout=30,
    ).json()["data"][0]["embedding"]
    blob = base64.b64decode(raw)
    assert list(struct.unpack(f"<{len(blob) // 4}f", blob)) == floats.data[2].embedding
    assert len(pooled) == 3 * len(TEXTS) - 3 and not any(pooled)
    assert live.engine.threads == {loop_thread(live)}


def test_token_id_inputs(client: openai.OpenAI, hf: dict[str, torch.Tensor], tok: Any) -> None:
    one = client.embeddings.create(model=MODEL, input=tok.encode(TEXTS[0]))
    check_vectors([d.embedding for d in one.data], TEXTS[:1], hf)
    ids = [tok.encode(t) for t in TEXTS[1:]]
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    check_vectors([d.embedding for d in many.data], TEXTS[1:], hf)
    assert many.usage.prompt_tokens == sum(map(len, ids))
    single = client.embeddings.create(model=MODEL, input=TEXTS[3], encoding_format="float")
    assert single.data[0].embedding == many.data[2].embedding


def test_pooling_between_the_steps_of_a_running_completion(
    live: Live, client: openai.OpenAI, hf: dict[str, torch.Tensor], pooled: list[bool]
) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=TEXTS[0],
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)  # the completion is running now
    results: list[Any] = []

    def embed() -> None:
        for _ in range(3):
            r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
            results.append(r)

    worker = threading.Thread(target=embed)
    worker.start()
    worker.join(60)
    text = first.choices[0].text + "".join(c.choices[0].text for c in chunks)
    assert len(results) == 3
    for r in results:
        check_vectors([d.embedding for d in r.data], TEXTS, hf)
    assert any(pooled), "no embedding ran while the completion was generating"
    assert len(text) > 0
    assert live.engine.threads == {loop_thread(live)}


BAD = [
    ({"input": TEXTS[0], "dimensions": 8}, 400, "dimensions", "not supported"),
    ({"input": []}, 400, "input", "at least one input"),
    ({"input": [[1, 2], []]}, 400, "input", "input 1: the list of token ids is empty"),
    ({"input": [[1, 2], [10**6]]}, 400, "input", "input 1"),
    ({"input": list(range(1, 514))}, 400, "input", "513 prompt tokens, over max_model_len=512"),
    ({"input": [TEXTS[0], 3]}, 400, "input", "input"),
    ({"input": "x" * 10**6}, 400, "input", "the input"),
    ({"input": TEXTS[0], "encoding_format": "bin"}, 400, "encoding_format", "encoding_format"),
    ({"input": TEXTS[0], "extra": 1}, 400, "extra", "extra"),
    ({"input": TEXTS[0], "model": "other"}, 404, "model", "does not exist"),
    ({}, 400, "input", "input"),
]


@pytest.mark.parametrize(("body", "status", "param", "says"), BAD)
def test_bad_input_is_refused_by_name_and_nothing_is_pooled(
    live: Live,
    pooled: list[bool],
    body: dict[str, Any],
    status: int,
    param: str,
    says: str,
) -> None:
    free = live.engine._engine.block_manager.num_free_blocks
    r = httpx.post(live.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and says in error["message"], error
    assert pooled == []
    assert live.engine._engine.block_manager.num_free_blocks == free
    ok = httpx.post(live.url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert ok.status_code == 200 and len(pooled) == 1


def test_a_route_pooling_the_wrong_rows_is_caught(
    client: openai.OpenAI, hf: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    def mean_instead(engine: Any, ids: list[int], params: PoolingParams) -> torch.Tensor:
        return pool_now(engine, ids, PoolingParams(pooling_type="MEAN"))

    monkeypatch.setattr(embedding_routes, "pool_now", mean_instead)
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    with pytest.raises(AssertionError):
        check_vectors([d.embedding for d in r.data], TEXTS, hf)
