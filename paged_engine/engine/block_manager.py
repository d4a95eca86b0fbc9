"""The block allocator: paged KV blocks, ref counts, and a prefix cache over a hash chain.

Observably identical to ``spec/block_manager.py`` (same return values, block ids and
snapshots; the tests drive both in lockstep), and built for the scheduler's hot paths:

* The free queue is an ``OrderedDict`` used as an ordered set: popping the head, appending
  at the tail and reviving a cached block from *anywhere* in the queue are all O(1)
  (nano-vllm's ``deque.remove`` scans the pool for every revived block).
* Each full block's chained hash is computed once per sequence lifetime and kept in
  ``Sequence.block_hashes``; ``can_allocate`` (retried every step while a request waits),
  ``allocate``, ``hash_blocks`` and re-prefill after preemption all reuse it.
* Likewise each full block is packed to int64 LE bytes once, into
  ``Sequence.block_bytes`` (never through ``numpy.array``). The same bytes object feeds
  the hash, the token check (R10: one memcmp) and, once registered, ``block_tokens``.
  Bytes are not tracked by the garbage collector, so a prefix cache of thousands of
  blocks adds nothing to its collections (a list of tokens per block did: each
  registration counted towards the next collection, and each collection walked them).
* The prefix walk runs its dict lookups and token checks through ``map`` (C loops);
  Python-level loops remain only for hashing and for ref counts.
* ``allocate``, and ``hash_blocks`` when a decode step fills a block, inline the per-block
  hooks (``_take_hit``, ``_fresh_block``, ``_block_hashes``) unless a subclass overrides
  them: there a Python call costs more than the work it wraps.
* The decode path (``can_append``/``may_append``/``hash_blocks``) is a few integer
  operations per sequence when no block boundary is crossed.
* The hash is chosen once, in ``__init__``: xxh64 (the default) keeps its fast paths
  unchanged; ``hash_algorithm="sha256"`` takes the general ones. A cache salt (R4s)
  costs one check per sequence, where block 0 is hashed.

Rule numbers (R1-R12) refer to ../shared/DESIGN.md.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC
from hashlib import sha256
from typing import cast

from xxhash import xxh64_intdigest

from paged_engine.engine.allocator_state import AllocatorState
from paged_engine.engine.sequence import Sequence

__all__ = [
    "HASH_ALGORITHMS",
    "AllocatorState",
    "BlockManager",
    "HashFn",
    "salt_block",
    "sha256_block_hash",
    "xxh64_block_hash",
]

HashFn = Callable[[SequenceABC[int], "int | None"], int]
HASH_ALGORITHMS = ("xxh64", "sha256")

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


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens (R1).

    ``enable_prefix_caching=False`` turns the allocator into a plain paged allocator: no
    block is registered (R8) or looked up (R5). ``hash_fn`` replaces the chained hash (tests
    inject colliding hashes to exercise R10); ``hash_algorithm`` picks R4's hash, "xxh64"
    or "sha256" (collision resistant, for a cache shared by tenants who must not reach
    each other's blocks; slower). Pass one of the two. Sequences cache hashes, so a
    sequence must only ever be used with allocators sharing one hash function.

    ``can_allocate`` remembers its last lookup, tagged with a state version that every
    mutation bumps: the ``allocate`` that follows it (and the retries of a request blocked
    at the head of the queue while nothing changed) reuse it instead of walking the prefix
    again.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn | None = None,
        hash_algorithm: str = "xxh64",
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(hash_algorithm, str) or hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(
                f"hash_algorithm must be one of {HASH_ALGORITHMS}, got {hash_algorithm!r}"
            )
        if hash_fn is not None and hash_algorithm != "xxh64":
            raise ValueError(f"hash_fn replaces hash_algorithm={hash_algorithm!r}: pass one")
        self.hash_algorithm = hash_algorithm
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        # Each registered block's tokens, packed as the hash reads them (int64 LE; b"" when
        # unset): R10 compares them with one memcmp, and the GC never walks them.
        # Shared with the registering sequence's ``block_bytes``.
        self.block_tokens: list[bytes] = [b""] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
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
        # Hot paths inline these hooks (a call costs more than the work), unless a subclass
        # overrides them (tests/mutants.py does), which then gets them called.
        cls = type(self)
        self._inline_take_hit = cls._take_hit is BlockManager._take_hit
        self._inline_fresh_block = cls._fresh_block is BlockManager._fresh_block
        # (The inlined copy is xxh64's: sha256 always calls _block_hashes.)
        self._inline_block_hashes = (
            cls._block_hashes is BlockManager._block_hashes and not self._sha256
        )
        self._version = 0
        self._memo: tuple[Sequence, int, int, list[int], int] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @staticmethod
    def compute_hash(token_ids: Iterable[int], prefix: int | None = None) -> int:
        """R4 with the default hash function."""
        return xxh64_block_hash(list(token_ids), prefix)

    # ---- internals -------------------------------------------------------------------

    def _state_changed(self) -> None:
        """Every mutation calls this: it invalidates the remembered lookup."""
        self._version += 1

    def _fresh_block(self) -> int:
        """R2: take the head of the free queue; drop its registration if still its own.

        ``allocate`` inlines this unless a subclass overrides it.
        """
        block, _ = self.free_blocks.popitem(last=False)
        if self.block_hashes[block] is not None:
            self._unregister(block)
        self.ref_counts[block] = 1
        return block

    def _unregister(self, block: int) -> None:
        """R2's eviction: forget the block's hash and tokens, and its map entry if the
        entry still points to it (a newer block with the same hash may own it)."""
        old = self.block_hashes[block]
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.block_hashes[block] = None
        self.block_tokens[block] = b""

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

        ``hash_blocks`` inlines it for a decode step's one block unless a subclass
        overrides it.
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

    def _lookup(self, seq: Sequence, num_candidates: int) -> list[int]:
        """R5, R10: blocks holding the sequence's first ``num_candidates`` blocks, in order,
        up to the first block that is unregistered or registered with other tokens."""
        if not self.enable_prefix_caching or num_candidates <= 0:
            return []
        packed = self._packed_blocks(seq, num_candidates)
        # The whole chain at once: hash_blocks needs these hashes after prefill anyway.
        hashes = self._block_hashes(seq, num_candidates)
        # R5: the blocks registered under the leading hashes, up to the first miss.
        found = list(map(self.hash_to_block.get, hashes[:num_candidates]))
        try:  # one scan (comparing with None is slow: neither int nor None knows the other)
            hits = cast("list[int]", found[: found.index(None)])
        except ValueError:
            hits = cast("list[int]", found)  # every candidate's hash is registered
        # R10: all of them hold the sequence's tokens, unless a hash collided.
        block_tokens = self.block_tokens
        if list(map(block_tokens.__getitem__, hits)) != packed[: len(hits)]:
            for i, (block, data) in enumerate(zip(hits, packed, strict=False)):
                if block_tokens[block] != data:
                    del hits[i:]
                    break
        return hits

    def _hits(self, seq: Sequence) -> tuple[list[int], int]:
        """R5: the hits and the free blocks admitting ``seq`` costs (a hit in use costs
        nothing; a revived hit and each fresh block cost one), remembered until the state
        or the sequence changes.

        The cost is only ever compared with the free blocks in that same state, so when
        they are at least ``seq.num_blocks`` (the most it can be), that bound stands in
        for it and the hits' ref counts go unread.
        """
        if seq.block_size != self.block_size:
            raise ValueError(
                f"the sequence's block_size {seq.block_size} != the allocator's {self.block_size}"
            )
        memo = self._memo
        if (
            memo is not None
            and memo[0] is seq
            and memo[1] == self._version
            and memo[2] == seq.num_tokens
        ):
            return memo[3], memo[4]
        n = seq.num_blocks
        hits = self._lookup(seq, n - 1)  # the last block is never looked up
        needed = n
        if len(self.free_blocks) < n:
            # Fresh blocks plus revived hits (ref count 0), counted at C speed.
            needed -= len(hits) - list(map(self.ref_counts.__getitem__, hits)).count(0)
        self._memo = (seq, self._version, seq.num_tokens, hits, needed)
        return hits, needed

    def _take_hit(self, block: int) -> None:
        """R6 for one hit: share it if in use, else revive it from anywhere in the queue.

        ``allocate`` inlines this unless a subclass overrides it.
        """
        rc = self.ref_counts[block]
        if not rc:
            del self.free_blocks[block]  # O(1), wherever it stands
        self.ref_counts[block] = rc + 1

    # ---- the allocator API -----------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> int | None:
        """R5: how many leading blocks the prefix cache holds, or None if the pool is short."""
        hits, needed = self._hits(seq)
        return None if len(self.free_blocks) < needed else len(hits)

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """R6: attach the hits (shared or revived), then fresh blocks from the queue head."""
        if seq.block_table:
            raise RuntimeError("allocate: the sequence already holds blocks")
        hits, needed = self._hits(seq)
        if num_cached_blocks != len(hits):
            raise ValueError(
                f"allocate: num_cached_blocks={num_cached_blocks}, but the prefix cache "
                f"holds {len(hits)} leading blocks of this sequence"
            )
        if len(self.free_blocks) < needed:
            raise RuntimeError("allocate: not enough free blocks for this sequence")
        self._state_changed()
        ref_counts, free = self.ref_counts, self.free_blocks
        if self._inline_take_hit:  # a prompt can hit hundreds of blocks
            for block in hits:
                rc = ref_counts[block]
                if not rc:
                    del free[block]
                ref_counts[block] = rc + 1
        else:
            for block in hits:
                self._take_hit(block)
        table = seq.block_table
        table += hits
        num_fresh = seq.num_blocks - len(hits)
        if self._inline_fresh_block:
            popitem, block_hashes = free.popitem, self.block_hashes
            for _ in range(num_fresh):
                block = popitem(last=False)[0]
                if block_hashes[block] is not None:
                    self._unregister(block)
                ref_counts[block] = 1
                table.append(block)
        else:
            fresh_block = self._fresh_block
            table += [fresh_block() for _ in range(num_fresh)]
        seq.num_cached_tokens = len(hits) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        """R7: a free block exists, or the newest token does not start a new block."""
        if self.free_blocks:
            return True
        return (seq.num_tokens - 1) % self.block_size != 0

    def may_append(self, seq: Sequence) -> None:
        """R7: give the sequence a fresh block when its newest token starts one."""
        table = seq.block_table
        bs = self.block_size
        # The common decode step, in one test: the newest token lands in the table's last
        # block, past its first slot: (len(table) - 1) * bs + 2 <= num_tokens <=
        # len(table) * bs. Never true for an empty table (num_tokens >= 1), nor with
        # block_size 1, where every token starts a block.
        if 0 <= len(table) * bs - seq.num_tokens < bs - 1:
            return
        last = seq.num_tokens - 1
        if last % bs == 0 and table and len(table) == last // bs:
            if not self.free_blocks:
                raise RuntimeError("may_append: no free block")
            self._state_changed()
            table.append(self._fresh_block())
            return
        if not table:
            raise RuntimeError("may_append: the sequence holds no blocks")
        raise RuntimeError(
            f"may_append: a {seq.num_tokens}-token sequence with {len(table)} blocks "
            "is not one token past its block table"
        )

    def hash_blocks(self, seq: Sequence) -> None:
        """R8: register the blocks that became full in the step just computed."""
        cached = seq.num_cached_tokens
        total = cached + seq.num_scheduled_tokens
        bs = self.block_size
        end = total // bs
        if (
            cached // bs == end
            and 0 <= cached <= total <= seq.num_tokens
            and end <= len(seq.block_table)
        ):
            return  # the common decode step: no block filled, arguments valid
        start, table = cached // bs, seq.block_table
        if cached < 0 or total < cached or total > seq.num_tokens:
            raise ValueError(
                f"hash_blocks: num_cached_tokens={cached} + num_scheduled_tokens="
                f"{seq.num_scheduled_tokens} is outside a {seq.num_tokens}-token sequence"
            )
        if end > len(table):
            raise RuntimeError(
                f"hash_blocks: {end} full blocks but the sequence holds {len(table)}"
            )
        if start == end or not self.enable_prefix_caching:
            return
        self._state_changed()
        hashes, packed = seq.block_hashes, seq.block_bytes
        if (
            end - start == 1
            and len(hashes) == len(packed) == start > 0
            and self._hash_fn is None
            and self._inline_block_hashes
        ):
            # A decode step filled one block (every block_size steps of each sequence):
            # _packed_blocks, _block_hashes and the registration below, inlined for it.
            data = self._pack_block(*seq.token_ids[start * bs : end * bs])
            h = xxh64_intdigest(hashes[-1].to_bytes(8, "little") + data)
            packed.append(data)
            hashes.append(h)
            block = table[start]
            self.block_hashes[block] = h
            self.block_tokens[block] = data
            self.hash_to_block[h] = block
            return
        hashes = self._block_hashes(seq, end)
        packed = self._packed_blocks(seq, end)  # done by the hashing, unless hash_fn
        block_hashes, block_tokens, hash_to_block = (
            self.block_hashes,
            self.block_tokens,
            self.hash_to_block,
        )
        for i in range(start, end):
            block, h = table[i], hashes[i]
            block_hashes[block] = h
            block_tokens[block] = packed[i]
            hash_to_block[h] = block  # overwrite: the newest registration wins

    def deallocate(self, seq: Sequence) -> None:
        """R3: release last block first; freed blocks keep hash and tokens until reused."""
        table = seq.block_table
        if not table:
            raise RuntimeError("deallocate: the sequence holds no blocks (double release?)")
        self._state_changed()
        ref_counts, free = self.ref_counts, self.free_blocks
        for block in reversed(table):
            rc = ref_counts[block] - 1
            ref_counts[block] = rc
            if not rc:
                free[block] = None
        table.clear()
        seq.num_cached_tokens = 0

    # ---- observation -----------------------------------------------------------------

    def snapshot(self) -> AllocatorState:
        """R11."""
        return AllocatorState(
            free_queue=tuple(self.free_blocks),
            ref_counts=tuple(self.ref_counts),
            block_hashes=tuple(self.block_hashes),
            # Registered blocks are full; b"" (or a test's ()) means no tokens recorded.
            block_tokens=tuple(self._unpack_block(t) if t else () for t in self.block_tokens),
            hash_to_block=tuple(sorted(self.hash_to_block.items())),
        )

    def check_invariants(self, seqs: Iterable[Sequence] | None = None) -> None:
        """R12 in O(pool + tables); raises AssertionError naming what is broken."""
        free = self.free_blocks
        for b, rc in enumerate(self.ref_counts):
            if rc < 0 or (rc == 0) != (b in free):
                raise AssertionError(f"block {b}: ref_count {rc} but in free queue: {b in free}")
            if rc > 1 and (
                self.block_hashes[b] is None or len(self.block_tokens[b]) != self._block_nbytes
            ):
                raise AssertionError(f"block {b} is shared but not full and hashed (R9)")
        if any(not 0 <= b < self.num_blocks for b in free):
            raise AssertionError("free queue holds an id outside the pool")
        for h, b in self.hash_to_block.items():
            if self.block_hashes[b] != h:
                raise AssertionError(f"hash map entry {h} -> {b} disagrees with the block")
        if seqs is not None:
            holders = [0] * self.num_blocks
            for seq in seqs:
                for b in seq.block_table:
                    holders[b] += 1
            if holders != self.ref_counts:
                raise AssertionError(f"ref counts {self.ref_counts} != table holders {holders}")
