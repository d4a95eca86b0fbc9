"""The sampling half of a step: the hidden states of a batch's sampling rows → logits → the
sampler → one result per scheduled sequence.

It comes in two parts because of tensor parallelism. ``step_logits`` runs on every rank,
inside the forward pass: the LM head gathers the vocabulary across the ranks, so each rank
must make the same calls. ``step_results`` runs on rank 0 alone, which holds the sampler,
the generators and the engine's sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as SequenceABC

import torch

from paged_engine.engine.outputs import FailedSample, SampleOutput, TokenLogprobs
from paged_engine.engine.sequence import Sequence
from paged_engine.layers.logprobs import prompt_logprobs, sampled_logprobs
from paged_engine.layers.sampler import Sampler
from paged_engine.worker.grammar import StructuredOutputs
from paged_engine.worker.model_inputs import Batch

__all__ = ["PromptLogprobs", "StepResult", "step_logits", "step_results"]

PromptLogprobs = tuple[tuple[TokenLogprobs, ...], ...]
"""The prompt logprobs of each ``Batch.prompt_spans`` entry, in that order."""
StepResult = int | FailedSample | SampleOutput | None
"""What a step gives one scheduled sequence (``ModelRunner.run``)."""


def step_logits(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    batch: Batch,
    seqs: SequenceABC[Sequence],
) -> tuple[torch.Tensor, PromptLogprobs]:
    """The logits of the batch's sampling rows, and the prompt logprobs of each of its
    prompt spans (row ``q`` predicts prompt token ``q + 1``)."""
    logits = compute_logits(hidden[batch.sample_rows])
    prompt = tuple(
        prompt_logprobs(
            hidden[row : row + count],
            compute_logits,
            seqs[i].token_ids[q + 1 : q + 1 + count],
            seqs[i].sampling_params.prompt_logprobs or 0,
        )
        for i, row, q, count in batch.prompt_spans
    )
    return logits, prompt


def step_results(
    seqs: SequenceABC[Sequence],
    batch: Batch,
    logits: torch.Tensor,
    prompt: PromptLogprobs,
    sampler: Sampler,
    generators: SequenceABC[torch.Generator | None],
    eos_token_ids: Collection[int],
    grammars: StructuredOutputs | None = None,
) -> list[StepResult]:
    """One result per sequence: its sampled token (``generators`` holds one generator per
    sampling row), None for a prefill chunk that samples nothing, ``FailedSample`` for
    logits that leave nothing to sample; wrapped in a ``SampleOutput`` for a request that
    asks for logprobs or prompt logprobs. ``grammars`` masks the rows with structured
    outputs and is advanced by their sampled tokens."""
    results: dict[int, int | FailedSample] = {}
    logprobs: dict[int, TokenLogprobs] = {}
    if batch.sampling:
        picked = [seqs[i] for i in batch.sampling]
        params = [s.sampling_params for s in picked]
        mask, failed = (None, {}) if grammars is None else grammars.masks(picked)
        tokens = sampler(logits, params, generators, picked, eos_token_ids, token_mask=mask)
        for r, failure in failed.items():
            tokens[r] = failure
        if mask is not None and grammars is not None:
            grammars.advance(picked, tokens)
        for i, seq, t in zip(batch.sampling, picked, tokens, strict=True):
            results[i] = t if t is not None else _failure(seq)
        asked = [p.logprobs for p in params]
        for r, lp in sampled_logprobs(logits, asked, tokens).items():
            logprobs[batch.sampling[r]] = lp
    prompt_of = {i: lps for (i, *_), lps in zip(batch.prompt_spans, prompt, strict=True)}
    out: list[StepResult] = []
    for i, seq in enumerate(seqs):
        p = seq.sampling_params
        if p.logprobs is None and p.prompt_logprobs is None:
            out.append(results.get(i))
        else:
            out.append(SampleOutput(results.get(i), logprobs.get(i), prompt_of.get(i, ())))
    return out


def _failure(seq: Sequence) -> FailedSample:
    return FailedSample(
        f"the model's logits for the token at position {seq.num_tokens} are not finite "
        "(NaN or inf), or leave no token to sample; nothing was sampled"
    )
