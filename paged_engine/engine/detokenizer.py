"""Incremental detokenisation and stop strings, one step at a time.

Why incremental: a stop string must end a request in the step that completes it (the next
step would already have generated past it), and a streaming client wants each step's new
text; decoding the whole completion every step would cost O(length) per token. So each
completion keeps a short window: ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``
is the text the newest tokens add, where ``prefix..read`` is the already emitted tail the
new tokens are decoded *in context of* (a byte-level BPE token can be a fragment of a UTF-8
character, and SentencePiece-style tokenizers drop a word's leading space when it is
decoded alone). While the window's text ends in U+FFFD (an incomplete character) nothing is
emitted; the bytes come out with the token that completes them.

Cost: two ``decode`` calls over a few tokens per completion per step. ``generate`` without
stop strings never pays it: it decodes each completion once, when it finishes.

The state is a function of the tokens it has seen: ``num_tokens`` says how many, and a
completion whose sequence lost tokens (a failed step recovered by preemption) rebuilds it
from scratch, so it can never disagree with the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any, Protocol

_CONTEXT = 6
"""Prompt tokens the first window starts with: enough for a leading space or a split
UTF-8 character to decode as it does inside the full text."""


class Detokenizer(Protocol):
    def decode(self, token_ids: Any, skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """The text of one completion, grown token by token (see the module docstring)."""

    __slots__ = ("_ids", "_prefix", "_read", "num_tokens", "skip_special_tokens", "text")

    def __init__(self, prompt_token_ids: SequenceABC[int], skip_special_tokens: bool) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.reset(prompt_token_ids)

    def reset(self, prompt_token_ids: SequenceABC[int]) -> None:
        """Forget every completion token (the state of a completion with none)."""
        self._ids = list(prompt_token_ids[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.num_tokens = 0
        self.text = ""

    def add(self, tokenizer: Detokenizer, token_ids: SequenceABC[int]) -> str:
        """Append completion tokens, one at a time; returns the text they add (possibly "",
        while a character is incomplete). If ``decode`` raises, the tokens before the one
        it raised on are in, that one and the rest are not."""
        start = len(self.text)
        skip = self.skip_special_tokens
        if token_ids and self.num_tokens == 0 and self._ids:
            self._drop_incomplete_context(tokenizer)
        for t in token_ids:
            ids = [*self._ids, t]
            before = tokenizer.decode(ids[self._prefix : self._read], skip_special_tokens=skip)
            after = tokenizer.decode(ids[self._prefix :], skip_special_tokens=skip)
            self._ids = ids
            self.num_tokens += 1
            if after.endswith("\ufffd"):
                continue  # an incomplete character: decode it again with the next token
            if not after.startswith(before):  # not seen with byte-level BPE; best effort
                before = before[: _common_prefix(before, after)]
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(ids)
            # Keep the window short: everything before ``_prefix`` is emitted for good.
            if self._prefix > 4 * _CONTEXT:
                drop = self._prefix - _CONTEXT
                del self._ids[:drop]
                self._prefix -= drop
                self._read -= drop
        return self.text[start:]

    def _drop_incomplete_context(self, tokenizer: Detokenizer) -> None:
        """A prompt that ends inside a character (its last tokens a UTF-8 lead byte)
        would let the completion's first bytes finish a character that one decode of the
        completion alone never shows; such a context is dropped, so the streamed text stays
        exactly the text ``generate`` returns."""
        context = tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        if context.endswith("\ufffd"):
            self._ids = []
            self._prefix = self._read = 0

    def flush(self, tokenizer: Detokenizer) -> str:
        """Emit what an incomplete character held back (the completion has ended, so no
        token will complete it): the text is then exactly what one ``decode`` of the
        whole completion gives, U+FFFD included."""
        if self._read == len(self._ids):
            return ""
        skip = self.skip_special_tokens
        before = tokenizer.decode(self._ids[self._prefix : self._read], skip_special_tokens=skip)
        after = tokenizer.decode(self._ids[self._prefix :], skip_special_tokens=skip)
        if not after.startswith(before):
            before = before[: _common_prefix(before, after)]
        delta = after[len(before) :]
        self.text += delta
        self._prefix, self._read = self._read, len(self._ids)
        return delta


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def find_stop(text: str, new_chars: int, stops: SequenceABC[str]) -> tuple[str, int] | None:
    """The first stop string that ends in the last ``new_chars`` characters of ``text``,
    with the index where it starts; a stop string that spans earlier text and new text
    counts (it could not be seen before). Earliest start wins, then the longer string."""
    best: tuple[str, int] | None = None
    for stop in stops:
        # Only a match ending among the new characters is new.
        start = max(0, len(text) - new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[1] or (i == best[1] and len(stop) > len(best[0]))):
            best = (stop, i)
    return best
