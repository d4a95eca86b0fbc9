"""A non-streamed request's step-by-step outputs, merged into its final output.

Why: the engine loop runs every server request with ``RequestOutputKind.DELTA``, so each
step that gives a request tokens reports them at once. That is what lets the loop
measure every request's inter-token latency as its tokens arrive, and see which requests
a successful step advanced (``isolation``), without reading the engine's internals. A
request whose client wants one response gets the merge: the same output
``FINAL_ONLY`` would have given (text, token ids and logprobs concatenated; ending,
cumulative logprob, prompt logprobs and metrics from the last delta). Merging costs a
list append per completion per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_engine.engine.request import CompletionOutput, PositionLogprobs, RequestOutput


@dataclass(slots=True)
class _Completion:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    last: CompletionOutput | None = None


@dataclass(slots=True)
class Gathered:
    """The deltas of one request so far (see the module docstring)."""

    completions: dict[int, _Completion] = field(default_factory=dict)
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        for c in out.outputs:
            acc = self.completions.setdefault(c.index, _Completion())
            acc.text.append(c.text)
            acc.token_ids += c.token_ids
            if c.logprobs is not None:
                if acc.logprobs is None:
                    acc.logprobs = []
                acc.logprobs += c.logprobs
            acc.last = c
        self.last = out

    def reset(self) -> None:
        """Forget what was gathered (the request is run again from its prompt)."""
        self.completions.clear()
        self.last = None

    def result(self) -> RequestOutput:
        """The merged output, in lists of its own (a ``CUMULATIVE`` client may keep each
        one while more is gathered); needs at least one ``add``."""
        last = self.last
        assert last is not None, "nothing was gathered"
        outputs = []
        for index in sorted(self.completions):
            acc = self.completions[index]
            tail = acc.last
            assert tail is not None
            outputs.append(
                CompletionOutput(
                    index=index,
                    text="".join(acc.text),
                    token_ids=list(acc.token_ids),
                    cumulative_logprob=tail.cumulative_logprob,
                    logprobs=None if acc.logprobs is None else list(acc.logprobs),
                    finish_reason=tail.finish_reason,
                    stop_reason=tail.stop_reason,
                )
            )
        return RequestOutput(
            request_id=last.request_id,
            prompt=last.prompt,
            prompt_token_ids=last.prompt_token_ids,
            prompt_logprobs=last.prompt_logprobs,  # the last delta's own list
            outputs=outputs,
            finished=last.finished,
            num_cached_tokens=last.num_cached_tokens,
            metrics=last.metrics,
        )
