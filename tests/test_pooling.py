"""``LLM.embed`` / ``LLM.encode``: the pooled vectors equal transformers' own
``last_hidden_state`` pooled the same way (last token, mean; normalised or not), over one
process and two tensor-parallel ranks; the blocks go back to the pool and nothing enters
the prefix cache; bad input is refused by name with nothing changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine import LLM, PoolingParams, SamplingParams
from paged_engine.errors import InvalidRequestError

PROMPTS = [[11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 7], [5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Any:
    engine = LLM(tiny_model_dir, block_size=4, num_threads=1, max_model_len=64)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_hidden(tiny_model_dir: Path) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


def expected(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    v = hidden[-1] if params.pooling_type == "LAST" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(v, dim=0) if params.normalize else v


CASES = [
    PoolingParams(),
    PoolingParams(pooling_type="MEAN"),
    PoolingParams(normalize=False),
    PoolingParams(normalize=False, pooling_type="MEAN"),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"{p.pooling_type}-{p.normalize}")
def test_pooled_vectors_equal_transformers(
    llm: Any, hf_hidden: list[torch.Tensor], params: PoolingParams
) -> None:
    outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], params)
    for out, hidden, prompt in zip(outs, hf_hidden, PROMPTS, strict=True):
        assert out.prompt_token_ids == prompt
        torch.testing.assert_close(out.outputs.data, expected(hidden, params), rtol=1e-4, atol=1e-5)
    embedded = llm.embed(PROMPTS[0], params)
    assert embedded[0].outputs.embedding == outs[0].outputs.data.tolist()


def test_embedding_leaves_the_pool_and_the_prefix_cache_as_they_were(llm: Any) -> None:
    """A prompt whose blocks are cached still computes every position (fresh blocks);
    the embedding registers nothing and takes nothing away."""
    engine = llm.llm_engine
    one = SamplingParams(max_tokens=1)
    assert llm.reset_prefix_cache()
    llm.generate([PROMPTS[1]], one, use_tqdm=False)  # its first block is now cached
    free = engine.block_manager.num_free_blocks
    llm.embed(PROMPTS)
    assert engine.block_manager.num_free_blocks == free
    llm.generate([PROMPTS[0]], one, use_tqdm=False)
    assert llm.last_run_stats.cached_prompt_tokens == 0  # the embedding registered nothing
    llm.generate([PROMPTS[1]], one, use_tqdm=False)
    assert llm.last_run_stats.cached_prompt_tokens == 4  # the earlier registration stands


@pytest.mark.slow
def test_two_ranks_pool_as_one(tiny_model_dir: Path, hf_hidden: list[torch.Tensor]) -> None:
    with LLM(tiny_model_dir, block_size=4, num_threads=1, tensor_parallel_size=2) as tp:
        outs = tp.encode(
            [{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(pooling_type="MEAN")
        )
    for out, hidden in zip(outs, hf_hidden, strict=True):
        torch.testing.assert_close(
            out.outputs.data,
            expected(hidden, PoolingParams(pooling_type="MEAN")),
            rtol=1e-4,
            atol=1e-5,
        )


def test_bad_input_is_refused_by_name_and_changes_nothing(llm: Any) -> None:
    with pytest.raises(InvalidRequestError, match="pooling_type") as err:
        PoolingParams(pooling_type="CLS")
    assert err.value.field == "pooling_type"
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks
    with pytest.raises(InvalidRequestError, match="prompt 1: 65 prompt tokens") as bad:
        llm.embed([PROMPTS[0], list(range(3, 68))])
    assert bad.value.field == "prompt"
    assert engine.block_manager.num_free_blocks == free
    with pytest.raises(TypeError, match="PoolingParams"):
        llm.embed(PROMPTS[0], SamplingParams())
