"""Spec == engine under random scheduler traffic (the lockstep machine)."""

from __future__ import annotations

from paged_engine.engine.block_manager import xxh64_block_hash
from tests.allocator_machine import make_machine


def _colliding_hash(token_ids, prefix):  # type: ignore[no-untyped-def]
    # Eight hash values in all: collisions between different blocks are everywhere, so
    # the token verification (R10) decides every lookup.
    return xxh64_block_hash(token_ids, prefix) % 8


TestAllocatorLockstep = make_machine().TestCase
TestAllocatorLockstepCollidingHash = make_machine(hash_fn=_colliding_hash).TestCase
TestAllocatorLockstepSmallBlocks = make_machine(block_sizes=(1, 2), max_pool=6).TestCase
