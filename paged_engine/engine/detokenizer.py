"""Incremental detokenisation and stop strings, one step at a time.

Why incremental: a stop string must end a request in the step that completes it (the next
step would already have generated past it), and a streaming client wants each step's new
text; decoding the whole completion every step would cost O(length) per token.

The text is the completion's own: exactly what one ``decode`` of its tokens gives, which is
what ``generate`` returns without stop strings. The prompt is no context for it: a decoder
that joins tokens with spaces, or drops a word's leading space at the start, would give the
first token a different text after the prompt than at the start of a decode.

Each completion keeps a window: the tokens of the last chunk of text it emitted, then the
tokens held back since. A new token's text is ``decode(window + token)`` minus
``decode(last chunk)``; it is emitted when the window's text grows and does not end in
U+FFFD (an incomplete UTF-8 character; a token whose text is empty, a skipped special token
say, waits with the next), and the new chunk is then everything after the last one. This
is ``tokenizers.decoders.DecodeStream``'s rule, which ``make_detokenizer`` uses, in Rust,
for a tokenizer whose ``decode`` is its ``tokenizers`` backend's (transformers' fast
tokenizers without space clean-up); any other tokenizer (anything with ``decode``) gets the
same rule in Python. DecodeStream measures growth in UTF-8 bytes, the Python rule in
characters: they part only where a decoder rewrites earlier text so that the window's text
gains characters but not bytes, and DecodeStream then holds back the token the Python rule
emits; from there on the two texts may differ (for such a decoder neither is one decode of
the whole completion, as the next sentence says). A decoder whose text for earlier tokens
changes with later ones has no streamed text that never has to be taken back: there the
text from the common prefix on is emitted (best effort; DecodeStream refuses, and the
Python rule takes over).

Each token is taken whole or not at all (the state is assigned once its text is known), so
an exception anywhere leaves a state that the tokens it has seen determine. A completion
whose sequence lost tokens (defensive: recovery never drops a token text was made from)
starts again from none.

Cost: one or two ``decode`` calls over a few tokens per completion per step (in Rust,
without a Python call per decode, through DecodeStream). ``generate`` without stop strings
never pays it: it decodes each completion once, when it finishes.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence as SequenceABC
from typing import Any, Protocol

from paged_engine.sampling_params import SamplingParams

_FFFD = "\ufffd"


class Detokenizer(Protocol):
    def decode(self, token_ids: Any, skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """The text of one completion, grown token by token (see the module docstring)."""

    __slots__ = ("_emitted", "_window", "num_tokens", "skip_special_tokens", "text")

    def __init__(self, skip_special_tokens: bool = True) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.reset()

    def reset(self) -> None:
        """Forget every completion token (the state of a completion with none)."""
        self._window: list[int] = []
        """The window: the last emitted chunk's tokens, then the held-back ones."""
        self._emitted = 0
        """How many of ``_window`` are the last emitted chunk's tokens."""
        self.num_tokens = 0
        self.text = ""

    def _decode(self, tokenizer: Detokenizer, ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, tokenizer: Detokenizer, token_ids: SequenceABC[int]) -> str:
        """Append completion tokens, one at a time; returns the text they add (possibly "",
        while a character is incomplete). If ``decode`` raises, the tokens before the one
        it raised on are in, that one and the rest are not."""
        start = len(self.text)
        for t in token_ids:
            self._add_token(tokenizer, t)
        return self.text[start:]

    def _add_token(self, tokenizer: Detokenizer, t: int) -> None:
        ids = [*self._window, t]
        after = self._decode(tokenizer, ids)
        before = self._decode(tokenizer, ids[: self._emitted]) if self._emitted else ""
        if len(after) <= len(before) or after.endswith(_FFFD):
            self._window, self.num_tokens = ids, self.num_tokens + 1  # held back
            return
        if not after.startswith(before):  # an earlier token's text changed: best effort
            before = before[: _common_prefix(before, after)]
        chunk = ids[self._emitted :]
        # One assignment once everything is computed: the token is in whole or not at all.
        self._window, self._emitted, self.num_tokens, self.text = (
            chunk,
            len(chunk),
            self.num_tokens + 1,
            self.text + after[len(before) :],
        )

    def flush(self, tokenizer: Detokenizer) -> str:
        """Emit what an incomplete character held back (the completion has ended, so no
        token will complete it): the text is then exactly what one ``decode`` of the
        whole completion gives, U+FFFD included. Idempotent."""
        if self._emitted == len(self._window):
            return ""
        ids = self._window
        after = self._decode(tokenizer, ids)
        before = self._decode(tokenizer, ids[: self._emitted]) if self._emitted else ""
        if not after.startswith(before):
            before = before[: _common_prefix(before, after)]
        delta = after[len(before) :]
        self._emitted, self.text = len(ids), self.text + delta
        return delta


class StreamingDetokenizer(IncrementalDetokenizer):
    """``IncrementalDetokenizer``'s rule through ``tokenizers.decoders.DecodeStream`` over a
    ``tokenizers.Tokenizer`` whose ``decode`` is the tokenizer's (``make_detokenizer``).

    It keeps the same window (``_window``, ``_emitted``) beside the stream, so that when the
    stream refuses a token (its decoder changed earlier text) the Python rule takes over
    from there, for the rest of the completion."""

    __slots__ = ("_backend", "_stream")

    def __init__(self, backend: Any, skip_special_tokens: bool) -> None:
        self._backend = backend
        super().__init__(skip_special_tokens)

    def reset(self) -> None:
        super().reset()
        decoders = sys.modules["tokenizers.decoders"]
        skip = self.skip_special_tokens
        self._stream: Any | None = decoders.DecodeStream(skip_special_tokens=skip)

    def _decode(self, tokenizer: Detokenizer, ids: list[int]) -> str:
        text: str = self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return text

    def _add_token(self, tokenizer: Detokenizer, t: int) -> None:
        stream = self._stream
        if stream is None:
            super()._add_token(tokenizer, t)
            return
        try:
            piece = stream.step(self._backend, t)
        except Exception:  # the stream's InvalidPrefix: the stream is given up
            self._stream = None
            super()._add_token(tokenizer, t)
            return
        ids = [*self._window, t]
        if piece is None:
            self._window, self.num_tokens = ids, self.num_tokens + 1
            return
        chunk = ids[self._emitted :]
        self._window, self._emitted, self.num_tokens, self.text = (
            chunk,
            len(chunk),
            self.num_tokens + 1,
            self.text + piece,
        )


_SAME_DECODE_MODULES = frozenset(
    {
        "transformers.tokenization_utils_base",
        "transformers.tokenization_utils_fast",
        "transformers.tokenization_utils_tokenizers",
    }
)
"""Where transformers defines the ``decode`` and ``_decode`` of its fast tokenizers, which
return the backend's text as it is when clean-up is off."""


def stream_backend(tokenizer: object) -> Any | None:
    """The ``tokenizers.Tokenizer`` whose ``decode`` gives exactly ``tokenizer.decode``'s
    text, when ``tokenizers`` has ``DecodeStream``; else None (the Python rule serves).

    Nothing is imported here: a tokenizer built on ``tokenizers`` has imported it already.
    """
    tokenizers = sys.modules.get("tokenizers")
    decoders = sys.modules.get("tokenizers.decoders")
    if tokenizers is None or not hasattr(decoders, "DecodeStream"):
        return None
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None  # transformers edits the backend's text afterwards
    cls = type(tokenizer)
    for name in ("decode", "_decode"):
        method = getattr(cls, name, None)
        if getattr(method, "__module__", None) not in _SAME_DECODE_MODULES:
            return None  # a subclass decodes its own way
    return backend


def make_detokenizer(backend: Any | None, skip_special_tokens: bool) -> IncrementalDetokenizer:
    """A completion's detokenizer: through DecodeStream over ``backend`` (from
    ``stream_backend``) when there is one, else the Python rule over ``decode``."""
    if backend is not None:
        return StreamingDetokenizer(backend, skip_special_tokens)
    return IncrementalDetokenizer(skip_special_tokens)


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


def tokens_with_text(
    n: int, finish_reason: str | None, stop_reason: int | str | None, params: SamplingParams
) -> int:
    """How many of a completion's ``n`` tokens have text: all but the token that ended it,
    an EOS or a stop token, unless ``include_stop_str_in_output`` (vLLM's rule). Shared
    with the API process's half of the pipeline (``entrypoints/core_outputs.py``)."""
    if (
        finish_reason == "stop"
        and not isinstance(stop_reason, str)
        and not params.include_stop_str_in_output
    ):
        return n - 1
    return n


def stop_string_cut(
    params: SamplingParams,
    text: str,
    searched_chars: int,
    num_tokens: int,
    finish_reason: str | None,
) -> tuple[str, int] | None:
    """The stop string that ends a completion whose text is now ``text`` (its first
    ``searched_chars`` searched before), and where its text then ends; None if none does.
    A completion ended by EOS or a stop token is not searched, nor one with fewer than
    ``min_tokens`` tokens."""
    if (
        not params.stop
        or len(text) <= searched_chars
        or finish_reason == "stop"
        or num_tokens < params.min_tokens
    ):
        return None
    hit = find_stop(text, len(text) - searched_chars, params.stop)
    if hit is None:
        return None
    stop, at = hit
    return stop, at + len(stop) if params.include_stop_str_in_output else at
