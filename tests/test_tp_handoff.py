"""The step hand-off: what a step costs in bytes, and the shared-memory channel.

A decoding sequence's pickle carries counters, the block table and the last token, never
its token ids: its size does not grow with the sequence (checked against the same
sequences 100 times longer, and against a bound worked out by hand from pickle's
opcodes). The shared-memory channel delivers a step's message to a reader (here in this
process) that the model runner then runs, in both states; a message larger than the
segment moves to a bigger one; a reader whose parent is gone stops waiting. That the
worker-side sequences build the same batch as the originals is tests/test_pickling.py.
"""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path

import pytest

from paged_engine.config import EngineConfig
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams
from paged_engine.worker import handoff
from paged_engine.worker.handoff import ShmChannel, ShmReader, StepMessage, encode
from paged_engine.worker.model_runner import ModelRunner

BLOCK = 16


def decoding(seq_id: int, prompt: int, generated: int, table: list[int]) -> Sequence:
    seq = Sequence([3 + (7 * i) % 700 for i in range(prompt)], block_size=BLOCK, seq_id=seq_id)
    for i in range(generated):
        seq.append_token(5 + i % 600)
    seq.num_cached_tokens = seq.num_tokens - 1
    seq.num_scheduled_tokens = 1
    seq.block_table = table
    seq.is_prefill = False
    return seq


def batch(length: int) -> list[Sequence]:
    """8 decoding sequences of ``length`` tokens, block tables of 10 ids each (the same
    tables whatever the length, so only the token count differs between batches)."""
    return [decoding(100 + i, length - 4, 4, list(range(10 * i, 10 * i + 10))) for i in range(8)]


def test_a_decode_hand_off_carries_no_token_lists() -> None:
    short, long = batch(40), batch(4000)
    small = len(encode(StepMessage.of(short, is_prefill=False)))
    big = len(encode(StepMessage.of(long, is_prefill=False)))
    tokens = len(pickle.dumps([s.token_ids for s in long], protocol=pickle.HIGHEST_PROTOCOL))
    print(f"decode step of 8 x 4000 tokens: {big} bytes; their token lists alone: {tokens}")
    # 100x the tokens: each sequence's counters grow from 1- to 2-byte ints, nothing else
    assert big - small <= 8 * 4
    # A bound from pickle's opcodes: per sequence at most 8 ints of 9 bytes (counters and
    # last token), 10 block ids of 5 bytes plus list framing (4), the state tuple and the
    # object (16), 48 for the message and the class references once.
    assert big <= 8 * (8 * 9 + 10 * 5 + 4 + 16) + 48 + 64
    # Pickled with its token list, each sequence would add 2-3 bytes per token.
    assert tokens > 8 * 2 * 3990 > 20 * big


def test_a_prefill_hand_off_carries_the_token_ids() -> None:
    seqs = batch(400)
    for s in seqs:
        s.is_prefill = True
    size = len(encode(StepMessage.of(seqs, is_prefill=True)))
    assert size > 8 * 2 * 400  # at least two bytes per token id


def test_prompt_logprob_requests_travel_with_a_prefill_step() -> None:
    asks = Sequence([1, 2, 3], SamplingParams(prompt_logprobs=3), block_size=BLOCK)
    plain = Sequence([4, 5], block_size=BLOCK)
    message = StepMessage.of([plain, asks], is_prefill=True)
    assert message.params == ((1, (("prompt_logprobs", 3),)),)
    workers = pickle.loads(encode(message)).restore()
    assert [s.sampling_params.prompt_logprobs for s in workers] == [None, 3]
    assert StepMessage.of([plain, asks], is_prefill=False).params == ()


def test_sampling_params_stay_on_rank_0() -> None:
    """Workers never sample (``Sequence.__getstate__`` drops the params on purpose): the
    pickle names no ``SamplingParams`` and the worker-side sequence has the defaults."""
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=9, seed=3, stop=["x"])
    seq = decoding(1, 20, 2, [0, 1])
    seq.sampling_params = params
    data = encode(StepMessage.of([seq], is_prefill=False))
    assert b"SamplingParams" not in data and b"temperature" not in data
    (worker,) = pickle.loads(data).restore()
    assert worker.sampling_params == SamplingParams()
    assert seq.sampling_params is params  # pickling left rank 0's sequence as it was


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    config = EngineConfig(
        num_kvcache_blocks=64,
        max_model_len=128,
        kvcache_block_size=BLOCK,
        device="cpu",
        dtype="float32",
        attention_backend="torch",
        num_threads=None,
    )
    return ModelRunner(tiny_model_dir, config)


def test_the_shm_channel_delivers_steps_the_runner_runs(runner: ModelRunner) -> None:
    signal = multiprocessing.get_context("spawn").Semaphore(0)
    channel = ShmChannel([signal], size=256)  # small: the prefill message moves segments
    reader = ShmReader(channel.name, signal, lambda: True)
    try:
        table = [4, 9, 2, 30, 31, 12, 13]
        prompt = Sequence(list(range(300, 400)), block_size=BLOCK, seq_id=7)
        prompt.num_scheduled_tokens = 100
        prompt.block_table = list(table)
        first = channel.segment.name
        channel.send(StepMessage.of([prompt], is_prefill=True))
        assert channel.segment.name != first  # 100 3-byte token ids do not fit in 256 bytes
        got = reader.receive()
        assert got is not None and got.is_prefill
        (seq,) = got.restore()
        assert (seq.seq_id, seq.token_ids, seq.block_table) == (7, prompt.token_ids, table)
        runner.run_worker([seq], is_prefill=True)  # writes K/V into the table's blocks
        prompt.append_token(11)
        prompt.num_cached_tokens, prompt.num_scheduled_tokens = 100, 1
        prompt.is_prefill = False
        channel.send(StepMessage.of([prompt], is_prefill=False))
        assert not Path("/dev/shm", first.lstrip("/")).exists()  # retired, then unlinked
        got = reader.receive()
        assert got is not None and not got.is_prefill
        (seq,) = got.restore()
        assert (seq.token_ids, seq.last_token, seq.num_tokens) == ([], 11, 101)
        runner.run_worker([seq], is_prefill=False)
        channel.send(None)
        assert reader.receive() is None
    finally:
        reader.close()
        channel.close()
    assert not Path("/dev/shm", channel.name.lstrip("/")).exists()


def test_a_reader_whose_parent_died_stops_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "WAIT_POLL_S", 0.01)
    signal = multiprocessing.get_context("spawn").Semaphore(0)
    channel = ShmChannel([signal])
    checks = []

    def parent_alive() -> bool:
        checks.append(1)
        return len(checks) < 3

    reader = ShmReader(channel.name, signal, parent_alive)
    try:
        assert reader.receive() is None  # nothing was sent; the parent "died"
        assert len(checks) == 3
    finally:
        reader.close()
        channel.close()
