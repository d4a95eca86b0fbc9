"""A request as its user sees it: vLLM-shaped outputs, and the engine's record behind them.

A request owns one ``Sequence`` per completion (``n`` of them): sequences are what the
scheduler and allocator see, a request is what ``add_request`` takes and ``step`` reports.
The record keeps what the scheduler does not: each completion's text, logprobs, finish
reason, and the request's timings. Every per-token list is indexed by position, so an
entry written by a step that later failed is simply overwritten when the position is
computed again (and never read past the tokens the sequence has).

``Request.build_output`` is the output pipeline's last stage (docs/design.md, "The output
pipeline"; ``output_processor.py`` runs the stages before it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from paged_engine.engine.detokenizer import Detokenizer, IncrementalDetokenizer
from paged_engine.engine.outputs import TokenLogprobs
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability (vLLM's ``Logprob``): ``rank`` 1 is the most likely."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]
"""token id -> Logprob at one position: the top-k and the token actually there."""


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One completion of a request (vLLM's field names). ``text`` and ``token_ids`` are
    cumulative; ``finish_reason`` is None while it runs, else "stop" (EOS, a stop token
    or a stop string), "length" (max_tokens or max_model_len) or "error" (its logits
    could not be sampled); ``stop_reason`` is the stop token id or stop string that
    ended it, or the error's description, else None."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Wall-clock times (``time.time()``) of a request's life; None until they happen."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What ``step`` and ``generate`` return for a request (vLLM's field names)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None
    """Prompt tokens the prefix cache served when the request was first admitted."""
    metrics: RequestMetrics


@dataclass(slots=True, eq=False)  # identity: it keys the engine's dictionaries
class Completion:
    """The engine's record of one completion (its sequence's text, logprobs, ending)."""

    index: int
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    """Set when text is produced step by step (stop strings, streaming)."""
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """By completion position; only the first ``num_completion_tokens`` are real."""
    decoded_logprobs: list[PositionLogprobs] = field(default_factory=list)
    """``logprobs`` as vLLM dictionaries with decoded tokens, by position."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    """Tokens (and below, characters of ``text``) already delivered, for
    ``RequestOutputKind.DELTA``."""
    sent_chars: int = 0
    searched_chars: int = 0
    """Characters of the detokenizer's text already searched for stop strings: what is
    new is what follows, however often the search is interrupted and run again."""


Sent = tuple[Completion, int, int]
"""``(completion, sent_tokens, sent_chars)``: what a DELTA completion's counts become once
an output is delivered."""


@dataclass(slots=True, eq=False)
class Request:
    """The engine's record of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[Completion]
    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """By prompt position (index 0 is always None), when asked for."""
    decoded_prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def build_output(self) -> tuple[RequestOutput, list[Sent]]:
        """The request now: everything so far, or for ``RequestOutputKind.DELTA`` only what
        is new since the last output delivered; with, for DELTA, the counts each
        completion has once this output is delivered. Nothing is counted as sent here:
        ``OutputProcessor.collect_outputs`` applies the counts only when every output of a
        step is built, so an exception in between loses no delta.

        While a completion runs, its last characters could be the start of a stop string:
        ``held_back_chars`` of them are held back, so streamed text never has to be taken
        back."""
        params = self.params
        delta = params.output_kind is RequestOutputKind.DELTA
        hold = held_back_chars(params)
        outs = []
        sent = []
        for c in self.completions:
            n = c.seq.num_completion_tokens
            text = c.text
            if hold and c.finish_reason is None:
                text = text[: max(0, len(text) - hold)]
            first = c.sent_tokens if delta else 0
            lps = None
            cumulative = None
            if params.logprobs is not None:
                lps = c.decoded_logprobs[first:n]
                cumulative = sum(lp.logprob for lp in c.logprobs[:n])
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=text[c.sent_chars :] if delta else text,
                    token_ids=c.seq.token_ids[c.seq.num_prompt_tokens + first :],
                    cumulative_logprob=cumulative,
                    logprobs=lps,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
            if delta:
                sent.append((c, n, len(text)))
        first_seq = self.completions[0].seq
        out = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,  # shared, never changed: no copy
            prompt_logprobs=(
                list(self.decoded_prompt_logprobs) if params.prompt_logprobs is not None else None
            ),
            outputs=outs,
            finished=self.finished,
            num_cached_tokens=first_seq.num_prefix_hit_tokens,
            metrics=RequestMetrics(
                arrival_time=self.arrival_time,
                first_scheduled_time=self.first_scheduled_time,
                first_token_time=self.first_token_time,
                last_token_time=self.last_token_time,
                finished_time=self.finished_time,
            ),
        )
        return out, sent


def held_back_chars(params: SamplingParams) -> int:
    """How many of a running completion's last characters its outputs hold back: one less
    than the longest stop string (whole, it would have ended the completion), none when
    there is none or stop strings stay in the output."""
    if params.stop and not params.include_stop_str_in_output:
        return max(map(len, params.stop)) - 1
    return 0


def vllm_logprobs(lp: TokenLogprobs, tok: Detokenizer | None) -> PositionLogprobs:
    """A runner's logprobs at one position in vLLM's shape: the token actually there
    first, then the top-k (decoded when there is a tokenizer)."""

    def text(t: int) -> str | None:
        return None if tok is None else tok.decode([t])

    out = {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token_id))}
    for r, (t, v) in enumerate(lp.top, start=1):
        if t not in out:
            out[t] = Logprob(v, r, text(t))
    return out
