"""Attention over the paged KV cache: the layer, the batch layout, the backends.

``base`` holds what everything shares (``AttentionMetadata``, the ``AttentionBackend``
protocol, the metadata builder) and imports no backend; each backend has its module
(``torch_backend``, ``cpu``, ``triton_backend``, ``flash``; ``kernel_base`` is the store and
per-step checks the last two share); ``requirements`` says why each cannot run here and
``selection`` picks one ("auto": flash-attn, Triton, torch on CUDA; the CPU kernel, torch on
the CPU). ``dense`` is the oracle and the attention over a step's own rows, ``layer`` the
model's ``Attention`` module. Triton and flash-attn are imported only when their backend is
built.
"""

from paged_engine.layers.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    HostMetadata,
    make_attention_metadata,
)
from paged_engine.layers.attention.dense import attend_uncached, naive_attention
from paged_engine.layers.attention.layer import Attention
from paged_engine.layers.attention.selection import (
    FALLBACK_ORDER,
    backend_problems,
    choose_backend,
    get_attention_backend,
)
from paged_engine.layers.attention.staging import HostStaging
from paged_engine.layers.attention.torch_backend import (
    SHARED_PREFIX_MIN_TOKENS,
    TorchAttentionBackend,
)

__all__ = [
    "FALLBACK_ORDER",
    "SHARED_PREFIX_MIN_TOKENS",
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "HostMetadata",
    "HostStaging",
    "TorchAttentionBackend",
    "attend_uncached",
    "backend_problems",
    "choose_backend",
    "get_attention_backend",
    "make_attention_metadata",
    "naive_attention",
]
