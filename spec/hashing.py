"""R4's chained block hash for the spec, and a pure-Python stand-in for CrossHair."""

from __future__ import annotations

import struct
from collections.abc import Callable

import xxhash

HashFn = Callable[[tuple[int, ...], "int | None"], int]


def xxh64_block_hash(token_ids: tuple[int, ...], prefix: int | None) -> int:
    """R4: xxh64 over the previous hash (8 bytes, little-endian) then int64 LE tokens."""
    h = xxhash.xxh64()
    if prefix is not None:
        h.update(prefix.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.intdigest()


def simple_block_hash(token_ids: tuple[int, ...], prefix: int | None) -> int:
    """A pure-Python chained hash for CrossHair, which cannot see inside xxhash's C code.

    Only full blocks are hashed, so ``token_ids`` is never empty (an empty block with a
    prefix of ``2**64 - 1`` would hash to ``2**64``).

    pre: len(token_ids) >= 1
    post: 0 <= __return__ < 2 ** 64
    """
    h = 0 if prefix is None else prefix + 1
    for t in token_ids:
        h = (h * 1_000_003 + t + 1) % 2**64
    return h
