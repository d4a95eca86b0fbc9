"""The output pipeline: from the tokens a step samples to the ``RequestOutput``s ``step``
returns (docs/design.md, "The output pipeline").

``LLMEngine._step`` runs the stages in this order, each a method of ``OutputProcessor``:

1. ``store_logprobs(seqs, results)``: the model runner's results, one per scheduled
   sequence; their logprobs are stored by position, the plain tokens returned.
2. ``stage_step(seqs, tokens, report_running)``: the tokens wait in ``staged`` while the
   scheduler commits them (``Scheduler.postprocess`` appends them to the sequences).
3. ``record_committed(preempted)``: for every staged result but those of the sequences
   ``Scheduler.recover`` preempted (their tokens are gone), the request's timings, its
   news (``to_report``) and its completion's need of text (``needs_text``); then the
   finish reasons of the sequences the scheduler finished.
4. ``detokenize_pending()``: each completion in ``needs_text`` gets the text of its tokens
   (``IncrementalDetokenizer``, or one ``decode`` once it finishes) and its decoded
   logprobs; a stop string in the new text ends it there (``Scheduler.finish_now``).
5. ``collect_outputs(report_running)``: one output per request in ``to_report``
   (``Request.build_output``: cumulative or delta, the possible start of a stop string
   held back); finished requests leave the engine.

This runs after the scheduler has committed, so it never has to undo anything: work it
did not finish is still pending (``pending``), and the next step, ``abort_request`` or
``generate``'s cleanup finishes it first. Every stage can be interrupted (an exception or
a KeyboardInterrupt at any call) and run again to the same result: ``staged`` is dropped
in one assignment once recorded (the preempted sequences' first), and recording sets
times once and news and pending text in dictionaries; the detokenizer takes each token
whole, the stop-string search resumes after the text it has searched
(``Completion.searched_chars``), ``finish_now`` may be repeated; ``collect_outputs``
builds every output before it changes anything, then delivers them with no call that
could raise.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from typing import Any

from paged_engine.engine.detokenizer import (
    IncrementalDetokenizer,
    stop_string_cut,
    tokens_with_text,
)
from paged_engine.engine.inputs import Tokenizer
from paged_engine.engine.outputs import FailedSample, SampleOutput
from paged_engine.engine.request import (
    Completion,
    Request,
    RequestOutput,
    Sent,
    vllm_logprobs,
)
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import RequestOutputKind, SamplingParams

RunnerResult = int | FailedSample | SampleOutput | None
StepResult = int | FailedSample | None


class OutputProcessor:
    """The engine's per-request bookkeeping around the scheduler (see the module docstring)."""

    def __init__(
        self, requests: dict[str, Request], scheduler: Scheduler, tokenizer: Tokenizer | None
    ) -> None:
        self.requests = requests
        """The engine's table of requests in flight (shared with it)."""
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.completion_of: dict[Sequence, tuple[Request, Completion]] = {}
        """Each queued sequence's request and completion record."""
        self.needs_text: dict[Completion, Request] = {}
        """Completions with tokens their text and decoded logprobs do not cover yet."""
        self.to_report: dict[str, Request] = {}
        """Requests with news since the last step returned (kept across a failed step)."""
        self.staged: list[tuple[Sequence, StepResult]] = []
        """The last step's results, from before the scheduler commits them until recorded."""
        self.report_running = False
        """Whether the step of ``staged`` reports running requests (``step()``), or only
        finished ones (``generate``)."""

    @property
    def pending(self) -> bool:
        """Work left without a model step: results to record, text to produce, or outputs
        to return."""
        return bool(self.needs_text or self.to_report or self.staged or self.scheduler.finished)

    def forget(self, request: Request) -> None:
        """Drop an aborted request's records."""
        self.to_report.pop(request.request_id, None)
        for c in request.completions:
            self.completion_of.pop(c.seq, None)
            self.needs_text.pop(c, None)

    # ---- 1. and 2.: the step's results, until the scheduler commits them ------------------

    def store_logprobs(
        self, seqs: list[Sequence], results: SequenceABC[RunnerResult]
    ) -> list[StepResult]:
        """Store the results' logprobs by position; return the plain tokens. Idempotent:
        a failed step's entries are overwritten when the positions are computed again."""
        if len(results) != len(seqs):
            raise RuntimeError(f"the model runner returned {len(results)} results for {len(seqs)}")
        tokens: list[StepResult] = []
        for seq, r in zip(seqs, results, strict=True):
            if not isinstance(r, SampleOutput):
                tokens.append(r)
                continue
            tokens.append(r.token)
            request, c = self.completion_of[seq]
            if r.logprobs is not None:
                _set_or_append(c.logprobs, seq.num_completion_tokens, r.logprobs)
            if r.prompt_logprobs and c.index == 0:  # the others never compute prompt rows
                first = seq.num_cached_tokens + 1
                for k, lp in enumerate(r.prompt_logprobs):
                    request.prompt_logprobs[first + k] = lp
        return tokens

    def stage_step(
        self, seqs: list[Sequence], tokens: list[StepResult], report_running: bool
    ) -> None:
        """Hold the step's results until ``record_committed`` records the ones the scheduler
        committed (``report_running``: every request that produced a token has news, else
        only finished ones are reported)."""
        self.staged = list(zip(seqs, tokens, strict=True))
        self.report_running = report_running

    # ---- 3. what the scheduler committed -----------------------------------------------------

    def record_committed(self, preempted: Iterable[Sequence]) -> None:
        """Record the staged results but those of ``preempted`` (the sequences
        ``Scheduler.recover`` preempted: their tokens are gone), then the finish reasons of
        the sequences the scheduler finished. Safe to call at any time, and again after an
        interruption."""
        if self.staged:
            void = set(preempted)
            if void:
                self.staged = [(s, t) for s, t in self.staged if s not in void]
            now = time.time()
            for seq, t in self.staged:
                self._record_result(seq, t, now)
            self.staged = []
        sched = self.scheduler
        while sched.finished:
            seq = sched.finished[0]
            entry = self.completion_of.get(seq)
            if entry is not None:
                request, c = entry
                c.finish_reason, c.stop_reason = sched.finish_reason(seq), sched.stop_reason(seq)
                self.needs_text[c] = request
                self.to_report[request.request_id] = request
            sched.finished.pop(0)
            sched.errors.pop(seq.seq_id, None)

    def _record_result(self, seq: Sequence, t: StepResult, now: float) -> None:
        entry = self.completion_of.get(seq)
        if entry is None:  # aborted since
            return
        request, c = entry
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        if t is None:
            return
        params = request.params
        if self.report_running and params.output_kind is not RequestOutputKind.FINAL_ONLY:
            self.to_report[request.request_id] = request
        if isinstance(t, int):
            request.last_token_time = now
            if request.first_token_time is None:
                request.first_token_time = now
        if (
            c.detokenizer is not None
            or params.logprobs is not None
            # every prompt row is computed once the first token is sampled
            or (params.prompt_logprobs is not None and c.seq.num_completion_tokens == 1)
        ):
            self.needs_text[c] = request

    # ---- 4. text, decoded logprobs, stop strings ---------------------------------------------

    def detokenize_pending(self) -> None:
        """Bring every completion's text and decoded logprobs up to its tokens; end the
        ones a stop string stops. Each completion is done, or left to be done again, if
        this raises."""
        while self.needs_text:
            c, request = next(iter(self.needs_text.items()))
            self._detokenize(request, c)
            del self.needs_text[c]

    def _detokenize(self, request: Request, c: Completion) -> None:
        params, tok = request.params, self.tokenizer
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self._decode_logprobs(request, c)
        if c.detokenizer is not None and tok is not None:
            self._extend_text(request, c, c.detokenizer, tok)
        elif c.finish_reason is not None and tok is not None and params.detokenize:
            seq = c.seq
            start = seq.num_prompt_tokens
            ids = seq.token_ids[start : start + _tokens_with_text(c, params)]
            c.text = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if c.finish_reason is not None and request.finished and request.finished_time is None:
            request.finished_time = time.time()

    def _extend_text(
        self, request: Request, c: Completion, detok: IncrementalDetokenizer, tok: Tokenizer
    ) -> None:
        """The completion's new tokens through its detokenizer, and the new text searched
        for stop strings."""
        params, seq = request.params, c.seq
        if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
            return  # a stop string ended it: its text is final
        if detok.num_tokens > seq.num_completion_tokens:  # a failed step dropped one
            detok.reset()
            c.searched_chars = 0
        start = seq.num_prompt_tokens
        with_text = start + _tokens_with_text(c, params)
        detok.add(tok, seq.token_ids[start + detok.num_tokens : with_text])
        if c.finish_reason == "error":
            c.text = detok.text
            return
        if c.finish_reason is not None:  # ended by its tokens: nothing will follow
            detok.flush(tok)
        text = detok.text
        hit = stop_string_cut(
            params, text, c.searched_chars, seq.num_completion_tokens, c.finish_reason
        )
        if hit is not None:
            stop, end = hit
            if c.finish_reason is None:
                self.scheduler.finish_now(seq)
            c.text, c.finish_reason, c.stop_reason = text[:end], "stop", stop
            self.to_report[request.request_id] = request
            return
        c.text, c.searched_chars = text, len(text)

    def _decode_logprobs(self, request: Request, c: Completion) -> None:
        tok = self.tokenizer if request.params.detokenize else None
        n = c.seq.num_completion_tokens
        for i in range(len(c.decoded_logprobs), min(n, len(c.logprobs))):
            _set_or_append(c.decoded_logprobs, i, vllm_logprobs(c.logprobs[i], tok))
        if c.index == 0 and request.prompt_logprobs:
            decoded = request.decoded_prompt_logprobs
            if decoded[-1] is None:  # rows are decoded together: the last one means all
                for p, lp in enumerate(request.prompt_logprobs):
                    if lp is not None and decoded[p] is None:
                        decoded[p] = vllm_logprobs(lp, tok)

    # ---- 5. the outputs ------------------------------------------------------------------------

    def collect_outputs(self, report_running: bool) -> list[RequestOutput]:
        """Outputs for the requests with news (only the finished ones unless
        ``report_running``); finished requests leave the engine."""
        outputs: list[RequestOutput] = []
        sent: list[Sent] = []
        done: list[Request] = []
        for request in self.to_report.values():
            finished = request.finished
            # FINAL_ONLY: nothing before the end, an n > 1 request's first ending included
            final_only = request.params.output_kind is RequestOutputKind.FINAL_ONLY
            if finished or (report_running and not final_only):
                out, counts = request.build_output()
                outputs.append(out)
                sent += counts
                if finished:
                    done.append(request)
        # Delivery: nothing below calls a Python function, so it cannot stop halfway.
        for c, tokens, chars in sent:
            c.sent_tokens, c.sent_chars = tokens, chars
        for request in done:
            del self.requests[request.request_id]
            for c in request.completions:
                self.completion_of.pop(c.seq, None)
        self.to_report.clear()
        return outputs


def _tokens_with_text(c: Completion, params: SamplingParams) -> int:
    return tokens_with_text(c.seq.num_completion_tokens, c.finish_reason, c.stop_reason, params)


def _set_or_append(items: list[Any], i: int, value: Any) -> None:
    """``items[i] = value``, growing the list by one if ``i`` is just past its end."""
    if i < len(items):
        items[i] = value
    else:
        items.append(value)
