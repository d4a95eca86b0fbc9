"""What a model runner returns per scheduled sequence, beyond the token: torch-free records
the engine turns into vLLM-shaped outputs (``Logprob`` dictionaries)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FailedSample:
    """What a model runner returns, in place of a token, for a sequence it could not
    sample (its logits were not finite): the request finishes with ``finish_reason
    "error"`` and ``reason`` as its ``stop_reason``, and the rest of the batch goes on."""

    reason: str


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities at one position, from the model's raw distribution (the log-softmax
    of its logits before temperature, penalties or any filter: vLLM's default).

    ``token_id`` is the token actually there (sampled, or the prompt's), with its
    ``logprob`` and ``rank`` (1 = the most likely; ties share the better rank). ``top``
    holds the ``k`` most likely tokens, most likely first, ``k`` being what the request
    asked for (it may be 0).
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """A runner's result for one scheduled sequence when it carries more than the token.

    ``token`` is as a plain result would be: the sampled id, ``FailedSample``, or None for
    a prefill chunk that does not finish its prompt. ``logprobs`` is set when the request
    asked for ``logprobs`` and a token was sampled. ``prompt_logprobs`` (when the request
    asked for them) covers the prompt positions this step's rows predict: for a chunk
    computing positions ``[start, end)``, row ``q`` predicts the token at ``q + 1``, so
    it holds prompt positions ``start + 1`` to ``min(end, num_prompt_tokens - 1)``
    inclusive, in order (position 0 has none; the last prompt row predicts the first
    generated token, which is ``logprobs``).
    """

    token: int | FailedSample | None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
