"""Next-token selection for a batch, in vLLM's order: the grammar masks of structured
outputs (``grammar_mask.py``), min_tokens, logit_bias and the penalties
(``logits_processors.py``), then greedy or temperature, min_p, top-k, top-p and a draw with
per-request seeds."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence

import torch

from paged_engine.engine.outputs import FailedSample
from paged_engine.kernels.sample_ops_cpu import argmax_finite
from paged_engine.layers.grammar_mask import TokenMask, apply_token_bitmask
from paged_engine.layers.logits_processors import (
    TokenHistory,
    apply_logits_processors,
    processes,
)
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
    return (p.top_k is not None and p.top_k < vocab) or p.top_p < 1.0 or p.min_p > 0.0


def _scaled(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits / temperature`` per row, shifted first so each row's maximum is 0.

    Every non-greedy temperature is >= ``GREEDY_BELOW``, and after the shift the quotient
    can only overflow towards ``-inf`` (probability 0) while the top token stays at 0, so
    finite logits always give a valid distribution (a temperature beyond float32 is
    ``inf``: every quotient is 0, the uniform distribution).
    """
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    return (logits - logits.amax(dim=-1, keepdim=True)) / temps[:, None]


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, min_p, top-k, then top-p over the renormalised survivors; vocabulary
    order.

    vLLM's order: min_p drops the tokens less likely than ``min_p`` times the most likely
    one in the temperature-scaled distribution (transformers' ``MinPLogitsWarper``), before
    top-k and top-p. All three keep a prefix of the tokens sorted by logit, so they work
    on the sorted row and the result is scattered back. The most likely token is always
    kept.
    """
    device, vocab = logits.device, logits.shape[1]
    # top_k may be any int >= 1: clamped to the vocabulary before it becomes a tensor
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    sorted_logits, order = _scaled(logits, params).sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        full = torch.softmax(sorted_logits, dim=-1)
        drop |= full < min_p * full[:, :1]  # the first sorted token is the most likely
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p) & (top_p < 1.0) & (ranks > 0)
    probs = probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row of ``logits`` ``[R, V]`` is drawn from under its
    (non-greedy) params: temperature, then min_p, top-k and top-p where they filter.

    Rows are grouped by whether they filter, never mixed, so each row's probabilities
    depend only on its own logits and params."""
    vocab = logits.shape[1]
    probs = torch.empty_like(logits)
    for wants_filter in (False, True):
        group = [j for j, p in enumerate(params) if _needs_filter(p, vocab) == wants_filter]
        if len(group) == len(params):
            return _filtered_probs(logits, params) if wants_filter else _softmax(logits, params)
        if group:
            at = torch.tensor(group, device=logits.device)
            fn = _filtered_probs if wants_filter else _softmax
            probs[at] = fn(logits[at], [params[j] for j in group])
    return probs


def _softmax(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    return torch.softmax(_scaled(logits, params), dim=-1)


class Sampler:
    """Picks one token per row of ``logits`` from that request's ``SamplingParams``.

    A row whose logits are not all finite (NaN or inf, e.g. from broken weights) gets None,
    never a token: whatever argmax or a draw would pick from it is meaningless. The check
    reads the model's own logits, before min_tokens or a bias bring in their -inf; a row
    whose processing leaves no token at all (every one -inf) gets None too.

    Rows that use a logits processor are processed first (a copy of just those rows; see
    ``logits_processors.py``); greedy params (``temperature < GREEDY_BELOW``, never
    divided by) are then the argmax (first index on ties), and the rest are drawn after
    temperature, min_p, top-k and top-p (vLLM's order). Every row's probabilities depend
    only on its own logits, params and history, and a row with a ``torch.Generator`` of
    its own draws its noise alone from it in vocabulary order, so a seeded request samples
    the same tokens whatever else shares the batch. Rows that share a generator (unseeded
    requests share the engine's) draw together, in one call.

    One request's failure is its own: if processing or the probabilities raise (an
    ``Exception``) for the batch, each row is redone alone, and a row that raises alone
    gets a ``FailedSample`` naming the error while the others get exactly the tokens they
    get without it (no draw happens before either phase ends, and each seeded row's draw
    is guarded alone). The rest of the batch never pays for it: the batched path runs
    first, and only a failure costs the row-by-row retry.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[TokenHistory | None] | None = None,
        eos_token_ids: Collection[int] = (),
        token_mask: TokenMask | None = None,
    ) -> list[int | FailedSample | None]:
        """``logits`` ``[B, V]`` → ``B`` token ids, None for a row that is not all finite,
        ``FailedSample`` for a row whose sampling raised.

        ``histories[i]`` is row ``i``'s sequence so far (its prompt and output tokens),
        needed by rows with penalties, min_tokens or bad words; ``eos_token_ids`` are the
        ids min_tokens masks beside each row's ``stop_token_ids``. ``token_mask`` holds the
        grammar bitmasks of the rows with structured outputs: their disallowed tokens get
        -inf before anything else (greedy, processors, temperature); the other rows are
        untouched.

        One device-to-host transfer per call; an all-greedy batch without processors or
        grammar masks costs one pass over the logits (``argmax_finite``), never a float32
        copy of them.
        """
        batch = logits.shape[0]
        hist = [None] * batch if histories is None else histories
        if len(params) != batch or len(generators) != batch or len(hist) != batch:
            raise ValueError(
                f"{batch} logit rows but {len(params)} params, {len(generators)} generators "
                f"and {len(hist)} histories"
            )
        tokens, ok = argmax_finite(logits)  # the model's own logits, any dtype
        failed: dict[int, FailedSample] = {}
        active = [i for i in range(batch) if processes(params[i], hist[i])]
        if token_mask is None and not active and all(p.greedy for p in params):
            return _finish(tokens, ok, failed)
        logits = logits.float()
        dev = logits.device
        if token_mask is not None:  # after the finiteness check, which reads the model's
            logits = apply_token_bitmask(logits, *token_mask)
            at = _index(token_mask[1], dev)
            masked = logits[at]
            ok[at] = ok[at] & (masked.amax(dim=-1) > float("-inf"))
            tokens[at] = masked.argmax(dim=-1)
        active, processed = _isolated(
            lambda rows: apply_logits_processors(
                logits[_index(rows, dev)],
                [params[i] for i in rows],
                [hist[i] for i in rows],
                eos_token_ids,
            ),
            active,
            failed,
        )
        if processed is not None:
            at = _index(active, dev)
            tokens[at] = processed.argmax(dim=-1)
            ok[at] = ok[at] & (processed.amax(dim=-1) > float("-inf"))
        sampled = [i for i, p in enumerate(params) if not p.greedy and i not in failed]
        if sampled:
            rows = logits[_index(sampled, dev)]
            if processed is not None:
                where = {i: j for j, i in enumerate(active)}
                both = [(k, where[i]) for k, i in enumerate(sampled) if i in where]
                if both:
                    into, src = zip(*both, strict=True)
                    rows[_index(into, dev)] = processed[_index(src, dev)]
            position = {i: k for k, i in enumerate(sampled)}

            def rows_of(rs: list[int]) -> torch.Tensor:  # no copy for the whole batch
                return rows if rs is sampled else rows[_index([position[i] for i in rs], dev)]

            drawn, probs = _isolated(
                lambda rs: probabilities(rows_of(rs), [params[i] for i in rs]), sampled, failed
            )
            if probs is not None:
                picked = _draws(probs, [generators[i] for i in drawn], drawn, failed)
                tokens[_index(drawn, dev)] = picked
        return _finish(tokens, ok, failed)


def _finish(
    tokens: torch.Tensor, ok: torch.Tensor, failed: dict[int, FailedSample]
) -> list[int | FailedSample | None]:
    """The tokens as ints in one transfer (a row that is not all finite as None), and each
    failed row's ``FailedSample``."""
    tokens.masked_fill_(~ok, -1)  # -1: no token id is
    out: list[int | FailedSample | None] = [t if t >= 0 else None for t in tokens.tolist()]
    for i, failure in failed.items():
        out[i] = failure
    return out


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _failure(exc: Exception) -> FailedSample:
    return FailedSample(f"sampling this request failed: {type(exc).__name__}: {exc}")


def _isolated(
    run: Callable[[list[int]], torch.Tensor],
    rows: list[int],
    failed: dict[int, FailedSample],
) -> tuple[list[int], torch.Tensor | None]:
    """``run(rows)`` (one result row per row), or, if it raises, each row alone: the rows
    that did not raise and their results; each one that did lands in ``failed``."""
    if not rows:
        return rows, None
    try:
        return rows, run(rows)
    except Exception:
        pass
    kept, parts = [], []
    for r in rows:
        try:
            parts.append(run([r]))
        except Exception as exc:
            failed[r] = _failure(exc)
        else:
            kept.append(r)
    return kept, torch.cat(parts) if parts else None


def _draws(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    rows: Sequence[int],
    failed: dict[int, FailedSample],
) -> torch.Tensor:
    """One draw per row of ``probs``, the rows that share a generator (None, or one object
    such as the engine's generator of unseeded requests) in one call, in row order: on the
    CPU that fills their noise from the generator's stream exactly as one call per row
    did, and a seeded request's own generator still draws alone. A group whose call raises
    is drawn row by row (``_isolated``); a row whose draw raises lands in ``failed`` (as
    ``rows[j]``) and keeps index 0, which the caller overrides."""
    device = probs.device
    picked = torch.zeros(len(generators), dtype=torch.long, device=device)
    position = {r: j for j, r in enumerate(rows)}
    groups: dict[int, list[int]] = {}  # by the generator's identity: objects, not seeds
    for j, g in enumerate(generators):
        groups.setdefault(id(g), []).append(rows[j])
    for group in groups.values():
        generator = generators[position[group[0]]]
        draw = functools.partial(_draw_rows, probs, generator, position)
        kept, drawn = _isolated(draw, group, failed)
        if drawn is not None:
            picked[_index([position[r] for r in kept], device)] = drawn
    return picked


def _draw_rows(
    probs: torch.Tensor,
    generator: torch.Generator | None,
    position: dict[int, int],
    rows: list[int],
) -> torch.Tensor:
    """``rows`` (batch rows, at ``position`` in ``probs``) drawn in one call."""
    return _draw(probs[_index([position[r] for r in rows], probs.device)], generator)
