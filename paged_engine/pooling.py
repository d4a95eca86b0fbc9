"""Pooling: ``LLM.embed`` and ``LLM.encode`` (vLLM's names), a prompt's final hidden
states pooled into one vector.

Why through the engine's own pool and runner, not a second model: the weights, the
attention backends and tensor parallelism are the ones ``generate`` uses, so an embedding
is the model's own last hidden state (after the final norm, as transformers'
``last_hidden_state``). Each prompt runs as one prefill over blocks taken from the
allocator and given back afterwards. Every prompt position must be computed (mean pooling
reads them all), so the blocks come fresh: the sequence gets a cache salt no other has
(R4s), as prompt logprobs do, and its blocks are never registered in the prefix cache
(nothing calls ``hash_blocks``). The engine must be idle, as for ``generate``.

Pooling types: ``LAST`` (the last prompt token's state, vLLM's default for decoder-only
models) and ``MEAN`` (over the prompt's positions); ``normalize`` (the default) scales the
vector to unit length. vLLM sets the type per model (its pooler config); here it is a
field of ``PoolingParams``.

The prefill runs in chunks of at most ``max_num_batched_tokens`` tokens, each a forward
that starts where the last one stopped (its K/V already in the blocks), as chunked
prefill runs: one forward is never larger than the steps the engine sized its memory for.
The server pools between two steps of the engine loop (``pool_now``, on its thread), with
requests running: a prompt whose blocks are not free at that moment is ``PoolBusy``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_engine.engine.inputs import is_single_prompt, parse_prompt
from paged_engine.engine.sequence import Sequence
from paged_engine.errors import InvalidRequestError
from paged_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from paged_engine.llm_engine import LLMEngine

POOLING_TYPES = ("LAST", "MEAN")
_salts = itertools.count()


@dataclass(slots=True)
class PoolingParams:
    """``normalize``: unit length (vLLM's field); ``pooling_type``: "LAST" or "MEAN"."""

    normalize: bool = True
    pooling_type: str = "LAST"

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(
                "normalize", f"normalize must be a bool, got {self.normalize!r}"
            )
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                "pooling_type",
                f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}",
            )


@dataclass(frozen=True, slots=True)
class PoolingOutput:
    data: torch.Tensor


@dataclass(frozen=True, slots=True)
class PoolingRequestOutput:
    """``LLM.encode``'s result for one prompt (vLLM's fields)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(frozen=True, slots=True)
class EmbeddingRequestOutput:
    """``LLM.embed``'s result for one prompt (vLLM's fields)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


class PoolBusy(RuntimeError):
    """``pool_now`` refused: the prompt's blocks are not free now (running requests hold
    them); nothing changed, and a later try may fit."""


def encode(engine: LLMEngine, prompts: object, params: object) -> list[PoolingRequestOutput]:
    """Pool each prompt (one or a list; ``params`` one ``PoolingParams``, None, or one per
    prompt). Every prompt is checked before any runs."""
    if engine.has_unfinished_requests():
        raise RuntimeError("embed/encode need an idle engine: requests are unfinished")
    batch = [prompts] if is_single_prompt(prompts) else prompts
    if not isinstance(batch, list | tuple) or not batch:
        raise TypeError(f"prompts must be a prompt or a non-empty list of them, got {prompts!r}")
    per = params if isinstance(params, list | tuple) else [params] * len(batch)
    if len(per) != len(batch):
        raise ValueError(f"{len(per)} pooling params for {len(batch)} prompts")
    work = []
    for i, (prompt, p) in enumerate(zip(batch, per, strict=True)):
        where = f"prompt {i}"
        p = PoolingParams() if p is None else p
        if not isinstance(p, PoolingParams):
            raise TypeError(f"{where}: pooling params must be PoolingParams, got {p!r}")
        work.append((checked_ids(engine, prompt, where), p))
    return [
        PoolingRequestOutput(f"embed-{i}", PoolingOutput(_pooled(engine, ids, p)), ids)
        for i, (ids, p) in enumerate(work)
    ]


def checked_ids(engine: LLMEngine, prompt: object, where: str) -> list[int]:
    """The prompt's token ids, refused (``InvalidRequestError`` naming ``where``) when
    empty, outside the vocabulary, over ``max_model_len`` or larger than the KV pool."""
    ids = list(parse_prompt(prompt, engine.tokenizer, engine.vocab_size, where).token_ids)
    if len(ids) > engine.config.max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"{len(ids)} prompt tokens, over max_model_len={engine.config.max_model_len}",
            where,
        )
    if _blocks(engine, ids) > engine.num_blocks:
        raise InvalidRequestError("prompt", "the prompt does not fit the KV pool", where)
    return ids


def pool_now(engine: LLMEngine, ids: list[int], params: PoolingParams) -> torch.Tensor:
    """``ids`` (from ``checked_ids``) pooled now, between two steps of an engine that may
    have requests running (the server's engine thread); ``PoolBusy`` when their blocks
    are not free at this moment."""
    needed = _blocks(engine, ids)
    free = engine.block_manager.num_free_blocks
    if needed > free:
        raise PoolBusy(f"the prompt needs {needed} KV blocks and {free} are free now")
    return _pooled(engine, ids, params)


def _blocks(engine: LLMEngine, ids: list[int]) -> int:
    return -(-len(ids) // engine.config.kvcache_block_size)


def _pooled(engine: LLMEngine, ids: list[int], params: PoolingParams) -> torch.Tensor:
    import torch

    from paged_engine.worker.pooling_forward import chunked_hidden_states

    bs = engine.config.kvcache_block_size
    budget = engine.config.max_num_batched_tokens or len(ids)
    salt = f"\x00embed\x00{next(_salts)}"  # fresh blocks: nothing hits, nothing registers
    seq = Sequence.from_checked_tokens(ids, SamplingParams(), block_size=bs, cache_salt=salt)
    allocator = engine.block_manager
    allocator.allocate(seq, 0)
    try:
        last, total = chunked_hidden_states(engine.model_runner, seq, budget)
    finally:
        allocator.deallocate(seq)
    vector = last if params.pooling_type == "LAST" else total / len(ids)
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.cpu()


def embed(engine: LLMEngine, prompts: object, params: object) -> list[EmbeddingRequestOutput]:
    """``encode``'s vectors as lists of floats (vLLM's ``EmbeddingRequestOutput``)."""
    return [
        EmbeddingRequestOutput(
            o.request_id, EmbeddingOutput(o.outputs.data.tolist()), o.prompt_token_ids
        )
        for o in encode(engine, prompts, params)
    ]
