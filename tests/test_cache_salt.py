"""Cache salts (R4s) and the two hash algorithms (R4 under xxh64 and sha256): exact block
ids, hashes bit for bit against formulas written here from the rules, what a collision
can and cannot do past R10, and bad salts and algorithms refused. Allocator cases run on
the spec and the engine, under both algorithms."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import numpy as np
import pytest
import xxhash

from paged_engine.config import PREFIX_CACHE_HASHES, EngineConfig, PrefixCacheHash
from paged_engine.engine.block_manager import HASH_ALGORITHMS, BlockManager, xxh64_block_hash
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.sequence import Sequence
from spec.block_manager import BlockManager as SpecBlockManager
from spec.sequence import SpecSequence
from tests.fake_model import FakeModelRunner
from tests.lockstep import SPEC_HASHES
from tests.test_allocator_examples import admit, compute_rest, prefill


@dataclass(frozen=True)
class Kit:
    """One side (spec or engine) under one hash: ``bm(num_blocks, block_size)`` (or with
    an injected ``hash_fn``) and ``seq(tokens, block_size, salt)``."""

    bm: Callable[..., Any]
    seq: Callable[..., Any]


def _spec_bm(n: int, bs: int, alg: str = "xxh64", hash_fn: Any = None) -> SpecBlockManager:
    return SpecBlockManager(n, bs, hash_fn=hash_fn or SPEC_HASHES[alg])


def _engine_bm(n: int, bs: int, alg: str = "xxh64", hash_fn: Any = None) -> BlockManager:
    return BlockManager(n, bs, hash_fn=hash_fn, hash_algorithm=alg)


SIDES = {
    "spec": (_spec_bm, lambda t, bs, salt=None: SpecSequence(list(t), bs, cache_salt=salt)),
    "engine": (_engine_bm, lambda t, bs, salt=None: Sequence(t, block_size=bs, cache_salt=salt)),
}
KITS = [(side, alg) for side in sorted(SIDES) for alg in ("xxh64", "sha256")]


@pytest.fixture(params=KITS, ids=[f"{s}-{a}" for s, a in KITS])
def kit(request: pytest.FixtureRequest) -> Kit:
    side, alg = request.param
    make_bm, make_seq = SIDES[side]
    return Kit(lambda n, bs: make_bm(n, bs, alg), make_seq)


@pytest.fixture(params=sorted(SIDES))
def side(request: pytest.FixtureRequest) -> Kit:
    make_bm, make_seq = SIDES[request.param]
    return Kit(lambda n, bs, fn: make_bm(n, bs, hash_fn=fn), make_seq)


# ---- sharing: exact block ids ----------------------------------------------------------------

TOKENS = list(range(9))  # block size 4: blocks 0 and 1 full, block 2 holds the last token


@pytest.mark.parametrize(
    ("salt_a", "salt_b", "hits", "table_b"),
    [
        # Another salt, or a salt against none: block 0's hash differs (R4s) and the chain
        # carries the difference to block 1, so b hits nothing and takes fresh blocks 3-5.
        ("tenant-a", "tenant-b", 0, [3, 4, 5]),
        ("a", "ab", 0, [3, 4, 5]),
        (None, "a", 0, [3, 4, 5]),
        ("a", None, 0, [3, 4, 5]),
        # The same salt, or none on both: b hits a's two full blocks 0 and 1 (the last block
        # is never looked up, R5) and its last block comes fresh, block 3.
        ("tenant-a", "tenant-a", 2, [0, 1, 3]),
        (None, None, 2, [0, 1, 3]),
    ],
)
def test_salts_decide_what_two_identical_prompts_share(
    kit: Kit, salt_a: str | None, salt_b: str | None, hits: int, table_b: list[int]
) -> None:
    bm = kit.bm(8, 4)
    a = kit.seq(TOKENS, 4, salt_a)
    assert prefill(bm, a) == 0 and a.block_table == [0, 1, 2]
    b = kit.seq(TOKENS, 4, salt_b)
    assert admit(bm, b) == hits
    assert b.block_table == table_b and b.num_cached_tokens == 4 * hits
    compute_rest(bm, b)
    # Two full blocks each: four registrations, under four hashes unless they share.
    assert len(bm.snapshot().hash_to_block) == (2 if hits else 4)


def test_a_salt_spelling_a_token_block_does_not_reproduce_an_unsalted_chain(kit: Kit) -> None:
    """Were the salt's hash that of its bare UTF-8 bytes, salt "A" + 7 NULs (the int64 LE
    bytes of token 65) would hash as block [65] does, so a salted [7, 9] would hit block 1
    of an unsalted [65, 7, 9], whose K/V was computed after token 65. The leading -1 of the
    salt block (R4s) rules that out."""
    bm = kit.bm(8, 1)
    prefill(bm, kit.seq([65, 7, 9], 1))  # blocks 0, 1, 2
    salted = kit.seq([7, 9], 1, "A" + "\0" * 7)
    assert prefill(bm, salted) == 0
    assert salted.block_table == [3, 4]


# ---- the hashes, bit for bit -----------------------------------------------------------------


def _int64(tokens: list[int]) -> bytes:
    return np.array(tokens, dtype=np.int64).tobytes()


def _expected_chain(alg: str, blocks: list[list[int]], salt: str | None) -> list[int]:
    """R4 / R4s from their statements in docs/design.md, with numpy, xxhash and hashlib."""

    def h(prefix: int | None, tokens: list[int]) -> int:
        if alg == "xxh64":
            head = b"" if prefix is None else prefix.to_bytes(8, "little")
            return xxhash.xxh64(head + _int64(tokens)).intdigest()
        head = b"" if prefix is None else prefix.to_bytes(32, "big")
        return int.from_bytes(hashlib.sha256(head + _int64(tokens)).digest(), "big")

    prefix = None if salt is None else h(None, [-1, *salt.encode("utf-8")])
    chain = []
    for tokens in blocks:
        prefix = h(prefix, tokens)
        chain.append(prefix)
    return chain


@pytest.mark.parametrize("alg", ["xxh64", "sha256"])
@pytest.mark.parametrize("salt", [None, "tenant", "é"])  # "é": two UTF-8 bytes, not ord()
@pytest.mark.parametrize("side_name", sorted(SIDES))
def test_registered_hashes_follow_r4_and_r4s_through_prefill_and_decode(
    alg: str, salt: str | None, side_name: str
) -> None:
    make_bm, make_seq = SIDES[side_name]
    bm, seq = make_bm(8, 4, alg), make_seq([1, 2, 3, 4, 5], 4, salt)
    prefill(bm, seq)  # registers block 0 (the prefill path)
    for token in (6, 7, 8):  # decode until block 1 fills (the engine's inlined path)
        seq.token_ids.append(token) if isinstance(seq, SpecSequence) else seq.append_token(token)
        bm.may_append(seq)
        seq.num_scheduled_tokens = 1
        bm.hash_blocks(seq)
        seq.num_cached_tokens += 1
    expected = _expected_chain(alg, [[1, 2, 3, 4], [5, 6, 7, 8]], salt)
    state = bm.snapshot()
    assert [state.block_hashes[b] for b in seq.block_table] == expected
    assert sorted(state.hash_to_block) == sorted(zip(expected, seq.block_table, strict=True))
    if alg == "sha256":  # full width: truncating to 64 bits would fail this about always
        assert max(expected).bit_length() > 64


# ---- collisions: what R10 stops and what it does not -----------------------------------------

P, Y, Q, X = [1, 1], [2, 2], [3, 3], [4, 4]


def prefix_blind(tokens: Any, prefix: int | None) -> int:
    """A chain that always collides: a block's hash ignores its prefix (and so the salt)."""
    return xxh64_block_hash(tokens, None)


def test_a_chain_collision_serves_a_block_computed_after_another_prefix(side: Kit) -> None:
    """The residual risk: R10 compares only the block's own tokens. c's block 1 (X after Q)
    collides with b's (X after P), so b is served block 4, whose K/V followed Q."""
    bm = side.bm(16, 2, prefix_blind)
    prefill(bm, side.seq(P + Y + [9], 2))  # blocks 0, 1, 2
    prefill(bm, side.seq(Q + X + [9], 2))  # blocks 3, 4, 5: X registered as block 4
    b = side.seq(P + X + [7], 2)
    assert prefill(bm, b) == 2
    assert b.block_table == [0, 4, 6]


def test_a_chain_collision_defeats_the_salt(side: Kit) -> None:
    """The salt only changes block 0's prefix: a hash blind to prefixes shares across it."""
    bm = side.bm(16, 2, prefix_blind)
    prefill(bm, side.seq(P + Y + [9], 2, "tenant-a"))  # blocks 0, 1, 2
    b = side.seq([*P, 7], 2, "tenant-b")
    assert prefill(bm, b) == 1
    assert b.block_table == [0, 3]


def test_the_same_attacks_need_a_collision_the_real_hashes_do_not_give(kit: Kit) -> None:
    """Under xxh64 (not collision resistant: such a collision can be searched for) or
    sha256 (it would take a sha256 collision), the scenarios above share only P."""
    bm = kit.bm(16, 2)
    prefill(bm, kit.seq(P + Y + [9], 2))  # blocks 0, 1, 2
    prefill(bm, kit.seq(Q + X + [9], 2))  # blocks 3, 4, 5
    b = kit.seq(P + X + [7], 2)
    assert prefill(bm, b) == 1 and b.block_table == [0, 6, 7]
    c = kit.seq([*P, 7], 2, "tenant-b")
    assert prefill(bm, c) == 0 and c.block_table == [8, 9]


def test_a_collision_never_serves_a_block_whose_own_tokens_differ(side: Kit) -> None:
    """R10's guarantee. Every block hashes to 0: a's blocks 0 (P) and 1 (Y) both register
    under 0 and the newer, block 1, keeps the entry; b's block 0 (P) finds block 1, whose
    tokens are Y, so b gets no hit at all, though P sits in block 0: a collision can cost
    hits, not serve wrong tokens."""
    bm = side.bm(16, 2, lambda tokens, prefix: 0)
    prefill(bm, side.seq(P + Y + [9], 2))
    assert dict(bm.snapshot().hash_to_block) == {0: 1}
    b = side.seq(P + X + [7], 2)
    assert prefill(bm, b) == 0 and b.block_table == [3, 4, 5]
    assert max(bm.snapshot().ref_counts) == 1


def test_a_reset_forgets_salted_chains_too(kit: Kit) -> None:
    """R13 under either hash: a salted prompt cached before the reset misses after it."""
    bm = kit.bm(4, 2)
    a = kit.seq([1, 2, 3], 2, "tenant")
    prefill(bm, a)  # blocks 0 (registered under the salted chain) and 1
    bm.deallocate(a)  # free queue 2, 3, 1, 0
    again = kit.seq([1, 2, 3], 2, "tenant")
    assert bm.can_allocate(again) == 1
    assert bm.reset_prefix_cache() is True
    assert bm.snapshot().hash_to_block == ()
    assert prefill(bm, again) == 0 and again.block_table == [2, 3]


# ---- bad input: a clear error, nothing changed -----------------------------------------------


@pytest.mark.parametrize(
    ("salt", "exc", "words"),
    [
        (5, TypeError, "cache_salt must be a str or None, got int"),
        (b"tenant", TypeError, "cache_salt must be a str or None, got bytes"),
        ("", ValueError, "cache_salt must be a non-empty string"),
    ],
)
@pytest.mark.parametrize("side_name", sorted(SIDES))
def test_a_bad_salt_is_refused_and_changes_nothing(
    side_name: str, salt: Any, exc: type[Exception], words: str
) -> None:
    make_bm, make_seq = SIDES[side_name]
    bm = make_bm(8, 4)
    live = make_seq(TOKENS, 4, "tenant")
    prefill(bm, live)
    before = bm.snapshot()
    first = Sequence([1]).seq_id
    with pytest.raises(exc, match=words):
        make_seq(TOKENS, 4, salt)
    assert Sequence([1]).seq_id == first + 1  # the refused sequence took no id
    assert bm.snapshot() == before and live.block_table == [0, 1, 2]


def test_the_engine_sequence_salt_is_read_only() -> None:
    seq = Sequence(TOKENS, block_size=4, cache_salt="tenant")
    with pytest.raises(AttributeError):
        seq.cache_salt = "other"  # type: ignore[misc]
    assert seq.cache_salt == "tenant"


def test_the_salt_stays_out_of_the_compact_worker_state() -> None:
    salted = Sequence(TOKENS, block_size=4, seq_id=1, cache_salt="tenant" * 100)
    plain = Sequence(TOKENS, block_size=4, seq_id=1)
    assert pickle.dumps(salted) == pickle.dumps(plain)
    assert pickle.loads(pickle.dumps(salted)).cache_salt is None  # workers never hash


@pytest.mark.parametrize("alg", ["sha1", "SHA256", "", "xxh64 ", None, 256])
def test_an_unknown_hash_algorithm_is_refused(alg: Any) -> None:
    with pytest.raises(ValueError, match="hash_algorithm must be one of"):
        BlockManager(4, 2, hash_algorithm=alg)


def test_the_config_offers_exactly_the_allocators_hashes() -> None:
    """One list: EngineConfig validates against the table BlockManager picks from."""
    assert PREFIX_CACHE_HASHES is HASH_ALGORITHMS == ("xxh64", "sha256")
    assert get_args(PrefixCacheHash) == HASH_ALGORITHMS
    for alg in HASH_ALGORITHMS:
        assert BlockManager(2, 2, hash_algorithm=alg).hash_algorithm == alg


def test_a_hash_fn_with_another_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="hash_fn replaces hash_algorithm='sha256'"):
        BlockManager(4, 2, hash_fn=prefix_blind, hash_algorithm="sha256")


@pytest.mark.parametrize("alg", ["xxh64", "sha256"])
def test_the_engine_builds_its_allocator_with_the_configured_hash(alg: Any) -> None:
    config = EngineConfig(
        max_num_batched_tokens=32,
        max_num_seqs=4,
        max_model_len=32,
        kvcache_block_size=4,
        num_kvcache_blocks=8,
        prefix_cache_hash=alg,
    )
    engine = LLMEngine(FakeModelRunner(8, 4, 64), config, vocab_size=64)
    bm = engine.block_manager
    assert isinstance(bm, BlockManager) and bm.hash_algorithm == alg
    seq = Sequence(TOKENS, block_size=4)
    prefill(bm, seq)
    assert bm.snapshot().block_hashes[0] == _expected_chain(alg, [TOKENS[:4]], None)[0]
