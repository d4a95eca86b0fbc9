"""Small-scope exhaustive check: spec == engine after every operation sequence up to
DEPTH steps, for block sizes 1 and 2, pools of 1-3 blocks and tokens from {0, 1}.

Operations are deterministic, so two sequences of operations that reach the same state
(both snapshots and every live sequence) have identical futures; the search is breadth
first and expands each state once, at the smallest depth it is reached. That covers every
operation sequence up to DEPTH while doing work proportional to the distinct states.
Run in tox env ``spec`` (marker ``small_scope``). A second, shallower search adds salted
prompts (R4s), under each hash algorithm.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

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


def explore(
    num_blocks: int,
    block_size: int,
    depth: int = DEPTH,
    salts: tuple[str | None, ...] = (None,),
    hash_algorithm: str = "xxh64",
) -> tuple[int, int]:
    """Breadth-first over all states within ``depth``; returns (states, transitions)."""
    root = Lockstep(num_blocks, block_size, hash_algorithm=hash_algorithm)
    seen = {state_key(root)}
    frontier = [root]
    transitions = 0
    for _depth in range(depth):
        nxt = []
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
                transitions += 1
        frontier = nxt
    return len(seen), transitions


@pytest.mark.parametrize("block_size", [1, 2])
@pytest.mark.parametrize("num_blocks", [1, 2, 3])
def test_spec_and_engine_agree_on_every_short_trace(num_blocks: int, block_size: int) -> None:
    states, transitions = explore(num_blocks, block_size)
    print(f"pool={num_blocks} bs={block_size}: {states} states, {transitions} transitions")
    assert states > 100  # the search really branched


# One block size per algorithm keeps this under a minute; the machine mixes the rest.
@pytest.mark.parametrize(("block_size", "hash_algorithm"), [(1, "xxh64"), (2, "sha256")])
def test_salted_and_unsalted_prompts_agree_on_every_short_trace(
    block_size: int, hash_algorithm: str
) -> None:
    """Each prompt salted and not: the two meet in a 2-block pool, to depth 5."""
    states, transitions = explore(2, block_size, 5, (None, "a"), hash_algorithm)
    print(f"salted pool=2 bs={block_size} {hash_algorithm}: {states} states, {transitions}")
    assert states > 100
