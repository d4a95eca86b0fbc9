"""``LLM.score`` for an embedding model, as vLLM scores with one: the cosine similarity of
the two prompts' pooled embeddings (``pooling.py``).

Pairing as vLLM's: ``data_1`` and ``data_2`` are each one prompt or a list of them; one
against one, one against N (the one paired with each), or N against N (pairwise, in
order); any other pair of lengths, or an empty list, is a ValueError naming both lengths.
vLLM embeds the one of a 1:N pairing N times; here it is embedded once (the same vector).
Every prompt is checked before any runs, so a refusal (naming ``data_2[1]``, say) changes
nothing.

Each result is vLLM's ``ScoringRequestOutput``: ``outputs.score``, the pair's
``request_id`` (its two embeddings' ids joined by ``_``), and ``prompt_token_ids`` the
first prompt's ids, the tokenizer's pad id if it has one, then the second's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_engine.engine.inputs import is_single_prompt
from paged_engine.pooling import PoolingParams, checked_ids, encode

if TYPE_CHECKING:
    from paged_engine.llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class ScoringOutput:
    score: float


@dataclass(frozen=True, slots=True)
class ScoringRequestOutput:
    """``LLM.score``'s result for one pair (vLLM's fields)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def _prompts(data: object, name: str) -> list[object]:
    if is_single_prompt(data):
        return [data]
    if not isinstance(data, list | tuple):
        raise TypeError(f"{name} must be a prompt or a list of prompts, got {data!r}")
    return list(data)


def pairing(len_1: int, len_2: int) -> None:
    """vLLM's rule: 1:1, 1:N or N:N, neither side empty (a ValueError naming the sizes)."""
    if len_1 == 0:
        raise ValueError("data_1: at least one prompt must be given")
    if len_2 == 0:
        raise ValueError("data_2: at least one prompt must be given")
    if len_1 > 1 and len_1 != len_2:
        raise ValueError(
            f"input lengths must be either 1:1, 1:N or N:N, got {len_1}:{len_2} (data_1 : data_2)"
        )


def score(
    engine: LLMEngine, data_1: object, data_2: object, params: object = None
) -> list[ScoringRequestOutput]:
    """The cosine similarity of each pair's embeddings (see the module docstring)."""
    import torch

    first, second = _prompts(data_1, "data_1"), _prompts(data_2, "data_2")
    pairing(len(first), len(second))
    if params is not None and not isinstance(params, PoolingParams):
        raise TypeError(f"pooling_params must be PoolingParams or None, got {params!r}")
    ids = [checked_ids(engine, p, f"data_1[{i}]") for i, p in enumerate(first)]
    ids += [checked_ids(engine, p, f"data_2[{i}]") for i, p in enumerate(second)]
    outs = encode(engine, [{"prompt_token_ids": one} for one in ids], params)
    left, right = outs[: len(first)], outs[len(first) :]
    if len(left) == 1:
        left = left * len(right)
    pad = getattr(engine.tokenizer, "pad_token_id", None)
    padding = [pad] if isinstance(pad, int) else []
    results = []
    for a, b in zip(left, right, strict=True):
        cosine = torch.nn.functional.cosine_similarity(a.outputs.data, b.outputs.data, dim=0)
        results.append(
            ScoringRequestOutput(
                f"{a.request_id}_{b.request_id}",
                ScoringOutput(float(cosine)),
                [*a.prompt_token_ids, *padding, *b.prompt_token_ids],
            )
        )
    return results
