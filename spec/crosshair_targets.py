"""Bounded allocator scenarios for CrossHair: the spec's rules in reachable states.

CrossHair builds a method's receiver by calling ``__init__``, so checking
``BlockManager``'s methods one by one only ever starts from an empty pool. These drivers
instead run short scripted traffic (admission, prefix sharing, chunked prefill, decode
growth, release) on a tiny pool, with symbolic sizes bounded by their ``pre:`` lines, and
check the rules after every step. Each driver returns what it observed plus the names of
the rules that failed; its one ``post:`` line says that none did, so a counterexample
prints the input and the broken rules side by side.

How CrossHair treats called code shapes this module:

* When a function under analysis calls one with contracts, CrossHair enforces the
  callee's contracts, and a callee *postcondition* (class ``inv:`` lines included) that
  fails makes it drop the path silently, as a bug to be reported "more locally" when the
  callee itself is analysed (crosshair.core.ExceptionFilter). From an empty pool that
  never happens, so a ``BlockManager`` bug that breaks a method's own contract would make
  these drivers prune exactly the paths that show it. Every allocator call therefore goes
  through ``crosshair_watch.plain`` (CrossHair's own "do not enforce" wrapper), and the
  drivers restate the method contracts and R12 themselves (``crosshair_watch.Watch``).
  Calls the allocator makes inside, to ``spec.indexing``, stay enforced: those contracts
  are proved over all paths.
* xxhash is C code CrossHair cannot see into, so the pool uses ``simple_block_hash``.
* Tokens are never symbolic, and sizes stop being symbolic at once: each is case-split
  (``crosshair_watch.split``: one fork per possible value, then a plain int). Symbolic
  tokens make every hash-map lookup fork on token values, and CrossHair spends its paths
  there: with ``list[bool]`` prompts, a deallocate that put freed blocks at the head of the
  free queue survived 80 paths unnoticed. On concrete sizes a path also runs about three
  times faster. CrossHair still picks every size and token pattern, so its search is a
  systematic walk of the bounded domain, which it can finish. Prompts are cut from a few
  fixed token patterns over ``{0, 1}`` (``TOKEN_PATTERNS``): few distinct blocks, so many
  prefix hits, and no hash collisions over such small values, so "hit" and "same tokens"
  coincide.

The bounded domains are small (10,800 + 288 inputs, listed by ``*_inputs``), so
tests/test_crosshair.py also runs every one of them concretely, in about half a second:
CrossHair's part is the symbolic exploration (it exhausts ``prefill_then_decode``'s
paths, proving it over its domain, and searches ``share_prefix``'s). The
``run_*`` bodies take the allocator class as an argument, so tests can run the same
scenarios on a broken allocator; the contracted entry points use the spec's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product

from spec.block_manager import BlockManager, simple_block_hash
from spec.crosshair_watch import plain, split, watch
from spec.indexing import needs_new_block
from spec.sequence import SpecSequence

# The bounds of the scenarios' domains, shared by their pre: lines, the case splits that
# make sizes concrete, and the enumeration of every input (``*_inputs``).
MAX_BLOCKS = 4
MAX_BLOCK_SIZE = 3
SHARE_MAX_PROMPT = 6
SHARE_MAX_TAIL = 2
DECODE_MAX_PROMPT = 3
DECODE_MAX_SAMPLED = 3

# Prompts are prefixes of these. All alike: every block equals every other of its size,
# the most prefix hits. Alternating: blocks alike only for even block sizes. Runs: blocks
# that differ at varying places.
TOKEN_PATTERNS: tuple[tuple[int, ...], ...] = (
    (0, 0, 0, 0, 0, 0),
    (0, 1, 0, 1, 0, 1),
    (0, 0, 1, 1, 1, 0),
)


def _common_full_blocks(a: SpecSequence, b: SpecSequence) -> int:
    """How many leading blocks of ``b`` a prefix-cache lookup can find after ``a`` was
    fully computed: ``a``'s full blocks, matched position by position, never ``b``'s last
    block (R5). Plain token comparison, no hashing."""
    limit = min(len(a) // a.block_size, b.num_blocks - 1)
    common = 0
    while common < limit and a.block(common) == b.block(common):
        common += 1
    return common


@dataclass(frozen=True, slots=True)
class SharingOutcome:
    """What ``share_prefix`` observed, and the rules that failed."""

    hits: int | None
    expected_hits: int
    broken: tuple[str, ...]


def _share(
    make: type[BlockManager],
    num_blocks: int,
    block_size: int,
    first_tokens: list[int],
    second_tokens: list[int],
    release_first: bool,
) -> SharingOutcome:
    w = watch(make, num_blocks, block_size)
    first = SpecSequence(list(first_tokens), block_size)
    second = SpecSequence(list(second_tokens), block_size)
    first_hits = w.admit(first)
    if first_hits is None:  # the prompt alone is larger than the pool
        w.expect(first.num_blocks > num_blocks, "R5 admission")
        w.invariants([])
        return SharingOutcome(None, 0, tuple(w.broken))
    w.expect(first_hits == 0, "R5/R10 prefix hits")  # an empty pool caches nothing
    w.compute(first, len(first))
    w.invariants([first])
    if release_first:
        w.release(first)
    expected = _common_full_blocks(first, second)
    # R5: hits on blocks still held cost nothing, every other block needs a free one.
    fits = w.bm.num_free_blocks >= second.num_blocks - (0 if release_first else expected)
    hits = w.admit(second)
    w.expect((hits is not None) == fits, "R5 admission")
    if hits is not None:
        w.expect(hits == expected, "R5/R10 prefix hits")
        w.invariants([second] if release_first else [first, second])
        w.release(second)
    if not release_first:
        w.release(first)
    w.invariants([])
    w.pool_restored()
    return SharingOutcome(hits, expected, tuple(w.broken))


def share_prefix(
    num_blocks: int,
    block_size: int,
    pattern: int,
    prompt_len: int,
    cut: int,
    tail_len: int,
    tail_token: bool,
    release_first: bool,
) -> SharingOutcome:
    """Admit and compute a prompt; admit its first ``cut`` tokens followed by ``tail_len``
    copies of ``tail_token``, while the first still holds its blocks (shared hits) or
    after it was released (hits revived from the free queue, R6); release everything (R3).

    pre: 1 <= num_blocks <= MAX_BLOCKS
    pre: 1 <= block_size <= MAX_BLOCK_SIZE
    pre: 0 <= pattern < len(TOKEN_PATTERNS)
    pre: 1 <= prompt_len <= SHARE_MAX_PROMPT
    pre: 0 <= cut <= prompt_len
    pre: 0 <= tail_len <= SHARE_MAX_TAIL
    pre: cut + tail_len >= 1
    post: __return__.broken == ()
    """
    args = (num_blocks, block_size, pattern, prompt_len, cut, tail_len, tail_token)
    return run_share_prefix(BlockManager, *args, release_first)


def run_share_prefix(
    make: type[BlockManager],
    num_blocks: int,
    block_size: int,
    pattern: int,
    prompt_len: int,
    cut: int,
    tail_len: int,
    tail_token: bool,
    release_first: bool,
) -> SharingOutcome:
    """``share_prefix`` on allocator class ``make``."""
    num_blocks = split(num_blocks, 1, MAX_BLOCKS)
    block_size = split(block_size, 1, MAX_BLOCK_SIZE)
    pattern = split(pattern, 0, len(TOKEN_PATTERNS) - 1)
    prompt_len = split(prompt_len, 1, SHARE_MAX_PROMPT)
    cut, tail_len = split(cut, 0, prompt_len), split(tail_len, 0, SHARE_MAX_TAIL)
    token = 1 if tail_token else 0  # a branch, so a concrete token (int() would not be)
    prompt = list(TOKEN_PATTERNS[pattern][:prompt_len])
    second = prompt[:cut] + [token] * tail_len
    return _share(make, num_blocks, block_size, prompt, second, release_first)


@dataclass(frozen=True, slots=True)
class DecodeOutcome:
    """What ``prefill_then_decode`` observed, and the rules that failed."""

    decoded: int
    broken: tuple[str, ...]


def _chain_registered(bm: BlockManager, seq: SpecSequence) -> bool:
    """R4/R8: every computed full block is registered under its chained hash."""
    h = None
    for i in range(seq.num_cached_tokens // seq.block_size):
        h = simple_block_hash(seq.block(i), h)
        block = seq.block_table[i]
        if bm.block_hashes[block] != h or bm.hash_to_block.get(h) != block:
            return False
    return True


def _decode(
    make: type[BlockManager],
    num_blocks: int,
    block_size: int,
    prompt_len: int,
    chunk: int,
    num_sampled: int,
) -> DecodeOutcome:
    w = watch(make, num_blocks, block_size)
    seq = SpecSequence(list(TOKEN_PATTERNS[2][:prompt_len]), block_size)
    if w.admit(seq) is None:
        w.expect(seq.num_blocks > num_blocks, "R5 admission")
        return DecodeOutcome(0, tuple(w.broken))
    w.compute(seq, chunk)
    if chunk < prompt_len:
        w.compute(seq, prompt_len - chunk)
    w.invariants([seq])
    decoded = 0
    for step in range(num_sampled):
        seq.token_ids.append(step % 2)  # sampled by the step that computed the last token
        if not plain(w.bm.can_append)(seq):
            # R7: refused only when the newest token opens a block and none is free.
            opens = needs_new_block(len(seq), block_size)
            w.expect(opens and not w.bm.free_queue, "R7 can_append")
            seq.token_ids.pop()
            break
        plain(w.bm.may_append)(seq)
        w.expect(len(seq.block_table) == -(-len(seq) // block_size), "R7 may_append table")
        w.compute(seq, 1)
        w.invariants([seq])
        decoded += 1
    w.expect(_chain_registered(w.bm, seq), "R4/R8 registration")
    w.release(seq)
    w.invariants([])
    w.pool_restored()
    return DecodeOutcome(decoded, tuple(w.broken))


def prefill_then_decode(
    num_blocks: int,
    block_size: int,
    prompt_len: int,
    chunk: int,
    num_sampled: int,
) -> DecodeOutcome:
    """Admit a ``prompt_len``-token prompt, prefill it in two chunks (the first ``chunk``
    tokens, then the rest, R8), then decode ``num_sampled`` tokens, one per step, until
    the pool runs dry (R7); release.

    pre: 1 <= num_blocks <= MAX_BLOCKS
    pre: 1 <= block_size <= MAX_BLOCK_SIZE
    pre: 1 <= prompt_len <= DECODE_MAX_PROMPT
    pre: 1 <= chunk <= prompt_len
    pre: 0 <= num_sampled <= DECODE_MAX_SAMPLED
    post: __return__.broken == ()
    """
    return run_prefill_then_decode(
        BlockManager, num_blocks, block_size, prompt_len, chunk, num_sampled
    )


def run_prefill_then_decode(
    make: type[BlockManager],
    num_blocks: int,
    block_size: int,
    prompt_len: int,
    chunk: int,
    num_sampled: int,
) -> DecodeOutcome:
    """``prefill_then_decode`` on allocator class ``make``."""
    num_blocks = split(num_blocks, 1, MAX_BLOCKS)
    block_size = split(block_size, 1, MAX_BLOCK_SIZE)
    prompt_len = split(prompt_len, 1, DECODE_MAX_PROMPT)
    chunk, num_sampled = split(chunk, 1, prompt_len), split(num_sampled, 0, DECODE_MAX_SAMPLED)
    return _decode(make, num_blocks, block_size, prompt_len, chunk, num_sampled)


def share_prefix_inputs() -> Iterator[tuple[int, int, int, int, int, int, bool, bool]]:
    """Every input that meets ``share_prefix``'s preconditions."""
    for num_blocks, block_size, pattern, prompt_len in product(
        range(1, MAX_BLOCKS + 1),
        range(1, MAX_BLOCK_SIZE + 1),
        range(len(TOKEN_PATTERNS)),
        range(1, SHARE_MAX_PROMPT + 1),
    ):
        for cut, tail_len in product(range(prompt_len + 1), range(SHARE_MAX_TAIL + 1)):
            if cut + tail_len >= 1:
                for tail_token, release_first in product((False, True), repeat=2):
                    yield (
                        num_blocks,
                        block_size,
                        pattern,
                        prompt_len,
                        cut,
                        tail_len,
                        tail_token,
                        release_first,
                    )


def prefill_then_decode_inputs() -> Iterator[tuple[int, int, int, int, int]]:
    """Every input that meets ``prefill_then_decode``'s preconditions."""
    for num_blocks, block_size, prompt_len, num_sampled in product(
        range(1, MAX_BLOCKS + 1),
        range(1, MAX_BLOCK_SIZE + 1),
        range(1, DECODE_MAX_PROMPT + 1),
        range(DECODE_MAX_SAMPLED + 1),
    ):
        for chunk in range(1, prompt_len + 1):
            yield num_blocks, block_size, prompt_len, chunk, num_sampled
