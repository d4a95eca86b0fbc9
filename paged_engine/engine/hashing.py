"""R4's chained block hash (xxh64 or sha256) and R4s's cache salt, for the engine.

``BlockHasher`` is the hashing layer of the allocator (``BlockPool`` and so
``BlockManager`` inherit it), built for the scheduler's hot paths:

* Each full block's chained hash is computed once per sequence lifetime and kept in
  ``Sequence.block_hashes``; ``can_allocate`` (retried every step while a request waits),
  ``allocate``, ``hash_blocks``, re-prefill after preemption and the scheduler's deferral
  all reuse it through ``hash_chain``, the one place that extends it.
* Likewise each full block is packed to int64 LE bytes once, into
  ``Sequence.block_bytes`` (never through ``numpy.array``). The same bytes object feeds
  the hash, the token check (R10: one memcmp) and, once registered, ``block_tokens``.
  Bytes are not tracked by the garbage collector, so a prefix cache of thousands of
  blocks adds nothing to its collections (a list of tokens per block did: each
  registration counted towards the next collection, and each collection walked them).
* The hash is chosen once, in ``__init__``: xxh64 (the default) and sha256 each run as one
  loop over the packed blocks, with no call per block; an injected ``hash_fn`` (tests)
  takes the general path. A cache salt (R4s) costs one check per sequence, where block 0
  is hashed.

Nothing here imports more than xxhash, the standard library and ``paged_engine.config``
(for the hashes' names). Rule numbers refer to docs/design.md, "Allocator rules".
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC
from hashlib import sha256
from typing import TYPE_CHECKING

from xxhash import xxh64_intdigest

from paged_engine.config import PREFIX_CACHE_HASHES as HASH_ALGORITHMS
from paged_engine.config import PrefixCacheHash as HashAlgorithm

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
        self._xxh64 = hash_fn is None and not self._sha256  # R4's default hash, unreplaced
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

    def hash_chain(self, seq: Sequence, n: int) -> list[int]:
        """The sequence's hash chain, extended to at least its first ``n`` (full) blocks,
        after packing them into ``block_bytes``; both are cached on the sequence.

        It packs every full block beyond a decode step's one: the callers (prefix
        lookups, prefill) ask for all of them but the last, and a bound costs more than
        packing that one. (``BlockManager.hash_blocks`` packs and hashes the one block a
        decode step fills itself, under xxh64.)
        """
        hashes = seq.block_hashes
        have = len(hashes)
        if have >= n:
            return hashes
        packed, bs = seq.block_bytes, self.block_size
        done = len(packed)
        if done < n:
            pack, tokens = self._pack_block, seq.token_ids
            if n - done == 1:  # a decode step filled one block
                packed.append(pack(*tokens[done * bs : n * bs]))
            elif bs <= _GROUPER_MAX_BLOCK_SIZE:
                # The grouper idiom: ``map`` hands the packer ``bs`` consecutive tokens
                # per call, all in C, and stops at a partial last block; for small
                # blocks it beats slicing and calling per block in Python.
                rest = iter(tokens[done * bs :] if done else tokens)
                packed += map(pack, *[rest] * bs)
            else:
                stop = len(tokens) - bs + 1
                packed += [pack(*tokens[o : o + bs]) for o in range(done * bs, stop, bs)]
        append = hashes.append
        start = hashes[-1] if have else self._chain_start(seq)
        if self._hash_fn is not None:
            h, tokens, hash_fn = start, seq.token_ids, self._hash_fn
            for i in range(have, n):
                h = hash_fn(tokens[i * bs : (i + 1) * bs], h)
                append(h)
        elif self._sha256:
            prev = b"" if start is None else start.to_bytes(32, "big")
            for data in packed[have:n]:
                digest = sha256(prev + data).digest()
                append(int.from_bytes(digest, "big"))
                prev = digest  # the 32-byte big-endian form of the hash just appended
        else:
            prev = b"" if start is None else start.to_bytes(8, "little")
            for data in packed[have:n]:
                h = xxh64_intdigest(prev + data)
                append(h)
                prev = h.to_bytes(8, "little")
        return hashes

    def packed_blocks(self, seq: Sequence, n: int) -> list[bytes]:
        """The sequence's first ``n`` (full) blocks packed, one bytes object per block,
        cached on it as ``block_bytes`` (full blocks never change: it never goes stale);
        packed by ``hash_chain``, which the prefix cache needs of the same blocks."""
        self.hash_chain(seq, n)
        return seq.block_bytes

    def _chain_start(self, seq: Sequence) -> int | None:
        """R4s: block 0's prefix: None without a salt, else the salt block's hash."""
        salt = seq.cache_salt
        return None if salt is None else self._block_hash(salt_block(salt), None)
