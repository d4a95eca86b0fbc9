"""A mixed step cut in two: its decode rows and its prefill chunks.

A mixed step (S2m, docs/design.md) holds the running sequences' decodes first, one new token
each, then prefill chunks. A backend's decode path attends all the one-token sequences of a
batch at once (the torch backend's batched gather, the compiled CPU kernel), where its
prefill path loops over sequences: sent whole to the prefill path, a mixed step would
gather each decode row's context and attend it alone, in every layer. ``split_mixed`` gives
each part its own metadata, as if it were a step of its own, so that each goes to the path
made for it. Only host data decides where to cut (no device sync).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from paged_engine.layers.attention.base import AttentionMetadata

__all__ = ["MixedSplit", "split_mixed"]


@dataclass(slots=True, frozen=True)
class MixedSplit:
    """A mixed step's two parts: its first ``rows`` sequences, one new token each (a row
    each), as a decode step, and the others as a prefill step. Made once per step, so that
    what a backend derives from a part once per step (keyed by the identity of its metadata
    or tensors) is made once for all the step's layers too."""

    rows: int
    decode: AttentionMetadata
    rest: AttentionMetadata


def split_mixed(meta: AttentionMetadata) -> MixedSplit | None:
    """``meta``'s leading one-token sequences and the rest; None when it does not start with
    one, or holds no other, or when some slot is -1 (a row the cache does not hold, which
    the decode paths read from the cache: only warm-up passes and padded graph rows have
    them)."""
    rows = 0
    for q_len in meta.query_lens_cpu:
        if q_len != 1:
            break
        rows += 1
    if rows == 0 or rows == meta.num_seqs or meta.slots_all_valid is not True:
        return None
    return MixedSplit(rows, _sequences(meta, 0, rows), _sequences(meta, rows, meta.num_seqs))


def _sequences(meta: AttentionMetadata, lo: int, hi: int) -> AttentionMetadata:
    """Sequences ``lo .. hi - 1`` of ``meta`` as a step of their own: their rows, lengths
    and tables, the cumulative counts restarted at 0."""
    q0, q1 = sum(meta.query_lens_cpu[:lo]), sum(meta.query_lens_cpu[:hi])
    query_lens = meta.query_lens_cpu[lo:hi]
    return replace(
        meta,
        is_prefill=max(query_lens) > 1,
        slot_mapping=meta.slot_mapping[q0:q1],
        query_start_loc=meta.query_start_loc[lo : hi + 1] - q0,
        seq_start_loc=meta.seq_start_loc[lo : hi + 1] - meta.seq_start_loc[lo],
        seq_lens=meta.seq_lens[lo:hi],
        block_tables=meta.block_tables[lo:hi],
        max_query_len=max(query_lens),
        max_seq_len=max(meta.seq_lens_cpu[lo:hi]),
        query_lens_cpu=query_lens,
        seq_lens_cpu=meta.seq_lens_cpu[lo:hi],
        block_tables_cpu=meta.block_tables_cpu[lo:hi],
    )
