"""A ``Sequence`` pickled for a worker is the sequence the model runner needs.

While prefilling, the compact state carries the token ids; while decoding, only the
counters, the block table and the last token. Each step's sequences go through the
tensor-parallel hand-off as a worker receives them (``handoff.encode`` of a
``StepMessage``, unpickled, ``restore()``d) and are checked twice: every carried field
equals the original's, and ``ModelRunner.prepare`` on the worker-side copies builds
exactly the ``Batch`` it builds from the originals (every tensor equal in dtype, shape and
value; every other field equal). Counter values are all distinct, so a state that swaps
any two counters (the mutants at the end) changes what the worker sees.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine.config import EngineConfig
from paged_engine.engine.sequence import Sequence, SequenceStatus
from paged_engine.sampling_params import SamplingParams
from paged_engine.worker.handoff import StepMessage, encode
from paged_engine.worker.model_runner import Batch, ModelRunner

BLOCK_SIZE = 4
CARRIED = (
    "seq_id",
    "block_size",
    "num_tokens",
    "num_prompt_tokens",
    "num_cached_tokens",
    "num_scheduled_tokens",
    "block_table",
    "last_token",
    "is_prefill",
)
"""What the compact state carries, directly or (``is_prefill``) by its form."""


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    config = EngineConfig(
        num_kvcache_blocks=64,
        max_model_len=128,
        kvcache_block_size=BLOCK_SIZE,
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        num_threads=None,  # leave the process's torch threads alone
    )
    return ModelRunner(tiny_model_dir, config)


def make_seq(
    seq_id: int,
    prompt: int,
    generated: int,
    cached: int,
    scheduled: int,
    table: list[int],
    *,
    prefill: bool,
    prompt_logprobs: int | None = None,
) -> Sequence:
    """A sequence in the middle of a step: ``prompt`` + ``generated`` tokens, ``cached``
    of them in the cache, ``scheduled`` computed now, holding ``table``."""
    params = SamplingParams(prompt_logprobs=prompt_logprobs)
    tokens = [(7 * i + seq_id) % 500 + 3 for i in range(prompt)]
    seq = Sequence(tokens, params, block_size=BLOCK_SIZE)
    seq.seq_id = seq_id
    for i in range(generated):
        seq.append_token(600 + i + seq_id % 50)
    seq.num_cached_tokens = cached
    seq.num_scheduled_tokens = scheduled
    seq.block_table = list(table)
    seq.is_prefill = prefill
    seq.status = SequenceStatus.RUNNING
    assert len(seq.block_table) == seq.num_blocks or not prefill
    return seq


def prefill_batch() -> list[Sequence]:
    """Counters differ from each other within every sequence (and from the block size)."""
    return [
        # a whole prompt at once, no prefix hit
        make_seq(1001, 10, 0, 0, 10, [9, 2, 30], prefill=True),
        # a middle chunk after a 2-block prefix hit: samples nothing
        make_seq(1002, 21, 0, 8, 5, [4, 17, 5, 6, 22, 23], prefill=True),
        # recomputing a preempted sequence (prompt + 5 generated) after a 1-block hit,
        # asking for prompt logprobs (the hand-off carries that request)
        make_seq(1003, 14, 5, 4, 15, [40, 41, 42, 43, 44], prefill=True, prompt_logprobs=2),
    ]


def decode_batch() -> list[Sequence]:
    # decode: every token but the newest (sampled last step) is cached
    return [
        make_seq(2001, 14, 6, 19, 1, [50, 51, 52, 53, 54], prefill=False),
        make_seq(2002, 9, 3, 11, 1, [60, 61, 62], prefill=False),
        make_seq(2003, 6, 11, 16, 1, [8, 7, 3, 1, 0], prefill=False),
    ]


def round_trip(seqs: list[Sequence], is_prefill: bool) -> list[Sequence]:
    """What a worker rank runs: the step message rank 0 sends, as the worker reads it."""
    message = pickle.loads(encode(StepMessage.of(seqs, is_prefill)))
    assert isinstance(message, StepMessage) and message.is_prefill == is_prefill
    return message.restore()


def assert_carried_fields(original: Sequence, worker: Sequence) -> None:
    for name in CARRIED:
        want, got = getattr(original, name), getattr(worker, name)
        assert got == want, f"seq {original.seq_id}: {name} {got!r} after pickling, was {want!r}"
    assert len(worker) == len(original)
    assert worker.status is SequenceStatus.RUNNING
    # prefill carries every token id; decode none (the worker only needs the last one)
    assert worker.token_ids == (original.token_ids if original.is_prefill else [])


def _plain(value: object) -> object:
    """A tensor as (dtype, shape, values), so that ``==`` compares tensors exactly."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape), value.tolist())
    return value


def batch_fields(batch: Batch) -> dict[str, object]:
    fields = {f.name: _plain(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
    meta = fields.pop("meta")
    for f in dataclasses.fields(meta):  # type: ignore[arg-type]
        fields[f"meta.{f.name}"] = _plain(getattr(meta, f.name))
    return fields


def assert_same_batch(
    runner: ModelRunner, originals: list[Sequence], workers: list[Sequence], is_prefill: bool
) -> None:
    want = batch_fields(runner.prepare(originals, is_prefill))
    got = batch_fields(runner.prepare(workers, is_prefill))
    assert got.keys() == want.keys()
    differ = [k for k in want if got[k] != want[k]]
    assert not differ, f"the worker-side batch differs in {differ}"


def check_round_trip(runner: ModelRunner, seqs: list[Sequence], is_prefill: bool) -> None:
    workers = round_trip(seqs, is_prefill)
    for original, worker in zip(seqs, workers, strict=True):
        assert_carried_fields(original, worker)
    assert_same_batch(runner, seqs, workers, is_prefill)


@pytest.mark.parametrize(("batch", "is_prefill"), [(prefill_batch, True), (decode_batch, False)])
def test_the_worker_side_sequence_builds_the_same_batch(
    runner: ModelRunner, batch: Callable[[], list[Sequence]], is_prefill: bool
) -> None:
    seqs = batch()
    check_round_trip(runner, seqs, is_prefill)
    # the batch really depends on the counters: the sampled rows, and the rows computed
    prepared = runner.prepare(seqs, is_prefill)
    if is_prefill:
        assert prepared.sampling == (0, 2)  # the middle chunk finishes no prompt
        assert prepared.input_ids.numel() == 10 + 5 + 15
        # rows 15.. hold positions 4..12, which predict prompt tokens 5..13
        assert prepared.prompt_spans == ((2, 15, 4, 9),)
    else:
        assert prepared.sampling == (0, 1, 2)
        assert prepared.input_ids.tolist() == [s.last_token for s in seqs]


# ---- mutants: pickling that swaps two counters ------------------------------------------

COUNTERS = CARRIED[:6]
"""The compact state's first six entries, in ``__getstate__``'s order."""


def _swapping(i: int, j: int) -> Callable[[Sequence], tuple[Any, ...]]:
    real = Sequence.__getstate__

    def getstate(self: Sequence) -> tuple[Any, ...]:
        state = list(real(self))
        state[i], state[j] = state[j], state[i]
        return tuple(state)

    return getstate


PAIRS = list(itertools.combinations(range(len(COUNTERS)), 2))


@pytest.mark.parametrize(("batch", "is_prefill"), [(prefill_batch, True), (decode_batch, False)])
@pytest.mark.parametrize(("i", "j"), PAIRS, ids=[f"{COUNTERS[i]}-{COUNTERS[j]}" for i, j in PAIRS])
def test_a_pickle_that_swaps_two_counters_is_caught(
    monkeypatch: pytest.MonkeyPatch,
    runner: ModelRunner,
    batch: Callable[[], list[Sequence]],
    is_prefill: bool,
    i: int,
    j: int,
) -> None:
    monkeypatch.setattr(Sequence, "__getstate__", _swapping(i, j))
    with pytest.raises(AssertionError, match="after pickling"):
        check_round_trip(runner, batch(), is_prefill)


def test_the_batch_comparison_alone_sees_a_step_counter_swap(
    monkeypatch: pytest.MonkeyPatch, runner: ModelRunner
) -> None:
    """The second check can fail too: decode states with ``num_cached_tokens`` and
    ``num_scheduled_tokens`` swapped make the runner compute 19 positions instead of 1.
    (Most other swaps make ``prepare`` raise instead, so the field check comes first.)"""
    seqs = decode_batch()
    monkeypatch.setattr(Sequence, "__getstate__", _swapping(4, 5))
    workers = round_trip(seqs, is_prefill=False)
    with pytest.raises(AssertionError, match="worker-side batch differs"):
        assert_same_batch(runner, seqs, workers, is_prefill=False)
