"""The benchmark is only a comparison if both allocators do the same work.

Driven by the same loop over the same trace, spec and engine must produce identical
``Stats`` (steps, preemptions, hits, and the block tables of whatever still holds blocks)
and identical allocator snapshots (R11), complete or stopped mid-run. These are plain
tests; they run in the ``bench`` env before the timings, and take a few seconds.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.allocators import ENGINE, SPEC, Kit
from bench.scenarios import SCENARIOS, TRACE, Scenario, trace
from bench.sim import Stats, materialize, run_trace, run_waves
from bench.traces import Trace, TraceConfig, make_trace, trace_summary
from tests.lockstep import assert_same_record

SHORT = 2
"""Waves of the benchmark trace replayed here: enough for revivals, sharing and preemption."""
STEP_GUARD = 50_000
"""A run "to the end" stops here at the latest, at least ten times the steps any run here
needs (checked), so a loop that stops making progress fails a check instead of hanging."""


def _run(
    kit: Kit,
    the_trace: Trace,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_steps: int | None = None,
) -> tuple[Stats, Any, list[Any]]:
    waves = materialize(the_trace, kit.make_seq, block_size)
    bm = kit.make_bm(num_blocks, block_size)
    stats = run_waves(
        waves,
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_steps=STEP_GUARD if max_steps is None else max_steps,
    )
    if max_steps is None:  # drained well within the guard (at most a tenth of it)
        assert stats.steps * 10 <= STEP_GUARD, f"step guard: {kit.name} took {stats.steps} steps"
    return stats, bm, [req.seq for wave in waves for req in wave]


def _assert_agree(*args: Any, check_spec_invariants: bool = True) -> Stats:
    spec_stats, spec_bm, spec_seqs = _run(SPEC, *args)
    engine_stats, engine_bm, engine_seqs = _run(ENGINE, *args)
    assert engine_stats == spec_stats
    # Field by field: the spec's snapshot is its own record (spec/records.py), not the engine's.
    assert_same_record(spec_bm.snapshot(), engine_bm.snapshot(), "snapshots")
    assert [s.num_cached_tokens for s in engine_seqs] == [s.num_cached_tokens for s in spec_seqs]
    engine_bm.check_invariants(engine_seqs)
    if check_spec_invariants:  # the spec's check is O(pool^2): small pools only
        spec_bm.check_invariants(spec_seqs)
    return engine_stats


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda sc: sc.name)
@pytest.mark.parametrize("max_steps", [60, 250, None], ids=["60", "250", "end"])
def test_benchmark_scenarios_agree(scenario: Scenario, max_steps: int | None) -> None:
    short = trace(TRACE)[:SHORT]
    stats = _assert_agree(
        short,
        scenario.block_size,
        scenario.num_blocks,
        scenario.max_num_seqs,
        scenario.max_num_batched_tokens,
        max_steps,
        check_spec_invariants=scenario.num_blocks <= 4_096,
    )
    if max_steps is None:
        assert stats.finished == trace_summary(short)["requests"]
        assert stats.final_tables == ()
        assert stats.hit_tokens > 0
    else:
        assert stats.steps == max_steps
        assert stats.final_tables  # stopped mid-wave: tables to compare
    if scenario.name.endswith("preempt") and max_steps is None:
        assert stats.preemptions > 0


SMALL = TraceConfig(
    num_waves=5,
    requests_per_wave=(3, 9),
    library_size=3,
    prefixes_per_wave=(1, 2),
    prefix_len=(8, 60),
    suffix_len=(0, 12),
    output_len=(1, 30),
    vocab_size=7,  # tiny vocabulary: suffixes collide, so hits also come from luck
    seed=5,
)


@pytest.mark.parametrize(
    ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"),
    [(1, 100, 4, 16), (3, 40, 8, 7), (4, 30, 16, 64), (16, 12, 3, 1000)],
)
def test_tight_pools_agree(
    block_size: int, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int
) -> None:
    """Odd block sizes, tiny budgets (every prompt chunked) and constant preemption."""
    the_trace = make_trace(SMALL)
    args = (the_trace, block_size, num_blocks, max_num_seqs, max_num_batched_tokens)
    for stop in (7, 31, None):
        stats = _assert_agree(*args, stop)
    requests = trace_summary(the_trace)["requests"]
    assert stats.finished == requests
    # Every preemption costs one more admission; prefill steps beyond those are chunks.
    admissions = requests + stats.preemptions
    longest = max(len(r.prompt) for wave in the_trace for r in wave)
    if max_num_batched_tokens < longest:
        assert stats.prefill_seq_steps > admissions


def test_run_trace_builds_fresh_state() -> None:
    """``run_trace`` (trace in, stats out) equals the prebuilt path and repeats exactly."""
    the_trace = make_trace(SMALL)
    first = run_trace(the_trace, ENGINE.make_bm, ENGINE.make_seq, 4, 30, 16, 64)
    again = run_trace(the_trace, ENGINE.make_bm, ENGINE.make_seq, 4, 30, 16, 64)
    assert first == again == _run(ENGINE, the_trace, 4, 30, 16, 64)[0]


def test_preemption_happens_in_tight_pool() -> None:
    the_trace = make_trace(SMALL)
    stats, _, _ = _run(ENGINE, the_trace, 4, 30, 16, 64)
    assert stats.preemptions > 0


def test_pool_too_small_is_reported() -> None:
    one_long = make_trace(
        TraceConfig(
            num_waves=1,
            requests_per_wave=(1, 1),
            library_size=1,
            prefixes_per_wave=(1, 1),
            prefix_len=(40, 40),
            suffix_len=(0, 0),
        )
    )
    with pytest.raises(RuntimeError, match="too small"):
        _run(ENGINE, one_long, 4, 5, 8, 64)


def test_trace_is_deterministic_and_in_range() -> None:
    config = TraceConfig(num_waves=4, seed=11)
    a, b = make_trace(config), make_trace(config)
    assert a == b
    assert make_trace(TraceConfig(num_waves=2, seed=11)) == a[:2]  # shorter = prefix
    for wave in a:
        assert config.requests_per_wave[0] <= len(wave) <= config.requests_per_wave[1]
        assert len({r.prefix_id for r in wave}) <= config.prefixes_per_wave[1]
        for r in wave:
            assert config.prefix_len[0] + config.suffix_len[0] <= len(r.prompt)
            assert len(r.prompt) <= config.prefix_len[1] + config.suffix_len[1]
            assert config.output_len[0] <= len(r.output) <= config.output_len[1]
            assert all(0 <= t < config.vocab_size for t in r.prompt + r.output)


def test_benchmark_trace_revisits_prefixes() -> None:
    """Revival needs prefixes that recur in later waves."""
    summary = trace_summary(trace(TRACE))
    assert summary["prefix_revisits"] >= TRACE.num_waves // 2
