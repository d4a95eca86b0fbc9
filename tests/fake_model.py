"""A deterministic fake model that really uses the paged KV cache.

Each step it writes the scheduled tokens into their cache slots (through the block table,
with the same slot arithmetic as the real runner) and then reads the sequence's whole
context back through the block table; the next token is a hash of what it read. So any
scheduling or allocation bug that puts a token in the wrong slot, shares a block with the
wrong content or skips a computation changes the output, exactly as it would with a real
model, and ``reference_generate`` (no cache, no scheduler) is the oracle.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

import xxhash

from paged_engine.engine.indexing import slot_mapping
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams


def next_token(context: SequenceABC[int], vocab_size: int) -> int:
    return xxhash.xxh64_intdigest(repr(list(context)).encode()) % vocab_size


def reference_generate(
    prompt: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    eos_token_id: int | None,
    max_model_len: int,
) -> tuple[list[int], str]:
    """What the engine must produce for one request: the fake model run alone."""
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens, vocab_size)
        tokens.append(t)
        out.append(t)
        if (not params.ignore_eos and t == eos_token_id) or t in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


class Fault:
    """Arms a fake to raise ``error`` at its ``at``-th opportunity (0 is the first)."""

    def __init__(self) -> None:
        self.at: int | None = None
        self.error: type[BaseException] = RuntimeError
        self.fired = 0

    def arm(self, at: int, error: type[BaseException]) -> None:
        self.at, self.error = at, error

    def disarm(self) -> None:
        self.at = None

    def tick(self, where: str) -> None:
        """One opportunity: raise if it is the armed one (then disarm)."""
        if self.at is None:
            return
        if self.at == 0:
            self.at = None
            self.fired += 1
            raise self.error(f"injected fault in {where}")
        self.at -= 1


class FakeTokenizer:
    """Token ids to text (``"<3><1>"``), with a fault that can be armed in ``decode``."""

    def __init__(self) -> None:
        self.fault = Fault()

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.strip("<>").split("><")]

    def decode(self, token_ids: SequenceABC[int], skip_special_tokens: bool = True) -> str:
        self.fault.tick("decode")
        return "".join(f"<{t}>" for t in token_ids)


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.cache: list[int | None] = [None] * (num_blocks * block_size)
        self.batches: list[tuple[bool, list[tuple[int, int]]]] = []
        """Every step's (is_prefill, [(seq_id, num_scheduled_tokens)])."""
        self.fault = Fault()
        """Opportunities: before each cache write, and once after the step's last."""
        self.calls = 0

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        self.calls += 1
        self.batches.append((is_prefill, [(s.seq_id, s.num_scheduled_tokens) for s in seqs]))
        out = self._run(seqs)
        self.fault.tick("the model, after its last write")
        return out

    def _run(self, seqs: list[Sequence]) -> list[int]:
        out = []
        for seq in seqs:
            start = seq.num_cached_tokens
            end = start + seq.num_scheduled_tokens
            assert end <= seq.num_tokens, f"scheduled past the sequence: {seq}"
            bs = self.block_size
            slots = slot_mapping(seq.block_table, bs, start, end)
            for pos, slot in zip(range(start, end), slots, strict=True):
                self.fault.tick("the model, mid-write")  # K/V partly written
                self.cache[slot] = seq.token_ids[pos]
            context = [self.cache[s] for s in slot_mapping(seq.block_table, bs, 0, end)]
            assert None not in context, f"read a slot never written: {seq}"
            out.append(next_token(context, self.vocab_size))  # type: ignore[arg-type]
        return out
