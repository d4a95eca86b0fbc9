"""What a step's outputs look like between the engine core process and the API process.

Why a wire format of its own: a ``RequestOutput`` carries the prompt (its text and every
prompt token id) and the text so far, in every output of every step. Pickled as it is, the
core would spend its time, and the API process its GIL, on bytes the other side already
has. So the core runs each request without text (``core_params``: no detokenizing, no stop
strings, ``DELTA`` outputs) and sends per request and step a ``WireOutput``: the new token
ids, their logprobs undecoded, the endings, and the prompt only in the request's first
output. The API process makes the text (``core_outputs.py``), as vLLM V1's API server
detokenizes for its engine core.

Plain named tuples: pickle writes them as a class reference and a tuple, the cheapest
record it has; no field is a Python object that takes work to rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from paged_engine.engine.request import PositionLogprobs, RequestMetrics, RequestOutput
from paged_engine.sampling_params import RequestOutputKind, SamplingParams


class WireCompletion(NamedTuple):
    """One completion's news in a step: its new tokens (and their logprobs, undecoded),
    its cumulative logprob, and its ending as the core sees it."""

    completion_index: int
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class WireOutput(NamedTuple):
    """One request's output of a step (every completion, as ``RequestOutput`` has them).
    ``prompt_token_ids`` (with ``prompt`` and ``prompt_logprobs``) come in the request's
    first output only, else None."""

    request_id: str
    completions: tuple[WireCompletion, ...]
    finished: bool
    num_cached_tokens: int | None
    metrics: tuple[float, float | None, float | None, float | None, float | None]
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[PositionLogprobs | None] | None


@dataclass(frozen=True, slots=True)
class Restarted:
    """The core set a request aside and will run it again from its prompt (fault
    isolation, ``routes.py``): what the API process built of it so far is void."""

    request_id: str


def core_params(params: SamplingParams) -> SamplingParams:
    """``params`` as the core runs them: tokens only (the API process detokenizes and
    searches stop strings), reported step by step. The core's tokens do not depend on
    what is left out (the sampler never reads the text). ``FINAL_ONLY`` is kept: the
    core's relaying ``Routes`` run it step by step too, but know its client has seen
    nothing, so fault isolation may run it again (``Restarted``)."""
    kind = params.output_kind
    return replace(
        params,
        detokenize=False,
        stop=(),
        include_stop_str_in_output=False,
        output_kind=kind if kind is RequestOutputKind.FINAL_ONLY else RequestOutputKind.DELTA,
    )


def encode(out: RequestOutput, first: bool) -> WireOutput:
    """A core-side ``DELTA`` output of a request run with ``core_params``, for the wire;
    ``first``: the request's first output (the prompt goes with it)."""
    m = out.metrics
    return WireOutput(
        out.request_id,
        tuple(
            WireCompletion(
                c.index,
                c.token_ids,
                c.logprobs,
                c.cumulative_logprob,
                c.finish_reason,
                c.stop_reason,
            )
            for c in out.outputs
        ),
        out.finished,
        out.num_cached_tokens,
        (
            m.arrival_time,
            m.first_scheduled_time,
            m.first_token_time,
            m.last_token_time,
            m.finished_time,
        ),
        out.prompt if first else None,
        out.prompt_token_ids if first else None,
        out.prompt_logprobs if first else None,
    )


def metrics_of(w: WireOutput, finished_time: float | None) -> RequestMetrics:
    """The request's metrics as sent, with ``finished_time`` when the API process ended
    it (a stop string) and the core had not."""
    arrival, scheduled, first_token, last_token, finished = w.metrics
    return RequestMetrics(arrival, scheduled, first_token, last_token, finished or finished_time)
