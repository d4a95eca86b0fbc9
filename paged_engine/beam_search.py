"""Beam search, as vLLM's ``LLM.beam_search`` offers it: ``BeamSearchParams``,
``BeamSearchOutput`` of ``BeamSearchSequence``s (vLLM's names and fields).

Why on top of ``generate`` and not in the scheduler: a beam is a prompt (its prompt and
the tokens chosen so far), so each round asks the engine for one token with the top
``2 * beam_width`` logprobs of every live beam, at once, and keeps the best
``beam_width`` extensions per prompt. The beams share their blocks through the prefix
cache (R4-R6: every full block a round computed is a hit for the next round's longer
beams), so nothing is copied and the allocator needs no copy-on-write, as with ``n``;
only each beam's last, partial block is computed again. ``last_run_stats`` after the
search counts those hits.

Scoring is vLLM's: a beam's cumulative logprob over its length (prompt included, a final
EOS excluded) to the power ``length_penalty``. A beam that ends with an EOS id (unless
``ignore_eos``) leaves the search as completed, and so does a beam that reaches
``max_model_len`` (finish reason ``length``: it has no room for another token); after
``max_tokens`` rounds, or once no beam is live, the live and completed beams are ranked
and the best ``beam_width`` returned, best first. As vLLM's ``LLM.beam_search``, each
one's ``text`` is its whole token list decoded (prompt, completion and a final EOS) with
``skip_special_tokens``, and its logprobs carry ``decoded_token``s (each token id decoded
alone, as ``generate``'s logprobs); ``include_stop_str_in_output`` changes neither.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from paged_engine.engine.detokenizer import Detokenizer
from paged_engine.engine.request import PositionLogprobs, RequestOutput
from paged_engine.errors import InvalidRequestError
from paged_engine.sampling_params import SamplingParams

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "beam_search"]


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's fields. ``temperature`` is the rounds' sampling temperature (0, the
    default: the most likely token is among the candidates anyway); the candidates are
    the top ``2 * beam_width`` logprobs, which ``SamplingParams.logprobs`` reports, and
    the sampled token where it is not among them (as vLLM's, whose step reports the
    same). ``skip_special_tokens`` is for the beams' text."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(name, f"{name} must be an int >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequestError(name, f"{name} must be a number, got {value!r}")
            if not math.isfinite(value) or (name == "temperature" and value < 0):
                raise InvalidRequestError(name, f"{name} must be finite and >= 0, got {value!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt and the chosen tokens (vLLM's layout);
    ``logprobs`` the top logprobs at each chosen position; ``text`` the decoded tokens,
    set when the search returns it."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True, slots=True)
class BeamSearchOutput:
    """One prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(
    beam: BeamSearchSequence, eos_token_ids: Sequence[int], length_penalty: float
) -> float:
    """vLLM's ranking: cumulative logprob over length ** ``length_penalty`` (the prompt
    counted, a last EOS not)."""
    length = len(beam.tokens) - (1 if beam.tokens[-1] in eos_token_ids else 0)
    return float(beam.cum_logprob / (length**length_penalty))


def beam_search(
    generate: Callable[[list[Any], SamplingParams], list[RequestOutput]],
    prompts: Sequence[Any],
    params: BeamSearchParams,
    *,
    eos_token_ids: Sequence[int],
    tokenizer: Detokenizer | None,
    max_model_len: int | None = None,
) -> list[BeamSearchOutput]:
    """Search every prompt (text, token ids, a ``TextPrompt`` or ``TokensPrompt``) with
    ``generate`` (``LLM.generate`` without a progress bar); see the module docstring.
    The rounds do not detokenize: only the returned beams are decoded, at the end."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    step = SamplingParams(
        max_tokens=1,
        temperature=params.temperature,
        logprobs=2 * params.beam_width,
        ignore_eos=True,  # an EOS is a candidate like any token; the search ends a beam
        detokenize=False,
    )
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
    firsts = generate(list(prompts), step)  # the prompts' token ids, and round 1
    lives = [[BeamSearchSequence(list(out.prompt_token_ids))] for out in firsts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    outputs = firsts
    for round_ in range(params.max_tokens):
        if round_:
            batch = [
                {"prompt_token_ids": b.tokens, **({"cache_salt": s} if s else {})}
                for beams, s in zip(lives, salts, strict=True)
                for b in beams
            ]
            outputs = generate(batch, step) if batch else []
        it = iter(outputs)
        for i, beams in enumerate(lives):
            grown: list[BeamSearchSequence] = []
            for beam in beams:
                (top,) = next(it).outputs[0].logprobs or [{}]
                for token, lp in top.items():
                    child = BeamSearchSequence(
                        [*beam.tokens, token], [*beam.logprobs, top], beam.cum_logprob + lp.logprob
                    )
                    (done[i] if token in eos else grown).append(child)
            grown.sort(key=lambda b: beam_score(b, eos, params.length_penalty), reverse=True)
            lives[i] = []
            for b in grown[: params.beam_width]:  # a full beam has no room for a token
                full = max_model_len is not None and len(b.tokens) >= max_model_len
                (done[i] if full else lives[i]).append(b)
        if not any(lives):
            break
    results = []
    for prompt_beams, completed in zip(lives, done, strict=True):
        ranked = sorted(
            completed + prompt_beams,
            key=lambda b: beam_score(b, eos, params.length_penalty),
            reverse=True,
        )[: params.beam_width]
        for b in ranked:
            b.finish_reason = "stop" if b.tokens[-1] in eos else "length"
            if tokenizer is not None:
                b.text = tokenizer.decode(b.tokens, skip_special_tokens=params.skip_special_tokens)
                b.logprobs = [_decoded(top, tokenizer) for top in b.logprobs]
        results.append(BeamSearchOutput(ranked))
    return results


def _decoded(top: PositionLogprobs, tokenizer: Detokenizer) -> PositionLogprobs:
    """One position's logprobs with each token decoded alone (``generate``'s way)."""
    return {t: replace(lp, decoded_token=tokenizer.decode([t])) for t, lp in top.items()}
