"""The logit processors that can change even a greedy choice, in vLLM's order:
allowed_token_ids, bad_words, min_tokens, logit_bias, then the repetition, frequency and
presence penalties.

Only rows that use one of them come here (``processes``); the rest of a batch pays nothing.
Each row's result depends only on its own logits, params and history.
"""

from __future__ import annotations

import array
from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from paged_engine.sampling_params import SamplingParams


class TokenHistory(Protocol):
    """What the processors read of a sequence: its tokens so far, the prompt first
    (``engine.sequence.Sequence`` is one)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...


def _num_output(history: TokenHistory) -> int:
    return len(history.token_ids) - history.num_prompt_tokens


def _masks_stops(params: SamplingParams, history: TokenHistory) -> bool:
    return _num_output(history) < params.min_tokens


def processes(params: SamplingParams, history: TokenHistory | None) -> bool:
    """Whether this row needs any processor now (min_tokens only until it is reached).

    Without a history, only ``logit_bias``, ``allowed_token_ids`` and one-token bad words
    can apply; ``apply_logits_processors`` refuses a row that needs one."""
    if params.logit_bias is not None or params.allowed_token_ids is not None:
        return True
    if params.bad_words or params.bad_words_token_ids:
        return True
    if params.has_penalties:
        return True
    return params.min_tokens > 0 and (history is None or _masks_stops(params, history))


def _flat_ids(
    rows: list[tuple[int, Sequence[int]]], vocab: int, device: torch.device
) -> torch.Tensor:
    """``row * vocab + token`` for every token of every listed row (ids beyond the
    vocabulary dropped): indices into the flattened ``[R, V]`` logits."""
    parts = [torch.tensor(ids, dtype=torch.int64) for _, ids in rows]
    lengths = torch.tensor([len(ids) for _, ids in rows], dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.tensor([r for r, _ in rows]), lengths)
    ids = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    keep = ids < vocab
    return (row_of[keep] * vocab + ids[keep]).to(device, non_blocking=True)


def _counts(
    rows: list[tuple[int, Sequence[int]]], shape: torch.Size, device: torch.device
) -> torch.Tensor:
    """``[R, V]`` float counts of each token in each listed row (other rows 0)."""
    n, vocab = shape
    flat = _flat_ids(rows, vocab, device)
    return torch.bincount(flat, minlength=n * vocab).view(n, vocab).float()


def apply_logits_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """Apply allowed_token_ids, bad_words, min_tokens, logit_bias and the penalties to
    ``logits`` ``[R, V]`` (float32, modified in place and returned), row ``r`` with
    ``params[r]`` and ``histories[r]``.

    * **allowed_token_ids**: every other token gets -inf (vLLM's whitelist).
    * **bad_words**: the last token of each ``bad_words_token_ids`` word gets -inf when
      the row's output tokens end with the word's other tokens (always, for a one-token
      word; vLLM's rule).
    * **min_tokens**: while a row has generated fewer than ``min_tokens`` tokens, every
      id in ``eos_token_ids`` and its ``stop_token_ids`` gets -inf (vLLM masks all of
      them, whatever ``ignore_eos`` says; ids beyond the vocabulary cannot be sampled
      anyway).
    * **logit_bias** is added (a sum beyond float32 is clamped to its largest value at the
      end, so a large bias forces a token but never makes a row infinite).
    * **repetition_penalty** over every token the sequence holds (prompt and output),
      transformers' ``RepetitionPenaltyLogitsProcessor``: a positive logit is divided by
      it, any other multiplied.
    * **frequency_penalty** × count and **presence_penalty** × (count > 0), subtracted,
      over the output tokens only (OpenAI's definition, vLLM's).

    ValueError (naming the row) for a token id beyond the vocabulary, ``bad_words`` that
    were never tokenized, or a row that needs a history it was not given; ``logits`` is
    untouched then. (``engine/inputs.check_request`` refuses all of these at admission.)
    """
    n, vocab = logits.shape
    device = logits.device
    if len(params) != n or len(histories) != n:
        raise ValueError(f"{n} logit rows but {len(params)} params and {len(histories)} histories")
    for r, (p, h) in enumerate(zip(params, histories, strict=True)):
        _check_row(r, p, h, vocab)
    _apply_allowed(logits, params)
    _apply_bad_words(logits, params, histories)
    # min_tokens: (row, id) pairs set to -inf
    masked = [
        (r, t)
        for r, (p, h) in enumerate(zip(params, histories, strict=True))
        if h is not None and p.min_tokens > 0 and _masks_stops(p, h)
        for t in {*eos_token_ids, *p.stop_token_ids}
        if t < vocab
    ]
    if masked:
        rows, ids = zip(*masked, strict=True)
        logits[torch.tensor(rows, device=device), torch.tensor(ids, device=device)] = float("-inf")
    biased = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias or ()]
    if biased:
        rows, ids, values = zip(*biased, strict=True)
        at = (torch.tensor(rows, device=device), torch.tensor(ids, device=device))
        logits[at] += torch.tensor(values, dtype=torch.float32, device=device)
    _apply_penalties(logits, params, histories)
    # a huge bias (or a repetition penalty < 1 on it) may overflow: +inf would leave no
    # distribution, the largest float forces the token all the same
    return logits.clamp_(max=torch.finfo(torch.float32).max)


def _check_row(r: int, p: SamplingParams, h: TokenHistory | None, vocab: int) -> None:
    words = p.bad_words_token_ids or ()
    if h is None and (p.has_penalties or p.min_tokens > 0 or any(len(w) > 1 for w in words)):
        raise ValueError(
            f"row {r} uses penalties, min_tokens or bad_words but has no token history"
        )
    if p.bad_words and p.bad_words_token_ids is None:
        raise ValueError(f"row {r}: its bad_words were never tokenized (see check_request)")
    named = [
        ("logit_bias", p.logit_bias[-1][0] if p.logit_bias else None),
        ("allowed_token_ids", max(p.allowed_token_ids) if p.allowed_token_ids else None),
        ("bad_words", max(t for w in words for t in w) if words else None),
    ]
    for field, top in named:
        if top is not None and top >= vocab:
            raise ValueError(
                f"row {r}: {field} names token {top}, beyond the vocabulary of {vocab} tokens"
            )


def _ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    # through an array (one C loop packs the ints, torch adopts the buffer): quicker than
    # torch.tensor's element-by-element inference on a long tuple of ints
    return torch.frombuffer(array.array("q", ids), dtype=torch.int64).to(device)


def _apply_allowed(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows = [(r, p.allowed_token_ids) for r, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return
    banned = torch.ones(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    for j, (_, ids) in enumerate(rows):
        banned[j, _ids(ids, logits.device)] = False
    at = torch.tensor([r for r, _ in rows], device=logits.device)
    logits[at] = logits[at].masked_fill(banned, float("-inf"))


def _apply_bad_words(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
) -> None:
    banned: list[tuple[int, int]] = []
    for r, (p, h) in enumerate(zip(params, histories, strict=True)):
        if not p.bad_words_token_ids:
            continue
        tokens = h.token_ids if h is not None else ()
        generated = len(tokens) - h.num_prompt_tokens if h is not None else 0
        for word in p.bad_words_token_ids:
            k = len(word) - 1  # the tokens that must end the output
            if k == 0 or (generated >= k and tuple(tokens[len(tokens) - k :]) == word[:-1]):
                banned.append((r, word[-1]))
    if banned:
        rows, ids = zip(*banned, strict=True)
        dev = logits.device
        logits[torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)] = float("-inf")


def _apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
) -> None:
    device = logits.device
    rep = [
        (r, h.token_ids)
        for r, (p, h) in enumerate(zip(params, histories, strict=True))
        if h is not None and p.repetition_penalty != 1.0
    ]
    if rep:
        seen = _counts(rep, logits.shape, device) > 0
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        penalty = torch.where(seen, penalty, 1.0)
        logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    additive = [
        (r, h.token_ids[h.num_prompt_tokens :])
        for r, (p, h) in enumerate(zip(params, histories, strict=True))
        if h is not None and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)
    ]
    if additive:
        counts = _counts(additive, logits.shape, device)
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        logits -= freq * counts
        logits -= pres * (counts > 0)
