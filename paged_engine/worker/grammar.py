"""Rank 0's grammar matchers for structured outputs: the compiled grammars, one matcher per
sequence, and each step's bitmask of allowed tokens.

Why here: ``engine/`` must never import torch or xgrammar, and the sampler runs on rank 0
alone (``sampling_step.py``), so the matchers live beside it, owned by the runner, as the
per-request generators do. The engine tells the runner nothing but the scheduled
sequences, so the state is kept honest by the sequences themselves: a matcher records
the output tokens it has consumed, and before each mask it is checked against the
sequence's own output (its length and last token). Whatever the engine did in between
(a failed step that dropped the sampled tokens, a preemption that recomputes, a restart)
a matcher that disagrees is rebuilt by replaying the sequence's output, which is always
correct. The same rule frees matchers: one not used for ``STALE_STEPS`` steps (its request
finished, was aborted, or waits) is dropped, and rebuilt if its sequence comes back.

Compiling a grammar against the vocabulary is the costly part (milliseconds to seconds for
a large schema): ``prepare`` starts it on a background thread as soon as the step's
sequences are known, before the forward pass, and the mask waits for it only if the
forward pass was shorter. Compiled grammars are cached by the constraint's key; the
tokenizer's vocabulary is compiled once, on the first structured request.

Each completion of an ``n > 1`` request is its own sequence, with its own matcher.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paged_engine.engine.outputs import FailedSample
from paged_engine.engine.sequence import Sequence as EngineSequence
from paged_engine.layers.grammar_mask import BITS, TokenMask
from paged_engine.structured_outputs import grammar_of

__all__ = ["STALE_STEPS", "StructuredOutputs"]

STALE_STEPS = 64
"""A matcher unused for this many steps is dropped (rebuilt by replay if needed)."""
MAX_COMPILED = 128
"""Compiled grammars kept (least recently used dropped first)."""

Key = tuple[str, str]


@dataclass(slots=True)
class _Matcher:
    """One sequence's matcher and what it consumed: the check that it still agrees with the
    sequence (the engine may drop tokens the matcher accepted)."""

    key: Key
    matcher: Any
    accepted: list[int] = field(default_factory=list)
    last_step: int = 0


class StructuredOutputs:
    """The matchers of one runner (rank 0). ``vocab_size`` is the width of the model's
    logits; ``eos_token_ids`` are the engine's stops, which become the grammar's, so a
    finished grammar can only end on a token the engine stops at (finish_reason "stop").
    The tokenizer is ``tokenizer_dir``'s unless ``tokenizer`` is set (by the engine that
    built the runner, from its own tokenizer argument)."""

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: Collection[int],
        tokenizer_dir: Path,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer: Any = None
        self.tokenizer_dir = tokenizer_dir
        self._compiler: Any = None
        self._compiled: OrderedDict[Key, Future[Any]] = OrderedDict()
        self._matchers: dict[int, _Matcher] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._step = 0

    # ---- compiling ------------------------------------------------------------------------

    def prepare(self, seqs: Sequence[EngineSequence]) -> None:
        """Start compiling, off this thread, every grammar of ``seqs`` not compiled yet."""
        for seq in seqs:
            so = seq.sampling_params.structured_outputs
            if so is not None:
                self._compile(so.key)

    def _compile(self, key: Key) -> Future[Any]:
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        future = self._pool.submit(self._compile_now, key)
        self._compiled[key] = future
        while len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return future

    def _compile_now(self, key: Key) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tok = self.tokenizer
            if tok is None:
                from paged_engine.utils.tokenizer import load_tokenizer

                tok = load_tokenizer(self.tokenizer_dir)
            if tok is None:
                raise ValueError("structured outputs need a tokenizer; this model has none")
            info = xgr.TokenizerInfo.from_huggingface(
                tok,
                vocab_size=max(self.vocab_size, len(tok)),
                stop_token_ids=self.eos_token_ids or None,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler.compile_grammar(grammar_of(*key))

    # ---- one step -------------------------------------------------------------------------

    def masks(
        self, seqs: Sequence[EngineSequence]
    ) -> tuple[TokenMask | None, dict[int, FailedSample]]:
        """The bitmask of the rows of ``seqs`` (the step's sampling sequences, in logits
        order) that have a grammar, and a ``FailedSample`` for each such row whose grammar
        could not be compiled or replayed (its mask row allows nothing). None when no row
        has a grammar: the step costs one scan."""
        self._step += 1
        if self._matchers:
            self._drop_stale()
        rows = [j for j, s in enumerate(seqs) if s.sampling_params.structured_outputs is not None]
        if not rows:
            return None, {}
        failed: dict[int, FailedSample] = {}
        width = max(self.vocab_size, 1)
        bitmask = torch.zeros((len(rows), (width + BITS - 1) // BITS), dtype=torch.int32)
        for r, j in enumerate(rows):
            try:
                state = self._synced(seqs[j])
                if state.matcher.is_terminated():  # ignore_eos ran past the grammar's end
                    for t in state.matcher.stop_token_ids:
                        bitmask[r, t // BITS] |= _bit(t % BITS)
                else:
                    state.matcher.fill_next_token_bitmask(bitmask, r)
            except Exception as exc:
                bitmask[r] = 0
                failed[j] = FailedSample(f"structured outputs: {type(exc).__name__}: {exc}")
        return (bitmask, rows), failed

    def advance(
        self, seqs: Sequence[EngineSequence], tokens: Sequence[int | FailedSample | None]
    ) -> None:
        """Feed each sampled token to its sequence's matcher; a matcher that refuses it
        (never, for a token its own mask allowed) is dropped, and so is one that terminates
        (its request stops at that eos), unless the request ignores eos: past its grammar's
        end such a request may only repeat the stop tokens."""
        for seq, t in zip(seqs, tokens, strict=True):
            state = self._matchers.get(seq.seq_id)
            if state is None or not isinstance(t, int):
                continue
            if _accept(state.matcher, t):
                state.accepted.append(t)
                if not state.matcher.is_terminated() or seq.sampling_params.ignore_eos:
                    continue
            del self._matchers[seq.seq_id]

    def forget(self, seq_id: int) -> None:
        """Drop a sequence's matcher now (an abort, when the caller knows of one)."""
        self._matchers.pop(seq_id, None)

    def __len__(self) -> int:
        """Live matchers (tests check that they are freed)."""
        return len(self._matchers)

    def _synced(self, seq: EngineSequence) -> _Matcher:
        """``seq``'s matcher, agreeing with its output tokens: rebuilt and replayed when it
        is missing or disagrees."""
        so = seq.sampling_params.structured_outputs
        assert so is not None
        key = so.key
        state = self._matchers.get(seq.seq_id)
        n = seq.num_completion_tokens
        if (
            state is None
            or state.key != key
            or len(state.accepted) != n
            or (n > 0 and state.accepted[-1] != seq.last_token)
        ):
            state = self._rebuild(seq, key)
        state.last_step = self._step
        return state

    def _rebuild(self, seq: EngineSequence, key: Key) -> _Matcher:
        import xgrammar as xgr

        self._matchers.pop(seq.seq_id, None)
        state = _Matcher(key, xgr.GrammarMatcher(self._compile(key).result()))
        for t in seq.completion_token_ids:
            if not _accept(state.matcher, t):
                raise ValueError(f"the sequence's output token {t} does not match its grammar")
            state.accepted.append(t)
        self._matchers[seq.seq_id] = state
        return state

    def _drop_stale(self) -> None:
        if self._step % 16:
            return
        oldest = self._step - STALE_STEPS
        for sid in [s for s, m in self._matchers.items() if m.last_step < oldest]:
            del self._matchers[sid]


def _accept(matcher: Any, token: int) -> bool:
    """``matcher`` advanced by ``token``; once terminated it takes only its stop tokens."""
    if matcher.is_terminated():
        return token in matcher.stop_token_ids
    return bool(matcher.accept_token(token))


def _bit(j: int) -> int:
    """Bit ``j`` of an int32 word, as a Python int (bit 31 is the sign)."""
    return -(2**31) if j == BITS - 1 else 1 << j
