"""A broken rank for the Ray executor's tests: ``RayWorkerGroup`` runs its ``entry`` in
each actor, so a test subclass with ``entry = wrong_shard_rank`` runs this there instead
of ``run_rank`` (the actor is another process: a monkeypatch in the test's process would
not reach it). The mutant computes wrong tokens without crashing, so the equality check
must catch it by comparison."""

from __future__ import annotations

from typing import Any

import paged_engine.layers.linear as linear
from paged_engine.layers.parallel import TPGroup, split
from paged_engine.worker import tp_process


def rank_zero_split(total: int, tp: TPGroup) -> tuple[int, int]:
    """Rank 0's share of every sharded linear layer, whatever the rank: the same shapes,
    so the collectives run as ever and only the numbers are wrong."""
    return split(total, TPGroup(0, tp.size))


def wrong_shard_rank(rank: int, spec: Any, channel: Any, report: Any) -> None:
    """``run_rank`` with rank 0's shard of the linear layers (patched in the actor's
    process only)."""
    linear.split = rank_zero_split  # type: ignore[assignment]
    tp_process.run_rank(rank, spec, channel, report)
