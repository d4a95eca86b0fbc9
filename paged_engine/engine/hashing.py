"""R4's chained block hash (xxh64 or sha256) and R4s's cache salt, for the engine.

``BlockHasher`` is the hashing layer of the allocator (``BlockPool`` and so
``BlockManager`` inherit it), built for the scheduler's hot paths:

* Each full block's chained hash is computed once per sequence lifetime and kept in
  ``Sequence.block_hashes``; ``can_allocate`` (retried every step while a request waits),
  ``allocate``, ``hash_blocks`` and re-prefill after preemption all reuse it.
* Likewise each full block is packed to int64 LE bytes once, into
  ``Sequence.block_bytes`` (never through ``numpy.array``). The same bytes object feeds
  the hash, the token check (R10: one memcmp) and, once registered, ``block_tokens``.
  Bytes are not tracked by the garbage collector, so a prefix cache of thousands of
  blocks adds nothing to its collections (a list of tokens per block did: each
  registration counted towards the next collection, and each collection walked them).
* The hash is chosen once, in ``__init__``: xxh64 (the default) runs inlined, with no
  call per block (here, and in ``hash_blocks``'s decode step); ``hash_algorithm="sha256"``
  and an injected ``hash_fn`` take the general paths. A cache salt (R4s) costs one check
  per sequence, where block 0 is hashed.

Nothing here imports more than xxhash and the standard library (``paged_engine.config``
takes ``HASH_ALGORITHMS`` from here). Rule numbers refer to ../shared/DESIGN.md.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC
from hashlib import sha256
from typing import TYPE_CHECKING, Literal, get_args

from xxhash import xxh64_intdigest

if TYPE_CHECKING:
    from paged_engine.engine.sequence import Sequence

__all__ = [
    "HASH_ALGORITHMS",
    "BlockHasher",
    "HashAlgorithm",
    "HashFn",
    "salt_block",
    "sha256_block_hash",
    "xxh64_block_hash",
]

HashFn = Callable[[SequenceABC[int], "int | None"], int]
HashAlgorithm = Literal["xxh64", "sha256"]
HASH_ALGORITHMS: tuple[HashAlgorithm, ...] = get_args(HashAlgorithm)
"""R4's hashes by name, the default first: the one list (``EngineConfig`` reads it)."""

_GROUPER_MAX_BLOCK_SIZE = 64
"""Up to this block size, ``map`` over ``block_size`` references to one token iterator
packs blocks fastest; above it, a slice per block does."""


def xxh64_block_hash(token_ids: SequenceABC[int], prefix: int | None) -> int:
    """R4: xxh64 over the previous hash (8 bytes LE, absent for block 0), then int64 LE tokens."""
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    if prefix is not None:
        data = prefix.to_bytes(8, "little") + data
    return xxh64_intdigest(data)


def sha256_block_hash(token_ids: SequenceABC[int], prefix: int | None) -> int:
    """R4 under sha256: the previous hash (32 bytes BE, absent for block 0), then int64 LE
    tokens; the full 256-bit digest as an int (truncating it would bring back the
    birthday bound of a 64-bit hash)."""
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    if prefix is not None:
        data = prefix.to_bytes(32, "big") + data
    return int.from_bytes(sha256(data).digest(), "big")


def salt_block(cache_salt: str) -> list[int]:
    """R4s: virtual block -1's tokens: -1 (no real token is negative, so no salt spells
    out a real block 0), then the salt's UTF-8 bytes, one per token. Its hash is block 0's
    prefix."""
    return [-1, *cache_salt.encode("utf-8")]


class BlockHasher:
    """The hash chain of a sequence's full blocks (R4, R4s), and their packed bytes, both
    cached on the sequence.

    ``hash_fn`` replaces the chained hash (tests inject colliding hashes to exercise R10);
    ``hash_algorithm`` picks R4's hash, "xxh64" or "sha256" (collision resistant, for a
    cache shared by tenants who must not reach each other's blocks; slower). Pass one of
    the two. Sequences cache hashes, so a sequence must only ever be used with hashers
    sharing one hash function.
    """

    def __init__(
        self, block_size: int, *, hash_fn: HashFn | None = None, hash_algorithm: str = "xxh64"
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if not isinstance(hash_algorithm, str) or hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(
                f"hash_algorithm must be one of {HASH_ALGORITHMS}, got {hash_algorithm!r}"
            )
        if hash_fn is not None and hash_algorithm != "xxh64":
            raise ValueError(f"hash_fn replaces hash_algorithm={hash_algorithm!r}: pass one")
        self.block_size = block_size
        self.hash_algorithm = hash_algorithm
        self._hash_fn = hash_fn
        self._sha256 = hash_algorithm == "sha256"
        # R4's hash as a function of (tokens, prefix), for the salt block (R4s).
        self._block_hash: HashFn = hash_fn or (
            sha256_block_hash if self._sha256 else xxh64_block_hash
        )
        block_struct = struct.Struct(f"<{block_size}q")  # one full block, int64 LE
        self._pack_block = block_struct.pack
        self._unpack_block = block_struct.unpack
        self._block_nbytes = block_struct.size

    @staticmethod
    def compute_hash(token_ids: Iterable[int], prefix: int | None = None) -> int:
        """R4 with the default hash function."""
        return xxh64_block_hash(list(token_ids), prefix)

    def _packed_blocks(self, seq: Sequence, n: int) -> list[bytes]:
        """The sequence's first ``n`` (full) blocks packed, one bytes object per block,
        cached on it as ``block_bytes`` (full blocks never change: it never goes stale).

        Beyond a decode step's one block, it packs every full block: the callers (prefix
        lookups, prefill) ask for all of them but the last, and a bound costs more than
        packing that one.
        """
        packed = seq.block_bytes
        have = len(packed)
        if have < n:
            bs, pack, tokens = self.block_size, self._pack_block, seq.token_ids
            if n - have == 1:  # a decode step filled one block
                packed.append(pack(*tokens[have * bs : n * bs]))
            elif bs <= _GROUPER_MAX_BLOCK_SIZE:
                # The grouper idiom: ``map`` hands the packer ``bs`` consecutive tokens
                # per call, all in C, and stops at a partial last block; for small
                # blocks, slicing and calling per block in Python would cost half as
                # much again.
                rest = iter(tokens[have * bs :] if have else tokens)
                packed += map(pack, *[rest] * bs)
            else:
                stop = len(tokens) - bs + 1
                packed += [pack(*tokens[o : o + bs]) for o in range(have * bs, stop, bs)]
        return packed

    def _chain_start(self, seq: Sequence) -> int | None:
        """R4s: block 0's prefix: None without a salt, else the salt block's hash."""
        salt = seq.cache_salt
        return None if salt is None else self._block_hash(salt_block(salt), None)

    def _block_hashes(self, seq: Sequence, n: int) -> list[int]:
        """The sequence's hash chain, extended to at least its first ``n`` (full) blocks.

        ``BlockManager.hash_blocks`` inlines it for a decode step's one block unless a
        subclass overrides it.
        """
        hashes = seq.block_hashes
        have = len(hashes)
        if have >= n:
            return hashes
        if self._hash_fn is not None:
            bs, tokens = self.block_size, seq.token_ids
            h = hashes[-1] if hashes else self._chain_start(seq)
            for i in range(have, n):
                h = self._hash_fn(tokens[i * bs : (i + 1) * bs], h)
                hashes.append(h)
            return hashes
        packed = self._packed_blocks(seq, n)
        append = hashes.append
        if self._sha256:
            start = hashes[-1] if hashes else self._chain_start(seq)
            prev = b"" if start is None else start.to_bytes(32, "big")
            for data in packed[have:n]:
                digest = sha256(prev + data).digest()
                append(int.from_bytes(digest, "big"))
                prev = digest  # the 32-byte big-endian form of the hash just appended
            return hashes
        if not have:  # block 0: no prefix, or the salt block's hash (R4s)
            start = None if seq.cache_salt is None else self._chain_start(seq)
            data = packed[0]
            append(xxh64_intdigest(data if start is None else start.to_bytes(8, "little") + data))
        h = hashes[-1]
        for data in packed[len(hashes) : n]:
            h = xxh64_intdigest(h.to_bytes(8, "little") + data)
            append(h)
        return hashes
