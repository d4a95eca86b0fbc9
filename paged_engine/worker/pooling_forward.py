"""The final hidden states of a prefill, for pooling (``paged_engine/pooling.py``).

Why apart from ``ModelRunner.run``: pooling wants the model's last hidden state at every
prompt position, not logits of sampled rows. It is the runner's own forward pass; with
tensor parallelism the other ranks run their ordinary step beside it (``run_worker``),
so rank 0 computes the sampled rows' logits too, for the collectives to meet in order.

Why in chunks: one forward over a whole ``max_model_len`` prompt can need more memory than
the engine measured for its largest step (``max_num_batched_tokens``), so the prompt runs
as chunked prefill runs it: forwards of at most that many tokens, each starting at the
position the last one reached, the earlier K/V read from the sequence's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

import torch

from paged_engine.engine.sequence import Sequence
from paged_engine.worker.model_runner import ModelRunner
from paged_engine.worker.sampling_step import step_logits


@torch.inference_mode()
def hidden_states(runner: ModelRunner, seqs: list[Sequence]) -> torch.Tensor:
    """Rows of the final (normed) hidden state for every scheduled token of ``seqs``, in
    batch order; each sequence holds its blocks and computes its whole prompt."""

    def forward(batch_seqs: SequenceABC[Sequence], is_prefill: bool) -> torch.Tensor:
        batch = runner.prepare(batch_seqs, is_prefill)
        hidden = runner._model_forward(batch.input_ids, batch.positions, batch.meta)
        if runner.workers is not None:  # the workers' step computes these: meet them
            step_logits(runner.model.compute_logits, hidden, batch, batch_seqs)
        return hidden

    if runner.workers is None:
        return forward(seqs, True)
    return runner.workers.forward(forward, seqs, True)


def chunked_hidden_states(
    runner: ModelRunner, seq: Sequence, budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last prompt position's final hidden state and the sum over every position (in
    float32), computed in forwards of at most ``budget`` tokens; ``seq`` holds blocks for
    its whole prompt and nothing of it is cached yet."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    n = seq.num_prompt_tokens
    total: torch.Tensor | None = None
    last: torch.Tensor | None = None
    for start in range(0, n, budget):
        seq.num_cached_tokens = start
        seq.num_scheduled_tokens = min(budget, n - start)
        rows = hidden_states(runner, [seq])[: seq.num_scheduled_tokens].float()
        part = rows.sum(dim=0)
        total = part if total is None else total + part
        last = rows[-1]
    assert last is not None and total is not None  # n >= 1: one chunk at least
    return last, total
