"""Log-probabilities from the model's raw distribution (vLLM's default ``raw_logprobs``):
the log-softmax of the logits before penalties, temperature or any filter."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from paged_engine.engine.outputs import FailedSample, TokenLogprobs


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """For row ``r`` of ``logits`` ``[R, V]``: the logprob and rank of ``token_ids[r]``
    and the ``num_top[r]`` most likely tokens (at most ``V``), most likely first.

    The rank is 1 + the number of tokens with a strictly larger logprob, so tied tokens
    share the better rank. One device-to-host transfer.
    """
    rows, vocab = logits.shape
    if len(token_ids) != rows or len(num_top) != rows:
        raise ValueError(f"{rows} logit rows but {len(token_ids)} tokens and {len(num_top)} ks")
    if rows == 0:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64).to(logits.device)[:, None]
    chosen = logprobs.gather(1, ids)
    rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1
    k = min(max(num_top), vocab)
    top_values, top_ids = logprobs.topk(k, dim=-1)
    # one transfer: [chosen, rank, top values..., top ids...] per row, in float64 so
    # that ids and ranks stay exact
    parts = (chosen, rank, top_values, top_ids)
    packed = torch.cat([t.double() for t in parts], dim=1).tolist()
    out = []
    for r, row in enumerate(packed):
        kr = min(num_top[r], vocab)
        top = tuple((int(row[2 + k + j]), row[2 + j]) for j in range(kr))
        out.append(TokenLogprobs(token_ids[r], row[0], int(row[1]), top))
    return out


def sampled_logprobs(
    logits: torch.Tensor,
    num_top: Sequence[int | None],
    tokens: Sequence[int | FailedSample | None],
) -> dict[int, TokenLogprobs]:
    """Row -> logprobs of its sampled token, for each row of ``logits`` that asks for them
    (``num_top[r]`` is not None) and sampled a token (``tokens[r]`` is an id, not None
    or a ``FailedSample``)."""
    asked = [
        (r, t, k)
        for r, (t, k) in enumerate(zip(tokens, num_top, strict=True))
        if isinstance(t, int) and k is not None
    ]
    if not asked:
        return {}
    at = torch.tensor([r for r, _, _ in asked], device=logits.device)
    found = token_logprobs(logits[at], [t for _, t, _ in asked], [k for _, _, k in asked])
    return {r: lp for (r, _, _), lp in zip(asked, found, strict=True)}


PROMPT_LOGITS_ROWS = 512
"""Prompt rows turned into logits at a time: ``[rows, vocab]`` float logits of a whole long
prompt would not fit (8k rows of a 150k vocabulary are 5 GB)."""


def prompt_logprobs(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    next_tokens: Sequence[int],
    num_top: int,
) -> tuple[TokenLogprobs, ...]:
    """Logprobs of ``next_tokens[q]`` (the prompt token that row ``q`` of ``hidden``
    predicts) and the ``num_top`` most likely tokens, ``PROMPT_LOGITS_ROWS`` rows at a
    time."""
    out: list[TokenLogprobs] = []
    for first in range(0, len(next_tokens), PROMPT_LOGITS_ROWS):
        last = min(first + PROMPT_LOGITS_ROWS, len(next_tokens))
        logits = compute_logits(hidden[first:last])
        out += token_logprobs(logits, next_tokens[first:last], [num_top] * (last - first))
    return tuple(out)
