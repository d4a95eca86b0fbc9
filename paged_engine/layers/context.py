"""The forward context: how one step's attention metadata reaches every attention layer.

The model's ``forward(input_ids, positions)`` keeps the Hugging Face shape, so the batch
layout (slots, block tables, sequence lengths) cannot travel as an argument through every
decoder layer. It lives here instead, for the duration of one ``with forward_context(...)``
block, and is cleared when the block exits, even on error: a stale layout can never leak
into the next step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged_engine.layers.attention.base import AttentionMetadata

_current: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Make ``meta`` the current step's layout for the duration of the block."""
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already set: forward passes do not nest")
    _current = meta
    try:
        yield meta
    finally:
        _current = None


def get_forward_context() -> AttentionMetadata:
    """The current step's layout; raises outside a ``forward_context`` block."""
    if _current is None:
        raise RuntimeError("attention called outside forward_context(): no batch layout is set")
    return _current
