"""paged_engine: an LLM inference engine around a paged KV cache with prefix caching.

Importing this package (or ``paged_engine.engine``) never imports torch: the allocator and
scheduler are usable on their own. ``LLM`` is resolved lazily on first access.
"""

from typing import TYPE_CHECKING, Any

from paged_engine.config import EngineConfig
from paged_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_engine.llm import LLM

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from paged_engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'paged_engine' has no attribute {name!r}")
