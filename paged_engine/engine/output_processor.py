"""From a committed step's results to what ``step`` returns: logprobs stored by position,
timings, finish reasons, text (incremental detokenisation and stop strings), and the
vLLM-shaped outputs. It runs after the scheduler has committed, so it never has to undo
anything: work it did not finish is simply still pending, and the next step finishes it
first, before anything new is computed.

Every stage can be interrupted (an exception or a KeyboardInterrupt at any call) and run
again to the same result:

* A step's results wait in ``step_notes`` from before the scheduler commits them until
  ``settle`` notes them. Those of the sequences ``recover()`` preempted are dropped first,
  in one assignment (their tokens were dropped: no news, no first-token time). Noting is
  idempotent: times are set once, news and pending text are sets.
* ``catch_up`` finishes each completion's text or leaves it to be run again: the
  detokenizer takes each token whole, the stop-string search resumes after the last text
  it finished searching (``Completion.searched``), and ``Scheduler.finish_now`` may be
  repeated.
* ``report`` builds every output before it changes anything, then delivers them with no
  call that could raise.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from typing import Any

from paged_engine.engine.detokenizer import IncrementalDetokenizer, find_stop
from paged_engine.engine.inputs import Tokenizer
from paged_engine.engine.outputs import FailedSample, SampleOutput, TokenLogprobs
from paged_engine.engine.request import (
    Completion,
    Logprob,
    PositionLogprobs,
    Request,
    RequestOutput,
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
        self.owner: dict[Sequence, tuple[Request, Completion]] = {}
        self.behind: dict[Completion, Request] = {}
        """Completions with tokens their text and logprobs do not cover yet."""
        self.unreported: dict[str, Request] = {}
        """Requests with news since the last step returned (kept across a failed step)."""
        self.step_notes: list[tuple[Sequence, StepResult]] = []
        """The last step's results, from before the scheduler commits them until noted."""
        self.all_news = False
        """Whether the step of ``step_notes`` reports running requests (``step()``)."""

    @property
    def pending(self) -> bool:
        """Work left without a model step: results to note, text to produce, or outputs
        to return."""
        return bool(self.behind or self.unreported or self.step_notes or self.scheduler.finished)

    def forget(self, request: Request) -> None:
        """Drop an aborted request's records."""
        self.unreported.pop(request.request_id, None)
        for c in request.completions:
            self.owner.pop(c.seq, None)
            self.behind.pop(c, None)

    def absorb(self, seqs: list[Sequence], results: SequenceABC[RunnerResult]) -> list[StepResult]:
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
            request, c = self.owner[seq]
            if r.logprobs is not None:
                _put(c.logprobs, seq.num_completion_tokens, r.logprobs)
            if r.prompt_logprobs and c.index == 0:  # the others never compute prompt rows
                first = seq.num_cached_tokens + 1
                for k, lp in enumerate(r.prompt_logprobs):
                    request.prompt_logprobs[first + k] = lp
        return tokens

    def expect(self, seqs: list[Sequence], tokens: list[StepResult], all_news: bool) -> None:
        """Hold the step's results until ``settle`` notes the ones the scheduler committed
        (``all_news``: every request that produced a token has news, else only finished
        ones are reported)."""
        self.step_notes = list(zip(seqs, tokens, strict=True))
        self.all_news = all_news

    def settle(self, undone: Iterable[Sequence]) -> None:
        """Note the held results but those of ``undone`` (the sequences ``recover()``
        preempted: their tokens are gone), then the finish reasons of the sequences the
        scheduler finished. Safe to call at any time, and again after an interruption."""
        if self.step_notes:
            void = set(undone)
            if void:
                self.step_notes = [(s, t) for s, t in self.step_notes if s not in void]
            now = time.time()
            for seq, t in self.step_notes:
                self._note(seq, t, now)
            self.step_notes = []
        sched = self.scheduler
        while sched.finished:
            seq = sched.finished[0]
            entry = self.owner.get(seq)
            if entry is not None:
                request, c = entry
                c.finish_reason, c.stop_reason = sched.finish_reason(seq), sched.stop_reason(seq)
                self.behind[c] = request
                self.unreported[request.request_id] = request
            sched.finished.pop(0)
            sched.errors.pop(seq.seq_id, None)

    def _note(self, seq: Sequence, t: StepResult, now: float) -> None:
        entry = self.owner.get(seq)
        if entry is None:  # aborted since
            return
        request, c = entry
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        if t is None:
            return
        params = request.params
        if self.all_news and params.output_kind is not RequestOutputKind.FINAL_ONLY:
            self.unreported[request.request_id] = request
        if isinstance(t, int):
            request.last_token_time = now
            if request.first_token_time is None:
                request.first_token_time = now
        if (
            c.detok is not None
            or params.logprobs is not None
            # every prompt row is computed once the first token is sampled
            or (params.prompt_logprobs is not None and c.seq.num_completion_tokens == 1)
        ):
            self.behind[c] = request

    def catch_up(self) -> None:
        """Bring every completion's text and decoded logprobs up to its tokens; end the
        ones a stop string stops. Each completion is done, or left to be done again, if
        this raises."""
        while self.behind:
            c, request = next(iter(self.behind.items()))
            self._detokenize(request, c)
            del self.behind[c]

    def _detokenize(self, request: Request, c: Completion) -> None:
        params, tok = request.params, self.tokenizer
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self._decode_logprobs(request, c)
        if c.detok is not None and tok is not None:
            self._stream_text(request, c, c.detok, tok)
        elif c.finish_reason is not None and tok is not None and params.detokenize:
            seq = c.seq
            ids = seq.token_ids[seq.num_prompt_tokens : seq.num_prompt_tokens + _shown(c, params)]
            c.text = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if c.finish_reason is not None and request.finished and request.finished_time is None:
            request.finished_time = time.time()

    def _stream_text(
        self, request: Request, c: Completion, detok: IncrementalDetokenizer, tok: Tokenizer
    ) -> None:
        params, seq = request.params, c.seq
        if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
            return  # a stop string ended it: its text is final
        if detok.num_tokens > seq.num_completion_tokens:  # a failed step dropped one
            detok.reset()
            c.searched = 0
        start = seq.num_prompt_tokens
        detok.add(tok, seq.token_ids[start + detok.num_tokens : start + _shown(c, params)])
        if c.finish_reason == "error":
            c.text = detok.text
            return
        if c.finish_reason is not None:  # ended by its tokens: nothing will follow
            detok.flush(tok)
        text = detok.text
        if (
            params.stop
            and len(text) > c.searched
            and c.finish_reason != "stop"  # not ended by EOS or a stop token
            and seq.num_completion_tokens >= params.min_tokens
        ):
            hit = find_stop(text, len(text) - c.searched, params.stop)
            if hit is not None:
                stop, at = hit
                end = at + len(stop) if params.include_stop_str_in_output else at
                if c.finish_reason is None:
                    self.scheduler.finish_now(seq)
                c.text, c.finish_reason, c.stop_reason = text[:end], "stop", stop
                self.unreported[request.request_id] = request
                return
        c.text, c.searched = text, len(text)

    def _decode_logprobs(self, request: Request, c: Completion) -> None:
        tok = self.tokenizer if request.params.detokenize else None
        n = c.seq.num_completion_tokens
        for i in range(len(c.decoded), min(n, len(c.logprobs))):
            _put(c.decoded, i, _as_dict(c.logprobs[i], tok))
        if c.index == 0 and request.prompt_logprobs:
            decoded = request.decoded_prompt_logprobs
            if decoded[-1] is None:  # rows are decoded together: the last one means all
                for p, lp in enumerate(request.prompt_logprobs):
                    if lp is not None and decoded[p] is None:
                        decoded[p] = _as_dict(lp, tok)

    def report(self, report_running: bool) -> list[RequestOutput]:
        """Outputs for the requests with news; finished requests leave the engine."""
        outputs: list[RequestOutput] = []
        sent: list[tuple[Completion, int, int]] = []
        done: list[Request] = []
        for request in self.unreported.values():
            finished = request.finished
            if finished or report_running:
                out, marks = request.snapshot()
                outputs.append(out)
                sent += marks
                if finished:
                    done.append(request)
        # Delivery: nothing below calls a Python function, so it cannot stop halfway.
        for c, tokens, chars in sent:
            c.sent_tokens, c.sent_text = tokens, chars
        for request in done:
            del self.requests[request.request_id]
            for c in request.completions:
                self.owner.pop(c.seq, None)
        self.unreported.clear()
        return outputs


def _shown(c: Completion, params: SamplingParams) -> int:
    """How many of the completion's tokens have text: all but the token that ended it, an
    EOS or a stop token, unless ``include_stop_str_in_output`` (vLLM's rule)."""
    n = c.seq.num_completion_tokens
    if (
        c.finish_reason == "stop"
        and not isinstance(c.stop_reason, str)
        and not params.include_stop_str_in_output
    ):
        return n - 1
    return n


def _put(items: list[Any], i: int, value: Any) -> None:
    """``items[i] = value``, growing the list by one if ``i`` is just past its end."""
    if i < len(items):
        items[i] = value
    else:
        items.append(value)


def _as_dict(lp: TokenLogprobs, tok: Tokenizer | None) -> PositionLogprobs:
    """vLLM's shape: the token actually there first, then the top-k (decoded when there
    is a tokenizer)."""

    def text(t: int) -> str | None:
        return None if tok is None else tok.decode([t])

    out = {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token_id))}
    for r, (t, v) in enumerate(lp.top, start=1):
        if t not in out:
            out[t] = Logprob(v, r, text(t))
    return out
