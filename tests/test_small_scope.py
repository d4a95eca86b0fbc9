"""Small-scope exhaustive check: spec == engine after every operation sequence up to
DEPTH steps, for block sizes 1 and 2, pools of 1-3 blocks and tokens from {0, 1}.

Operations are deterministic, so two sequences of operations that reach the same state
(both snapshots and every live sequence) have identical futures; the search is breadth
first and expands each state once, at the smallest depth it is reached. That covers every
operation sequence up to DEPTH while doing work proportional to the distinct states.
Run in tox env ``spec`` (marker ``small_scope``). A second, shallower search adds salted
prompts (R4s), under each hash algorithm.

The counts are checked exactly where they can be counted without the search: every state
and transition of two one-block searches to depth 3 (counted by hand, below), and the
first two levels of every search here (``first_levels_by_hand``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests.lockstep import Lockstep

pytestmark = pytest.mark.small_scope

DEPTH = 6
MAX_LIVE = 3
PROMPTS = [list(p) for n in (1, 2, 3) for p in itertools.product((0, 1), repeat=n)]

Op = tuple[str, Callable[[Lockstep], object]]


def operations(ls: Lockstep, salts: tuple[str | None, ...] = (None,)) -> Iterator[Op]:
    """Every operation the scheduler (or a misbehaving caller) could apply in this state."""
    if len(ls.pairs) < MAX_LIVE:
        for prompt, salt in itertools.product(PROMPTS, salts):
            yield f"add{prompt},{salt}", lambda s, p=prompt, c=salt: s.add(p, c)
    for i, pair in enumerate(ls.pairs):
        if not pair.allocated:
            yield f"admit{i}", lambda s, i=i: s.admit(s.pairs[i])
            yield f"double_release{i}", lambda s, i=i: s.force_deallocate(s.pairs[i])
        else:
            for finished in (True, False):
                yield f"release{i},{finished}", lambda s, i=i, f=finished: s.release(s.pairs[i], f)
        if pair.prefilling:
            left = len(pair.spec) - pair.spec.num_cached_tokens
            for chunk, token in itertools.product(sorted({1, left}), (0, 1)):
                yield (
                    f"prefill{i},{chunk},{token}",
                    lambda s, i=i, c=chunk, t=token: s.prefill(s.pairs[i], c, t),
                )
        if pair.decoding:
            for token in (0, 1):
                yield f"decode{i},{token}", lambda s, i=i, t=token: s.decode(s.pairs[i], t)
        for delta in (-1, 1):
            yield (
                f"allocate_wrong{i},{delta}",
                lambda s, i=i, d=delta: s.allocate_wrong(s.pairs[i], d),
            )
        yield f"may_append{i}", lambda s, i=i: s.force_may_append(s.pairs[i])
        yield f"hash_beyond{i}", lambda s, i=i: s.hash_beyond(s.pairs[i], 1)


def state_key(ls: Lockstep) -> object:
    """Everything both sides hold, up to the order of the live sequences: operations treat
    sequences alike whatever their index, so two states that differ only in that order
    have the same futures (relabelled). A state already checked is not checked again."""
    seqs = sorted(
        tuple(
            # "" for no salt (never a valid salt): None and str do not sort together
            (tuple(s.token_ids), tuple(s.block_table), s.num_cached_tokens, s.cache_salt or "")
            for s in (p.spec, p.engine)
        )
        for p in ls.pairs
    )
    return ls.spec.snapshot(), ls.engine.snapshot(), tuple(seqs)


@dataclass(frozen=True)
class Search:
    states: tuple[int, ...]
    """New states found at each depth (depth 0: the empty root)."""
    transitions: tuple[int, ...]
    """Operations applied from the states at each depth."""


def explore(
    num_blocks: int,
    block_size: int,
    depth: int = DEPTH,
    salts: tuple[str | None, ...] = (None,),
    hash_algorithm: str = "xxh64",
) -> Search:
    """Breadth-first over all states within ``depth``."""
    root = Lockstep(num_blocks, block_size, hash_algorithm=hash_algorithm)
    seen = {state_key(root)}
    frontier = [root]
    states, transitions = [1], []
    for _depth in range(depth):
        nxt = []
        applied = 0
        for ls in frontier:
            for name, op in operations(ls, salts):
                child = ls.clone()
                try:
                    op(child)  # compares return values, and refusals' side effects
                    key = state_key(child)
                    if key not in seen:
                        child.check()
                        seen.add(key)
                        nxt.append(child)
                except AssertionError as e:
                    raise AssertionError(f"after ... {name}: {e}") from e
                applied += 1
        frontier = nxt
        states.append(len(nxt))
        transitions.append(applied)
    return Search(tuple(states), tuple(transitions))


def first_levels_by_hand(num_blocks: int, block_size: int, salts: tuple[str | None, ...]) -> Search:
    """The search's first two levels, counted without it (arithmetic on the operation
    list in ``operations``, not a second search).

    Depth 1: one state per added (prompt, salt) ``P`` of them. Depth 2, from a state with
    one unallocated sequence: adding a second gives every unordered pair (states are
    keyed up to the order of the sequences), ``P (P + 1) / 2``; admitting it gives a new
    state for each prompt whose blocks fit in the pool (nothing is registered yet: no
    hits), and every other operation on an unallocated sequence (a second release, a
    wrong hit count either way, may_append, hash_blocks past its end) is refused and
    changes nothing. Transitions: ``P`` adds from the root, then from each depth-1 state
    ``P`` adds and those 6 operations."""
    prompts = len(PROMPTS) * len(salts)
    fits = sum(-(-len(p) // block_size) <= num_blocks for p in PROMPTS) * len(salts)
    return Search(
        states=(1, prompts, prompts * (prompts + 1) // 2 + fits),
        transitions=(prompts, prompts * (prompts + 6)),
    )


# Counted by hand, one block of size 1, to depth 3 (14 prompts; "unallocated" = U):
# depth 1: 14 states. Depth 2: 105 pairs of U + the 2 one-token prompts admitted = 107.
# Depth 3: 560 triples of U (multisets of 3 from 14); an admitted one-token prompt beside
# any U (2 x 14 = 28: admitting from a pair, or adding to the admitted, lands there);
# the admitted prompt's prefill of its one token, registering its block, then sampling
# 0 or 1 (2 x 2 = 4). Releasing it returns to a seen state; the rest are refused. So
# 592, and 15 + 107 + 592 = 714 in all. Transitions at depth 2: 105 pair states x (14 adds
# + 2 x 6 refused) = 2730, and 2 admitted x (14 adds, 2 releases, 2 prefills, 2 wrong
# counts, may_append, hash_beyond) = 44.
# Block size 2: 6 prompts of 1-2 tokens fit one block. Depth 2: 105 + 6 = 111. Depth 3:
# 560 + 6 x 14 = 84 beside a U, and prefills: one token of a 1-token prompt then a sample
# (4 states, the same as a 2-token prompt's first token: tokens, table and counters agree),
# and a whole 2-token prompt then a sample (4 x 2 = 8): 12 (may_append on a 2-token
# prompt has nothing to add). Transitions: 2730 + 2 x 22 + 4 x 24 (a 2-token prompt's
# prefill offers chunks 1 and 2).
HAND_COUNTED = [
    (1, 1, Search((1, 14, 107, 592), (14, 280, 2730 + 44))),
    (1, 2, Search((1, 14, 111, 656), (14, 280, 2730 + 2 * 22 + 4 * 24))),
]


@pytest.mark.parametrize(("num_blocks", "block_size", "expected"), HAND_COUNTED)
def test_tiny_searches_reach_exactly_the_states_counted_by_hand(
    num_blocks: int, block_size: int, expected: Search
) -> None:
    assert explore(num_blocks, block_size, depth=3) == expected


@pytest.mark.parametrize("block_size", [1, 2])
@pytest.mark.parametrize("num_blocks", [1, 2, 3])
def test_spec_and_engine_agree_on_every_short_trace(num_blocks: int, block_size: int) -> None:
    search = explore(num_blocks, block_size)
    print(f"pool={num_blocks} bs={block_size}: {search}")
    by_hand = first_levels_by_hand(num_blocks, block_size, (None,))
    assert search.states[:3] == by_hand.states
    assert search.transitions[:2] == by_hand.transitions
    assert all(search.states)  # every level found new states: the search went on branching


# One block size per algorithm keeps this under a minute; the machine mixes the rest.
@pytest.mark.parametrize(("block_size", "hash_algorithm"), [(1, "xxh64"), (2, "sha256")])
def test_salted_and_unsalted_prompts_agree_on_every_short_trace(
    block_size: int, hash_algorithm: str
) -> None:
    """Each prompt salted and not: the two meet in a 2-block pool, to depth 5."""
    salts = (None, "a")
    search = explore(2, block_size, 5, salts, hash_algorithm)
    print(f"salted pool=2 bs={block_size} {hash_algorithm}: {search}")
    by_hand = first_levels_by_hand(2, block_size, salts)
    assert search.states[:3] == by_hand.states
    assert search.transitions[:2] == by_hand.transitions
    assert all(search.states)
