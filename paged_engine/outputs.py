"""vLLM's ``vllm.outputs``: the output records, importable where vLLM scripts look for
them (``from vllm.outputs import RequestOutput``). Each is defined where it is made."""

from __future__ import annotations

from paged_engine.engine.request import CompletionOutput, RequestOutput
from paged_engine.pooling import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
)
from paged_engine.score import ScoringOutput, ScoringRequestOutput

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "RequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
