"""From a committed step's results to what ``step`` returns: logprobs stored by position,
timings, finish reasons, text (incremental detokenisation and stop strings), and the
vLLM-shaped outputs. It runs after the scheduler has committed, so it never has to undo
anything: work it did not finish (a tokenizer that raised) is simply still pending, and
``catch_up`` finishes it at the start of the next step, before anything new is computed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from typing import Any

from paged_engine.engine.detokenizer import find_stop
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
from paged_engine.sampling_params import RequestOutputKind

RunnerResult = int | FailedSample | SampleOutput | None


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

    @property
    def pending(self) -> bool:
        """Work left without a model step: text to produce, or outputs to return."""
        return bool(self.behind or self.unreported)

    def forget(self, request: Request) -> None:
        """Drop an aborted request's records."""
        self.unreported.pop(request.request_id, None)
        for c in request.completions:
            self.owner.pop(c.seq, None)
            self.behind.pop(c, None)

    def absorb(
        self, seqs: list[Sequence], results: SequenceABC[RunnerResult]
    ) -> list[int | FailedSample | None]:
        """Store the results' logprobs by position; return the plain tokens. Idempotent:
        a failed step's entries are overwritten when the positions are computed again."""
        if len(results) != len(seqs):
            raise RuntimeError(f"the model runner returned {len(results)} results for {len(seqs)}")
        tokens: list[int | FailedSample | None] = []
        for seq, r in zip(seqs, results, strict=True):
            if not isinstance(r, SampleOutput):
                tokens.append(r)
                continue
            tokens.append(r.token)
            request, c = self.owner[seq]
            if r.logprobs is not None:
                _put(c.logprobs, seq.num_completion_tokens, r.logprobs)
            if r.prompt_logprobs:
                first = seq.num_cached_tokens + 1
                for k, lp in enumerate(r.prompt_logprobs):
                    request.prompt_logprobs[first + k] = lp
        return tokens

    def note(
        self, seqs: list[Sequence], tokens: list[int | FailedSample | None], all_news: bool
    ) -> None:
        """After a committed step: timings, finish reasons, who has news (``all_news``:
        every request that produced a token; else only finished ones are reported)."""
        now = time.time()
        sched = self.scheduler
        for seq, t in zip(seqs, tokens, strict=True):
            request, c = self.owner[seq]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if t is None:
                continue
            if all_news and request.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                self.unreported[request.request_id] = request
            if isinstance(t, int):
                request.last_token_time = now
                if request.first_token_time is None:
                    request.first_token_time = now
            params = request.params
            if c.detok is not None or params.logprobs is not None:
                self.behind[c] = request
        while sched.finished:
            seq = sched.finished[0]
            request, c = self.owner[seq]
            c.finish_reason = sched.finish_reason(seq)
            c.stop_reason = sched.stop_reason(seq)
            sched.errors.pop(seq.seq_id, None)
            self.behind[c] = request
            self.unreported[request.request_id] = request
            sched.finished.pop(0)

    def catch_up(self) -> None:
        """Bring every completion's text and decoded logprobs up to its tokens; end the
        ones a stop string stops. Each completion is done or untouched if this raises."""
        while self.behind:
            c, request = next(iter(self.behind.items()))
            self._detokenize(request, c)
            del self.behind[c]

    def _detokenize(self, request: Request, c: Completion) -> None:
        params, seq, tok = request.params, c.seq, self.tokenizer
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self._decode_logprobs(request, c)
        if c.detok is not None and tok is not None:
            if c.detok.num_tokens > seq.num_completion_tokens:  # a failed step dropped one
                c.detok.reset(request.prompt_token_ids)
            if c.finish_reason == "error":
                c.text = c.detok.text
                return
            new = c.detok.add(tok, seq.completion_token_ids[c.detok.num_tokens :])
            if c.finish_reason is not None:  # ended by its tokens: nothing will follow
                new += c.detok.flush(tok)
            c.text = c.detok.text
            stop_terminated = c.finish_reason == "stop"  # by EOS or a stop token
            if (
                params.stop
                and new
                and not stop_terminated
                and seq.num_completion_tokens >= params.min_tokens
            ):
                hit = find_stop(c.text, len(new), params.stop)
                if hit is not None:
                    stop, at = hit
                    c.text = (
                        c.text[: at + len(stop)]
                        if params.include_stop_str_in_output
                        else c.text[:at]
                    )
                    if c.finish_reason is None:
                        self.scheduler.finish_now(seq)
                    c.finish_reason, c.stop_reason = "stop", stop
                    self.unreported[request.request_id] = request
        elif c.finish_reason is not None and tok is not None and params.detokenize:
            c.text = tok.decode(
                seq.completion_token_ids, skip_special_tokens=params.skip_special_tokens
            )
        if c.finish_reason is not None and request.finished and request.finished_time is None:
            request.finished_time = time.time()

    def _decode_logprobs(self, request: Request, c: Completion) -> None:
        tok = self.tokenizer if request.params.detokenize else None
        n = c.seq.num_completion_tokens
        for i in range(len(c.decoded), min(n, len(c.logprobs))):
            _put(c.decoded, i, _as_dict(c.logprobs[i], tok))
        if c.index == 0 and request.prompt_logprobs:
            for p, lp in enumerate(request.prompt_logprobs):
                if lp is not None and request.decoded_prompt_logprobs[p] is None:
                    request.decoded_prompt_logprobs[p] = _as_dict(lp, tok)

    def report(self, report_running: bool) -> list[RequestOutput]:
        """Outputs for the requests with news; finished requests leave the engine."""
        outputs = []
        for rid, request in list(self.unreported.items()):
            if request.finished:
                outputs.append(request.output())
                del self.requests[rid]
                for c in request.completions:
                    self.owner.pop(c.seq, None)
            elif report_running:
                outputs.append(request.output())
        self.unreported.clear()
        return outputs


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
