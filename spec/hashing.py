"""R4's chained block hash for the spec (xxh64 and sha256), R4s's salt block, and a
pure-Python stand-in for CrossHair."""

from __future__ import annotations

import hashlib
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


def sha256_block_hash(token_ids: tuple[int, ...], prefix: int | None) -> int:
    """R4 under sha256: the previous hash (32 bytes, big-endian) then int64 LE tokens; the
    whole 256-bit digest as an int (big-endian), never truncated."""
    h = hashlib.sha256()
    if prefix is not None:
        h.update(prefix.to_bytes(32, "big"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "big")


def salt_block(cache_salt: str) -> tuple[int, ...]:
    """R4s: the tokens of virtual block -1, which stands for the salt: ``-1`` (no real
    token is negative, so no salt spells out a real block 0), then one token per byte of
    the salt's UTF-8 encoding. Its hash (prefix None) is block 0's prefix."""
    return (-1, *cache_salt.encode("utf-8"))


def check_cache_salt(cache_salt: object) -> None:
    """R4s: a salt is None or a non-empty str (TypeError / ValueError otherwise)."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
    if cache_salt == "":
        raise ValueError("cache_salt must be a non-empty string")


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
