"""``LLM.score``: the cosine similarity of two prompts' embeddings, paired 1:1, 1:N or N:N
as vLLM pairs them, equal to the cosine computed here from transformers' own
``last_hidden_state``; a pairing vLLM refuses, or a bad prompt on either side, is refused
by name before anything runs, with the engine as it was. A score that is the dot product
(not the cosine) fails the check, with vectors left unnormalised."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine import LLM, PoolingParams
from paged_engine.errors import InvalidRequestError

TEXTS = ["The capital of France is Paris.", "Paris is in France", "Bananas are yellow", "hi"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[Any]:
    engine = LLM(tiny_model_dir, block_size=4, num_threads=1, max_model_len=64)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> dict[str, dict[str, list[float]]]:
    """Each text's LAST and MEAN hidden state, from transformers (the oracle)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for t in TEXTS:
            h = model(input_ids=torch.tensor([tok.encode(t)])).last_hidden_state[0]
            out[t] = {"LAST": h[-1].tolist(), "MEAN": h.mean(dim=0).tolist()}
    return out


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def check(llm: Any, hf: dict[str, dict[str, list[float]]], params: PoolingParams) -> None:
    kind = params.pooling_type
    pairs = {
        "1:1": (TEXTS[0], TEXTS[1], [(0, 1)]),
        "1:N": (TEXTS[0], TEXTS[1:], [(0, 1), (0, 2), (0, 3)]),
        "[1]:N": ([TEXTS[2]], TEXTS, [(2, 0), (2, 1), (2, 2), (2, 3)]),
        "N:N": (TEXTS[:3], TEXTS[1:], [(0, 1), (1, 2), (2, 3)]),
    }
    for name, (one, two, want) in pairs.items():
        outs = llm.score(one, two, pooling_params=params)
        assert len(outs) == len(want), name
        for out, (i, j) in zip(outs, want, strict=True):
            expect = cosine(hf[TEXTS[i]][kind], hf[TEXTS[j]][kind])
            assert out.outputs.score == pytest.approx(expect, abs=1e-5), (name, i, j)
            assert out.finished


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_scores_are_cosines_of_transformers_states(
    llm: Any, hf: dict[str, dict[str, list[float]]], kind: str
) -> None:
    check(llm, hf, PoolingParams(pooling_type=kind))
    check(llm, hf, PoolingParams(pooling_type=kind, normalize=False))


def test_records_are_vllms(llm: Any) -> None:
    tok = llm.get_tokenizer()
    ids_1, ids_2 = tok.encode(TEXTS[0]), tok.encode(TEXTS[1])
    pad = [tok.pad_token_id] if tok.pad_token_id is not None else []
    (out,) = llm.score(TEXTS[0], {"prompt_token_ids": ids_2})
    assert out.prompt_token_ids == [*ids_1, *pad, *ids_2]
    assert out.request_id == "embed-0_embed-1"
    assert isinstance(out.outputs.score, float)
    with pytest.raises(AttributeError):
        out.outputs.score = 1.0


def test_a_dot_product_score_is_caught(
    llm: Any, hf: dict[str, dict[str, list[float]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def dot(a: torch.Tensor, b: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return (a * b).sum(dim=dim)

    monkeypatch.setattr(torch.nn.functional, "cosine_similarity", dot)
    with pytest.raises(AssertionError):
        check(llm, hf, PoolingParams(normalize=False))


def test_bad_input_is_refused_by_name_and_changes_nothing(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks
    ran: list[int] = []
    real = engine.model_runner._model_forward

    def counted(*args: Any) -> Any:
        ran.append(1)
        return real(*args)

    monkeypatch.setattr(engine.model_runner, "_model_forward", counted)
    with pytest.raises(ValueError, match=r"1:1, 1:N or N:N, got 2:3"):
        llm.score(TEXTS[:2], TEXTS[:3])
    with pytest.raises(ValueError, match="data_2: at least one prompt"):
        llm.score(TEXTS[0], [])
    with pytest.raises(ValueError, match="data_1: at least one prompt"):
        llm.score([], TEXTS[0])
    with pytest.raises(InvalidRequestError, match=r"data_2\[1\]: 65 prompt tokens") as bad:
        llm.score(TEXTS[:2], [TEXTS[0], list(range(3, 68))])
    assert bad.value.field == "prompt"
    with pytest.raises(TypeError, match="PoolingParams"):
        llm.score(TEXTS[0], TEXTS[1], pooling_params="MEAN")
    with pytest.raises(TypeError, match="data_2 must be a prompt or a list"):
        llm.score(TEXTS[0], 7)
    assert ran == [] and engine.block_manager.num_free_blocks == free
    assert not engine.has_unfinished_requests()
    assert len(llm.score(TEXTS[0], TEXTS[1])) == 1 and ran  # it still scores
