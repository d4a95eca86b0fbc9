"""Next-token selection for a batch: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_engine.sampling_params import SamplingParams

_MIN_EXPONENTIAL = 1e-10
"""Floor for the exponential noise, so ``prob / noise`` is never ``0 / 0``."""


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Sample one index per row of ``probs`` ``[R, V]`` (unnormalised is fine).

    The exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)``, is a draw from ``p``; it
    needs no device sync and gives zero-probability tokens no chance (``0 / E == 0``).
    """
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise.clamp_min_(_MIN_EXPONENTIAL)).argmax(dim=-1)


def _needs_filter(p: SamplingParams, vocab: int) -> bool:
    return (p.top_k is not None and p.top_k < vocab) or p.top_p < 1.0


def _scaled(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits / temperature`` per row, shifted first so each row's maximum is 0.

    Every non-greedy temperature is >= ``GREEDY_BELOW``, and after the shift the quotient
    can only overflow towards ``-inf`` (probability 0) while the top token stays at 0, so
    finite logits always give a valid distribution (a temperature beyond float32 is
    ``inf``: every quotient is 0, the uniform distribution).
    """
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    return (logits - logits.amax(dim=-1, keepdim=True)) / temps[:, None]


def _softmax(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    return torch.softmax(_scaled(logits, params), dim=-1)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, then top-p over the renormalised top-k; vocabulary order.

    Both filters keep a prefix of the tokens sorted by logit, so they work on the sorted
    row and the result is scattered back. The most likely token is always kept.
    """
    device, vocab = logits.device, logits.shape[1]
    # top_k may be any int >= 1: clamped to the vocabulary before it becomes a tensor
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    sorted_logits, order = _scaled(logits, params).sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    probs = torch.softmax(sorted_logits.masked_fill(ranks >= top_k, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p) & (top_p < 1.0) & (ranks > 0)
    probs = probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, probs)


class Sampler:
    """Picks one token per row of ``logits`` from that request's ``SamplingParams``.

    A row whose logits are not all finite (NaN or inf, e.g. from broken weights) gets None,
    never a token: whatever argmax or a draw would pick from it is meaningless. Greedy
    params (``temperature < GREEDY_BELOW``, never divided by) are argmax (first index on
    ties). Otherwise the order is that of transformers' and vLLM's samplers: temperature,
    top-k, top-p, draw. Every row's probabilities depend only on its own logits and params
    (rows are grouped by whether they filter, never mixed), and a row with a
    ``torch.Generator`` draws its noise alone from it in vocabulary order, so a seeded
    request samples the same tokens whatever else shares the batch. Unseeded rows draw
    together.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int | None]:
        """``logits`` ``[B, V]`` → ``B`` token ids, None for a row that is not all finite.

        One device-to-host transfer per call; an all-greedy batch costs an argmax and the
        finiteness check.
        """
        batch = logits.shape[0]
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"{batch} logit rows but {len(params)} params and {len(generators)} generators"
            )
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            self._sample(logits, tokens, sampled, params, generators)
        # one transfer: non-finite rows come back as -1, which no token id is
        tokens.masked_fill_(~torch.isfinite(logits).all(dim=-1), -1)
        return [t if t >= 0 else None for t in tokens.tolist()]

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        tokens: torch.Tensor,
        sampled: list[int],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> None:
        """Overwrite ``tokens[sampled]`` with draws (a NaN row draws garbage, never fails)."""
        device, vocab = logits.device, logits.shape[1]
        probs = torch.empty(len(sampled), vocab, device=device)
        for wants_filter, fn in ((False, _softmax), (True, _filtered_probs)):
            group = [
                j for j, i in enumerate(sampled) if _needs_filter(params[i], vocab) == wants_filter
            ]
            if group:
                rows = torch.tensor([sampled[j] for j in group], device=device)
                probs[torch.tensor(group, device=device)] = fn(
                    logits[rows], [params[sampled[j]] for j in group]
                )
        picked = torch.empty(len(sampled), dtype=torch.long, device=device)
        unseeded = [j for j, i in enumerate(sampled) if generators[i] is None]
        if unseeded:
            sel = torch.tensor(unseeded, device=device)
            picked[sel] = _draw(probs[sel], None)
        for j, i in enumerate(sampled):
            if generators[i] is not None:
                picked[j] = _draw(probs[j : j + 1], generators[i])[0]
        tokens[torch.tensor(sampled, device=device)] = picked
