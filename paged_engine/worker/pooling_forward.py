"""The final hidden states of a prefill, for pooling (``paged_engine/pooling.py``).

Why apart from ``ModelRunner.run``: pooling wants the model's last hidden state at every
prompt position, not logits of sampled rows. It is the runner's own forward pass; with
tensor parallelism the other ranks run their ordinary step beside it (``run_worker``),
so rank 0 computes the sampled rows' logits too, for the collectives to meet in order.
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
