"""Deliberately wrong pooling forwards (no tests here): each must make the pooling tests
fail with an AssertionError (tests/test_pooling_chunks.py, tests/test_embeddings_server.py).
Each has ``chunked_hidden_states``' signature and replaces it in
``paged_engine.worker.pooling_forward``."""

from __future__ import annotations

import torch

from paged_engine.engine.sequence import Sequence
from paged_engine.worker.pooling_forward import hidden_states


def _chunks(runner: object, seq: Sequence, budget: int) -> list[torch.Tensor]:
    n = seq.num_prompt_tokens
    out = []
    for start in range(0, n, budget):
        seq.num_cached_tokens = start
        seq.num_scheduled_tokens = min(budget, n - start)
        out.append(hidden_states(runner, [seq])[: seq.num_scheduled_tokens].float())  # type: ignore[arg-type]
    return out


def wrong_token(runner: object, seq: Sequence, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LAST reads the second-to-last position (an off-by-one in the pooled row)."""
    rows = torch.cat(_chunks(runner, seq, budget))
    return rows[max(len(rows) - 2, 0)], rows.sum(dim=0)


def last_chunk_only(
    runner: object, seq: Sequence, budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MEAN sums the last chunk alone (the earlier chunks' rows dropped)."""
    chunks = _chunks(runner, seq, budget)
    return chunks[-1][-1], chunks[-1].sum(dim=0)


def restart_each_chunk(
    runner: object, seq: Sequence, budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every chunk computed as if nothing were cached: each attends to itself alone, at
    positions from 0 (the K/V of the earlier chunks ignored)."""
    n, total, last = seq.num_prompt_tokens, None, None
    for start in range(0, n, budget):
        size = min(budget, n - start)
        piece = Sequence.from_checked_tokens(
            seq.token_ids[start : start + size],
            seq.sampling_params,
            block_size=seq.block_size,
            cache_salt=None,
        )
        piece.block_table = seq.block_table
        piece.num_scheduled_tokens = size
        rows = hidden_states(runner, [piece])[:size].float()  # type: ignore[arg-type]
        total = rows.sum(dim=0) if total is None else total + rows.sum(dim=0)
        last = rows[-1]
    assert last is not None and total is not None
    return last, total


MUTANTS = {
    "wrong_token": wrong_token,
    "last_chunk_only": last_chunk_only,
    "restart_each_chunk": restart_each_chunk,
}
