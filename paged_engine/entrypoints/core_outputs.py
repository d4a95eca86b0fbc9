"""The API process's half of the output pipeline when the engine core runs in a process of
its own: from the core's token deltas (``core_wire.WireOutput``) to the ``RequestOutput``s
the in-process server gives for the same request.

Why here: vLLM V1's API server detokenizes for its engine core, so text, stop strings and
logprob tokens cost the API process's interpreter, not the core's steps. Per completion
this does what the engine's ``OutputProcessor`` does in process, with its functions:

* the new tokens go through an ``IncrementalDetokenizer``, except the token that ended it
  (EOS or a stop token) unless ``include_stop_str_in_output`` (``tokens_with_text``); it
  is flushed when the completion ends;
* the new text is searched for stop strings (``stop_string_cut``). A hit ends the
  completion here; its later tokens from the core are dropped. Once every completion has
  ended, the client gets the final output and the core is told to abort the request. The
  core may have run a step or two further meanwhile, and an ``n > 1`` request's stopped
  completions keep running in the core until the whole request ends or is aborted;
* a running completion's last characters are held back while they could begin a stop
  string (``held_back_chars``); logprob tokens are decoded.

A request whose client asked for ``FINAL_ONLY`` or ``CUMULATIVE`` outputs has its deltas
merged (``Gathered``). A ``Restarted`` request (the core's fault isolation set it aside to
run it again) starts over. Each call handles one request: the caller fails that request
alone if it raises (its tokenizer's ``decode``, say).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from paged_engine.engine.detokenizer import (
    IncrementalDetokenizer,
    make_detokenizer,
    stop_string_cut,
    stream_backend,
    tokens_with_text,
)
from paged_engine.engine.request import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
    held_back_chars,
)
from paged_engine.entrypoints.core_wire import WireCompletion, WireOutput, core_params, metrics_of
from paged_engine.entrypoints.gather import Gathered
from paged_engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True, eq=False)
class _Text:
    """One completion as the API process knows it."""

    detok: IncrementalDetokenizer | None
    """None when no text is made as the tokens come (``detokenize=False``, no tokenizer,
    or ``at_end``)."""
    at_end: bool = False
    """The text is decoded once, when the completion ends: a ``FINAL_ONLY`` request with
    no stop strings, as the engine does it in process (a tokenizer whose text is not
    prefix-stable gives the same text)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    searched_chars: int = 0
    sent_chars: int = 0
    """Characters of ``text`` already in an output."""
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stopped_here: bool = False
    """A stop string ended it here: what the core sends for it later is dropped."""


@dataclass(slots=True, eq=False)
class _Request:
    params: SamplingParams
    """As the client asked for them."""
    texts: list[_Text]
    gather: Gathered | None
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished_time: float | None = None


class Built(NamedTuple):
    """What one ``WireOutput`` became: the step's delta (for the metrics), what the
    client gets (None: nothing yet, a merged output waits for the end), and whether a
    stop string ended the request here (the core still runs it: abort it there)."""

    delta: RequestOutput
    client: RequestOutput | None
    ended_here: bool


class TextOutputs:
    """The text side of every request in flight on one engine core (see the module
    docstring). ``add`` before the request is sent; ``build`` for each of its outputs."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._backend = stream_backend(tokenizer)
        self._requests: dict[str, _Request] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """Track a request; returns the params the core runs it with (``core_params``)."""
        merged = params.output_kind is not RequestOutputKind.DELTA
        self._requests[request_id] = _Request(
            params, self._texts(params), Gathered() if merged else None
        )
        return core_params(params)

    def _texts(self, params: SamplingParams) -> list[_Text]:
        text = self.tokenizer is not None and params.detokenize
        at_end = text and params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop
        skip = params.skip_special_tokens
        return [
            _Text(None, True)
            if at_end
            else _Text(make_detokenizer(self._backend, skip) if text else None)
            for _ in range(params.n)
        ]

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def clear(self) -> None:
        self._requests.clear()

    def restart(self, request_id: str) -> None:
        """The core runs the request again from its prompt: start its outputs over."""
        r = self._requests.get(request_id)
        if r is not None:
            r.texts = self._texts(r.params)
            if r.gather is not None:
                r.gather.reset()

    def build(self, w: WireOutput) -> Built | None:
        """The outputs of one request's step (None: the request is not tracked, aborted
        or ended here meanwhile)."""
        r = self._requests.get(w.request_id)
        if r is None:
            return None
        if w.prompt_token_ids is not None:
            r.prompt, r.prompt_token_ids = w.prompt, w.prompt_token_ids
            if w.prompt_logprobs is not None:
                r.prompt_logprobs = [
                    None if p is None else self._decoded(r, p) for p in w.prompt_logprobs
                ]
        outs = [self._completion(r, r.texts[c.completion_index], c) for c in w.completions]
        finished = all(t.finish_reason is not None for t in r.texts)
        ended_here = finished and not w.finished
        if ended_here and r.finished_time is None:
            r.finished_time = time.time()
        delta = RequestOutput(
            request_id=w.request_id,
            prompt=r.prompt,
            prompt_token_ids=r.prompt_token_ids,
            prompt_logprobs=(
                list(r.prompt_logprobs or ()) if r.params.prompt_logprobs is not None else None
            ),
            outputs=outs,
            finished=finished,
            num_cached_tokens=w.num_cached_tokens,
            metrics=metrics_of(w, r.finished_time),
        )
        client: RequestOutput | None = delta
        if r.gather is not None:
            r.gather.add(delta)
            kind = r.params.output_kind
            client = r.gather.result() if finished or kind is RequestOutputKind.CUMULATIVE else None
        if finished:
            self._requests.pop(w.request_id, None)
        return Built(delta, client, ended_here)

    def _completion(self, r: _Request, t: _Text, c: WireCompletion) -> CompletionOutput:
        params = r.params
        wants_logprobs = params.logprobs is not None
        if t.stopped_here:  # ended by a stop string here: the core's news is void
            return CompletionOutput(
                c.completion_index, "", [], t.cumulative_logprob, [] if wants_logprobs else None,
                t.finish_reason, t.stop_reason,
            )  # fmt: skip
        t.token_ids += c.token_ids
        t.cumulative_logprob = c.cumulative_logprob
        t.finish_reason, t.stop_reason = c.finish_reason, c.stop_reason
        if t.detok is not None:
            self._extend_text(params, t)
        elif t.at_end and t.finish_reason is not None:
            n = tokens_with_text(len(t.token_ids), t.finish_reason, t.stop_reason, params)
            assert self.tokenizer is not None
            skip = params.skip_special_tokens
            t.text = self.tokenizer.decode(t.token_ids[:n], skip_special_tokens=skip)
        text = t.text
        hold = held_back_chars(params)
        if hold and t.finish_reason is None:
            text = text[: max(0, len(text) - hold)]
        new_text, t.sent_chars = text[t.sent_chars :], len(text)
        lps = None
        if c.logprobs is not None:
            lps = [self._decoded(r, p) for p in c.logprobs]
        return CompletionOutput(
            c.completion_index, new_text, c.token_ids, t.cumulative_logprob, lps, t.finish_reason,
            t.stop_reason,
        )  # fmt: skip

    def _extend_text(self, params: SamplingParams, t: _Text) -> None:
        """As ``OutputProcessor._extend_text``: the tokens with text through the
        detokenizer, the new text searched for stop strings."""
        detok, tok = t.detok, self.tokenizer
        assert detok is not None and tok is not None
        n = len(t.token_ids)
        with_text = tokens_with_text(n, t.finish_reason, t.stop_reason, params)
        detok.add(tok, t.token_ids[detok.num_tokens : with_text])
        if t.finish_reason == "error":
            t.text = detok.text
            return
        if t.finish_reason is not None:
            detok.flush(tok)
        text = detok.text
        hit = stop_string_cut(params, text, t.searched_chars, n, t.finish_reason)
        if hit is not None:
            stop, end = hit
            t.text, t.finish_reason, t.stop_reason, t.stopped_here = text[:end], "stop", stop, True
            return
        t.text, t.searched_chars = text, len(text)

    def _decoded(self, r: _Request, p: PositionLogprobs) -> PositionLogprobs:
        """One position's logprobs with their tokens' text, as the engine decodes them."""
        tok = self.tokenizer if r.params.detokenize else None
        if tok is None:
            return p
        return {t: Logprob(lp.logprob, lp.rank, tok.decode([t])) for t, lp in p.items()}
