"""Evidence that the CrossHair layer can fail: broken twins, broken contracts, empty runs.

Each test runs the driver's own job functions (``scripts/run_crosshair.py``: one CrossHair
subprocess each) on a deliberately wrong target defined below, and asserts that the job
fails for the right reason. The wrong targets live in this module so that CrossHair, in
its own process, can import them as ``tests.test_crosshair.<name>``.
"""

from __future__ import annotations

import pytest

from scripts.run_crosshair import CheckJob, DiffJob, JobResult, run_check, run_diff
from spec.block_manager import BlockManager
from spec.crosshair_targets import (
    MAX_BLOCK_SIZE,
    MAX_BLOCKS,
    SHARE_MAX_PROMPT,
    SHARE_MAX_TAIL,
    TOKEN_PATTERNS,
    SharingOutcome,
    prefill_then_decode,
    prefill_then_decode_inputs,
    run_share_prefix,
    share_prefix,
    share_prefix_inputs,
)
from spec.diff_targets import count_domain, slot_domain
from spec.sequence import SpecSequence

pytestmark = pytest.mark.small_scope

# Named by the pre: lines of share_prefix_on_last_block_lookup, which CrossHair evaluates
# in this module's globals.
_CONTRACT_BOUNDS = (MAX_BLOCKS, MAX_BLOCK_SIZE, SHARE_MAX_PROMPT, SHARE_MAX_TAIL, TOKEN_PATTERNS)

_HERE = "tests.test_crosshair"


# ---- broken twins for diffbehavior --------------------------------------------------------


def nano_needs_new_block(num_tokens: int, block_size: int) -> bool | None:
    """nano-vllm's decode-growth test, ``len % bs == 1``: never true when ``bs == 1``."""
    if not count_domain(num_tokens, block_size, 1):
        return None
    return num_tokens % block_size == 1


def slot_mapping_last_block_off_by_one(
    block_table: list[int], block_size: int, start: int, end: int
) -> list[int] | None:
    """The engine's per-block slot mapping with ``last = end // block_size``: one block too
    far whenever ``end`` is a block boundary (an empty range there, or past the table)."""
    if not slot_domain(block_table, block_size, start, end):
        return None
    slots: list[int] = []
    first, last = start // block_size, end // block_size
    for i in range(first, last + 1):
        base = block_table[i] * block_size
        lo = start - i * block_size if i == first else 0
        hi = end - i * block_size if i == last else block_size
        slots.extend(range(base + lo, base + hi))
    return slots


def slot_mapping_skips_first_offset(
    block_table: list[int], block_size: int, start: int, end: int
) -> list[int] | None:
    """Forgets that the range may start inside its first block (``lo = 0`` always):
    right for every range that starts on a block boundary, wrong for the others."""
    if not slot_domain(block_table, block_size, start, end):
        return None
    slots: list[int] = []
    first, last = start // block_size, (end - 1) // block_size
    for i in range(first, last + 1):
        base = block_table[i] * block_size
        hi = end - i * block_size if i == last else block_size
        slots.extend(range(base, base + hi))
    return slots


def _diff(fn1: str, helper: str, timeout: float = 4) -> JobResult:
    return run_diff(
        DiffJob(f"mutant {fn1}", f"{_HERE}.{fn1}", f"spec.diff_targets.{helper}_spec", timeout)
    )


def _assert_difference(result: JobResult, *needles: str) -> None:
    (row,) = result.rows
    assert not result.ok and row.counterexamples >= 1, result.run.stdout + result.run.stderr
    for needle in needles:
        assert needle in result.run.stdout, result.run.stdout


def test_diff_catches_nano_decode_rule() -> None:
    """R7: the two rules part exactly at ``block_size == 1``; diffbehavior must say so."""
    _assert_difference(_diff("nano_needs_new_block", "needs_new_block"), "block_size=1")


# slot_mapping is searched, not proved: 4 CPU seconds found these in most runs but not
# all; 8 found them in every run tried.
def test_diff_catches_slot_mapping_off_by_one() -> None:
    _assert_difference(_diff("slot_mapping_last_block_off_by_one", "slot_mapping", 8))


def test_diff_catches_slot_mapping_unaligned_start() -> None:
    _assert_difference(_diff("slot_mapping_skips_first_offset", "slot_mapping", 8))


def test_diff_of_the_real_pair_passes() -> None:
    """The control: the same job on the real engine helper is a proof, not a failure."""
    result = run_diff(
        DiffJob(
            "needs_new_block",
            "tests.test_spec_diff_targets.needs_new_block_engine",
            "spec.diff_targets.needs_new_block_spec",
            4,
            must_exhaust=True,
        )
    )
    assert result.ok and result.rows[0].confirmed == 1, result.run.stdout + str(result.rows)


# ---- broken contracts and implementations for check ----------------------------------------


def floor_num_blocks(num_tokens: int, block_size: int) -> int:
    """``spec.indexing.num_blocks``'s contract over floor division: a partial last block
    gets no block.

    pre: num_tokens >= 0
    pre: block_size >= 1
    post: __return__ * block_size >= num_tokens
    post: __return__ == 0 or (__return__ - 1) * block_size < num_tokens
    """
    return num_tokens // block_size


def unsatisfiable(num_tokens: int) -> int:
    """A contract CrossHair can never enter: it reports "Unable to meet precondition" as
    info and exits 0, having checked nothing.

    pre: num_tokens > 0 and num_tokens < 0
    post: __return__ == num_tokens
    """
    return num_tokens


class LastBlockLookup(BlockManager):
    """R5 broken: the prefix lookup also looks up the sequence's last block, so a fully
    cached prompt would leave prefill nothing to compute."""

    def _lookup(self, seq: SpecSequence) -> list[int]:
        hits: list[int] = []
        h = None
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            h = self.hash_fn(tokens, h)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
        return hits


def share_prefix_on_last_block_lookup(
    num_blocks: int,
    block_size: int,
    pattern: int,
    prompt_len: int,
    cut: int,
    tail_len: int,
    tail_token: bool,
    release_first: bool,
) -> SharingOutcome:
    """``spec.crosshair_targets.share_prefix``, contract and all, on the broken allocator.

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
    return run_share_prefix(LastBlockLookup, *args, release_first)


def _check(target: str, timeout: float = 3) -> JobResult:
    return run_check(CheckJob(f"mutant {target}", (f"{_HERE}.{target}",), timeout))


def test_check_catches_floor_num_blocks() -> None:
    result = _check("floor_num_blocks")
    (row,) = result.rows
    assert not result.ok and row.counterexamples >= 1, result.run.stdout
    assert result.run.returncode == 1


def test_check_catches_broken_allocator_in_a_scenario() -> None:
    """The scenario code of spec.crosshair_targets catches an R5 bug that only shows once
    a prompt has been computed and is looked up again."""
    result = _check("share_prefix_on_last_block_lookup", timeout=8)
    (row,) = result.rows
    assert not result.ok and row.counterexamples == 1, result.run.stdout
    assert "R5" in result.run.stdout, result.run.stdout


def test_scenarios_hold_on_every_bounded_input() -> None:
    """The scenarios' domains are small enough to run whole (about half a second): every
    input meets every rule, so a CrossHair counterexample there is an allocator bug."""
    sharing = [share_prefix(*args) for args in share_prefix_inputs()]
    decoding = [prefill_then_decode(*args) for args in prefill_then_decode_inputs()]
    assert len(sharing) == 10_800 and len(decoding) == 288
    assert all(outcome.broken == () for outcome in sharing + decoding)
    assert sum(o.hits is not None and o.hits > 0 for o in sharing) > 1000  # sharing happens


def test_scenarios_catch_the_broken_allocator_on_some_bounded_input() -> None:
    broken = [run_share_prefix(LastBlockLookup, *args) for args in share_prefix_inputs()]
    assert any("R5 can_allocate range" in o.broken for o in broken)


def test_check_fails_when_nothing_was_analysed() -> None:
    """CrossHair exits 0 here; the driver must still fail."""
    result = _check("unsatisfiable", timeout=1)
    assert result.run.returncode == 0, result.run.stdout
    assert "Unable to meet precondition" in result.run.stdout
    assert not result.ok
    (row,) = result.rows
    assert any("checked on only 0 path" in p for p in row.problems), row.problems


def test_check_fails_on_a_target_without_contracts() -> None:
    result = run_check(CheckJob("no contracts", ("spec.diff_targets.count_domain",), 1))
    assert result.run.returncode == 0
    assert not result.ok and "no condition found in the targets" in result.problems
