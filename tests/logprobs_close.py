"""vLLM's criterion for comparing two greedy generations that need not be token-identical
(``check_logprobs_close`` in vLLM's tests), with the logprobs themselves compared too.

Two bfloat16 implementations of one model round differently, so where two candidate tokens
are nearly tied their greedy choices may part. Per prompt:

* up to the first position where the two sides' tokens differ, the generations agree, and
  at each of those positions the chosen token's logprob is within ``atol`` on both sides;
* at that first divergence (if any), each side's token is among the other side's top-k
  logprobs, with logprobs within ``atol`` of each other; after it, the sequences are
  conditioned on different text and nothing more is compared.

A failure is an ``AssertionError`` naming the prompt, the position and both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Generation", "check_logprobs_close", "hf_greedy_with_logprobs"]


@dataclass(frozen=True, slots=True)
class Generation:
    """One side's greedy tokens and, per position, its top-k ``{token: logprob}``."""

    tokens: list[int]
    top: list[dict[int, float]]


@dataclass(frozen=True, slots=True)
class Agreement:
    identical: int
    diverged: int
    max_logprob_diff: float
    """Largest |logprob difference| over every compared (position, token)."""


def check_logprobs_close(
    side_0: Sequence[Generation],
    side_1: Sequence[Generation],
    name_0: str,
    name_1: str,
    *,
    atol: float,
) -> Agreement:
    assert len(side_0) == len(side_1), f"{len(side_0)} {name_0} outputs, {len(side_1)} {name_1}"
    identical = diverged = 0
    worst = 0.0
    for i, (g0, g1) in enumerate(zip(side_0, side_1, strict=True)):
        for pos, (t0, t1) in enumerate(zip(g0.tokens, g1.tokens, strict=False)):
            top0, top1 = g0.top[pos], g1.top[pos]
            where = (
                f"prompt {i}, position {pos}: {name_0} chose {t0} (top {top0}), "
                f"{name_1} chose {t1} (top {top1})"
            )
            if t0 != t1:
                assert t0 in top1, f"{where}: {name_0}'s token is not in {name_1}'s top-k"
                assert t1 in top0, f"{where}: {name_1}'s token is not in {name_0}'s top-k"
            for token in {t0, t1}:
                assert token in top0 and token in top1, (
                    f"{where}: token {token}'s logprob is missing from one side"
                )
                diff = abs(top0[token] - top1[token])
                worst = max(worst, diff)
                assert diff <= atol, (
                    f"{where}: token {token}'s logprobs differ by {diff:.3g} > {atol}"
                )
            if t0 != t1:
                diverged += 1
                break
        else:
            assert len(g0.tokens) == len(g1.tokens), (
                f"prompt {i}: {name_0} made {len(g0.tokens)} tokens, {name_1} {len(g1.tokens)}"
            )
            identical += 1
    return Agreement(identical, diverged, worst)


@torch.inference_mode()
def hf_greedy_with_logprobs(
    model: torch.nn.Module, prompt: list[int], max_tokens: int, top_k: int
) -> Generation:
    """transformers' model, argmax decoding by recomputing the whole sequence each step (no
    KV cache), with the raw distribution's top-k logprobs (float32 log-softmax of the
    logits) and the chosen token's."""
    tokens: list[int] = []
    top: list[dict[int, float]] = []
    while len(tokens) < max_tokens:
        logits = model(input_ids=torch.tensor([prompt + tokens]), use_cache=False).logits
        logprobs = torch.log_softmax(logits[0, -1].float(), dim=-1)
        values, ids = logprobs.topk(top_k)
        chosen = int(logits[0, -1].argmax())
        entry = {int(t): float(v) for t, v in zip(ids, values, strict=True)}
        entry[chosen] = float(logprobs[chosen])
        top.append(entry)
        tokens.append(chosen)
    return Generation(tokens, top)
