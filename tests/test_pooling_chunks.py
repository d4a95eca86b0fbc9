"""Pooling in chunks: a prompt longer than ``max_num_batched_tokens`` is pooled through
forwards of at most that many tokens (never one unprofiled forward over the whole prompt),
each continuing from the K/V the earlier ones left in the blocks, and the vectors still
equal transformers' own ``last_hidden_state`` pooled the same way; the blocks go back.
Three wrong chunkings (``tests/pooling_mutants.py``) fail the same check."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine import LLM, PoolingParams
from paged_engine.worker import pooling_forward
from tests.pooling_mutants import MUTANTS

BUDGET = 5
PROMPTS = [list(range(3, 26)), [5, 6, 7, 8, 9], list(range(40, 50)), [17]]
"""23 tokens (five forwards, the last of 3), exactly one, exactly two, a single token."""
CASES = [
    PoolingParams(),
    PoolingParams(pooling_type="MEAN"),
    PoolingParams(normalize=False),
    PoolingParams(normalize=False, pooling_type="MEAN"),
]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[Any]:
    engine = LLM(
        tiny_model_dir,
        block_size=4,
        num_threads=1,
        max_model_len=64,
        max_num_batched_tokens=BUDGET,
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_hidden(tiny_model_dir: Path) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


@pytest.fixture
def forwards(llm: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of tokens of every model forward the runner makes."""
    runner = llm.llm_engine.model_runner
    real: Callable[..., torch.Tensor] = runner._model_forward
    sizes: list[int] = []

    def spy(input_ids: torch.Tensor, *rest: Any) -> torch.Tensor:
        sizes.append(int(input_ids.numel()))
        return real(input_ids, *rest)

    monkeypatch.setattr(runner, "_model_forward", spy)
    return sizes


def expected(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    v = hidden[-1] if params.pooling_type == "LAST" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(v, dim=0) if params.normalize else v


def check_all_cases(llm: Any, hf_hidden: list[torch.Tensor]) -> None:
    for params in CASES:
        outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], params)
        for out, hidden in zip(outs, hf_hidden, strict=True):
            torch.testing.assert_close(
                out.outputs.data, expected(hidden, params), rtol=1e-4, atol=1e-5
            )


def test_chunked_pooling_equals_transformers(
    llm: Any, hf_hidden: list[torch.Tensor], forwards: list[int]
) -> None:
    free = llm.llm_engine.block_manager.num_free_blocks
    check_all_cases(llm, hf_hidden)
    assert llm.llm_engine.block_manager.num_free_blocks == free
    assert max(forwards) <= BUDGET
    per_prompt = [5, 5, 5, 5, 3, 5, 5, 5, 1]  # each prompt's chunks, in order
    assert forwards == per_prompt * len(CASES)


def test_chunked_embed_equals_one_forward(
    llm: Any, tiny_model_dir: Path, forwards: list[int]
) -> None:
    """The same vectors as an engine whose budget holds the prompt in one forward."""
    chunked = llm.embed(PROMPTS[0], PoolingParams(pooling_type="MEAN"))[0].outputs.embedding
    assert len(forwards) == 5
    with LLM(tiny_model_dir, block_size=4, num_threads=1, max_model_len=64) as whole:
        one = whole.embed(PROMPTS[0], PoolingParams(pooling_type="MEAN"))[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(chunked), torch.tensor(one), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_wrong_chunking_is_caught(
    llm: Any, hf_hidden: list[torch.Tensor], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pooling_forward, "chunked_hidden_states", MUTANTS[name])
    with pytest.raises(AssertionError):
        check_all_cases(llm, hf_hidden)


def test_a_budget_below_one_is_refused(llm: Any) -> None:
    with pytest.raises(ValueError, match="budget must be >= 1, got 0"):
        pooling_forward.chunked_hidden_states(llm.llm_engine.model_runner, None, 0)  # type: ignore[arg-type]


@pytest.mark.slow
def test_two_ranks_pool_in_chunks(tiny_model_dir: Path, hf_hidden: list[torch.Tensor]) -> None:
    """Each chunk is a step the other rank runs beside this one's forward."""
    with LLM(
        tiny_model_dir,
        block_size=4,
        num_threads=1,
        max_model_len=64,
        max_num_batched_tokens=BUDGET,
        tensor_parallel_size=2,
    ) as tp:
        params = PoolingParams(pooling_type="MEAN")
        outs = tp.encode([{"prompt_token_ids": p} for p in PROMPTS], params)
    for out, hidden in zip(outs, hf_hidden, strict=True):
        torch.testing.assert_close(out.outputs.data, expected(hidden, params), rtol=1e-4, atol=1e-5)
