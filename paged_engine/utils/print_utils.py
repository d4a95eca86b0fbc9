"""``print_embeddings`` (vLLM's ``vllm.utils.print_utils``), which its pooling examples
call: the first values of an embedding and its length, on one line."""

from __future__ import annotations

from collections.abc import Sequence


def print_embeddings(embeds: Sequence[float], prefix: str = "Embeddings") -> None:
    """Print ``prefix: [v0, ..., v15, ...] (size=N)``; refuses a non-sequence by name."""
    if isinstance(embeds, str | bytes) or not hasattr(embeds, "__len__"):
        raise TypeError(f"embeds must be a sequence of floats, got {type(embeds).__name__}")
    values = list(embeds)
    head = ", ".join(f"{float(v):.4f}" for v in values[:16])
    more = ", ..." if len(values) > 16 else ""
    print(f"{prefix}: [{head}{more}] (size={len(values)})")


__all__ = ["print_embeddings"]
