"""paged_engine: an LLM inference engine around a paged KV cache with prefix caching.

Importing this package (or ``paged_engine.engine``) never imports torch: the allocator and
scheduler are usable on their own. ``LLM`` is resolved lazily on first access.

Importing it sets ``OMP_WAIT_POLICY=PASSIVE`` in ``os.environ`` (unless the variable is
set, or an OpenMP runtime, e.g. torch's, is already loaded): OpenMP reads the variable once,
when torch loads it, and its default spin-waiting makes more than one thread many times
slower on a machine shared with other work (see ``EngineConfig.num_threads``). Child
processes inherit the variable.
"""

from typing import TYPE_CHECKING, Any

from paged_engine.config import EngineConfig, prepare_openmp
from paged_engine.sampling_params import SamplingParams

prepare_openmp()  # before anything imports torch: neither module above does

if TYPE_CHECKING:
    from paged_engine.llm import LLM

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from paged_engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'paged_engine' has no attribute {name!r}")
