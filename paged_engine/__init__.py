"""paged_engine: an LLM inference engine around a paged KV cache with prefix caching.

vLLM's offline names are importable from here: ``LLM``, ``LLMEngine``, ``EngineArgs``,
``SamplingParams``, ``RequestOutputKind``, ``RequestOutput``, ``CompletionOutput``,
``TextPrompt``, ``TokensPrompt``, ``BeamSearchParams``, ``PoolingParams``,
``StructuredOutputsParams`` (and its older name ``GuidedDecodingParams``).

Importing this package (or ``paged_engine.engine``) never imports torch: the allocator and
scheduler are usable on their own. ``LLM`` and ``LLMEngine`` (which load models, so need
torch) and the engine's records are resolved lazily on first access (``_LAZY``).

Importing it sets ``OMP_WAIT_POLICY=PASSIVE`` in ``os.environ`` (unless the variable is
set, or an OpenMP runtime, e.g. torch's, is already loaded): OpenMP reads the variable once,
when torch loads it, and its default spin-waiting makes more than one thread many times
slower on a machine shared with other work (see ``EngineConfig.num_threads``). Child
processes inherit the variable.
"""

from typing import TYPE_CHECKING, Any

from paged_engine.config import EngineConfig, prepare_openmp
from paged_engine.engine_args import EngineArgs
from paged_engine.sampling_params import RequestOutputKind, SamplingParams

prepare_openmp()  # before anything imports torch: none of the modules above does

if TYPE_CHECKING:
    from paged_engine.beam_search import BeamSearchParams
    from paged_engine.engine.inputs import TextPrompt, TokensPrompt
    from paged_engine.engine.request import CompletionOutput, RequestOutput
    from paged_engine.llm import LLM
    from paged_engine.llm_engine import LLMEngine
    from paged_engine.pooling import PoolingParams
    from paged_engine.structured_outputs import GuidedDecodingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "GuidedDecodingParams",
    "LLMEngine",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "paged_engine.llm",
    "BeamSearchParams": "paged_engine.beam_search",
    "PoolingParams": "paged_engine.pooling",
    "LLMEngine": "paged_engine.llm_engine",
    "CompletionOutput": "paged_engine.engine.request",
    "RequestOutput": "paged_engine.engine.request",
    "TextPrompt": "paged_engine.engine.inputs",
    "TokensPrompt": "paged_engine.engine.inputs",
    "StructuredOutputsParams": "paged_engine.structured_outputs",
    "GuidedDecodingParams": "paged_engine.structured_outputs",
}
"""Names imported on first access: ``LLM``'s and ``LLMEngine``'s modules import torch, and
the engine's records bring the engine's modules (tens of milliseconds) with them."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paged_engine' has no attribute {name!r}")
