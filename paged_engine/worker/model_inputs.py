"""One step's model inputs, built from the scheduled sequences: token ids, positions, the
attention metadata (slot mapping, block tables, lengths) and the rows that sample.

It needs no model, so it stands apart from the runner: a test that checks attention over
the paged cache (tests/attention_machine.py) builds each step's metadata with the same
``BatchBuilder`` the runner uses. What it needs from the engine is the ``Sequence`` record
and index arithmetic: the slots of a token range through a block table come from
``engine.indexing.slot_mapping`` (through ``HostMetadata``), the helper that CrossHair
checks against its spec twin.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import numpy as np
import torch

from paged_engine.engine.sequence import Sequence
from paged_engine.layers.attention import AttentionMetadata, HostMetadata, HostStaging

__all__ = ["Batch", "BatchBuilder"]


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's model inputs."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    """Row of the last token of each sequence that samples in this step."""
    sampling: tuple[int, ...]
    """Indices (into the step's sequences) of those sequences."""
    prompt_spans: tuple[tuple[int, int, int, int], ...] = ()
    """``(sequence index, first row, first position, rows)`` of each sequence that asks
    for prompt logprobs and has prompt rows in this step: its rows ``first row …`` hold
    positions ``q`` (from ``first position``) that predict prompt tokens ``q + 1``."""


class BatchBuilder:
    """Builds each step's ``Batch`` and moves it to the device through ``staging``: one
    reused host buffer per dtype, so a step costs one host-to-device copy per dtype, not
    one per array (``HostStaging``)."""

    def __init__(self, block_size: int, staging: HostStaging) -> None:
        self.block_size = block_size
        self.staging = staging

    def build(
        self, seqs: SequenceABC[Sequence], is_prefill: bool, *, with_block_tables: bool = True
    ) -> Batch:
        """Inputs for the tokens ``[num_cached, num_cached + num_scheduled)`` of each
        sequence; only the uncached ones are computed. Without ``with_block_tables`` (a
        warm-up pass before the KV pool exists) every slot is -1: nothing is stored."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampling: list[int] = []
        prompt_spans: list[tuple[int, int, int, int]] = []
        for i, seq in enumerate(seqs):
            start = seq.num_cached_tokens
            end = start + seq.num_scheduled_tokens
            # rows q predict q + 1; the last prompt row predicts the first output token
            num_prompt_rows = min(end, seq.num_prompt_tokens - 1) - start
            if (
                is_prefill
                and num_prompt_rows > 0
                and seq.sampling_params.prompt_logprobs is not None
            ):
                prompt_spans.append((i, len(input_ids), start, num_prompt_rows))
            if seq.is_prefill:  # per row: a mixed step (S2m) holds decodes among chunks
                input_ids.extend(seq.token_ids[start:end])
            else:
                input_ids.append(seq.last_token)  # a pickled decoding sequence has no token_ids
            positions.extend(range(start, end))
            query_lens.append(end - start)
            seq_lens.append(end)
            if end == seq.num_tokens:  # the prompt is complete, or a decode step
                sample_rows.append(len(input_ids) - 1)
                sampling.append(i)
        tables = [s.block_table for s in seqs] if with_block_tables else []
        host = HostMetadata.build(query_lens, seq_lens, tables, self.block_size, is_prefill)
        i64 = torch.int64
        tensors = self.staging.stage(
            [
                *host.arrays(),
                (np.asarray(input_ids, dtype=np.int64), i64),
                (np.asarray(positions, dtype=np.int64), i64),
                (np.asarray(sample_rows, dtype=np.int64), i64),
            ]
        )
        ids, pos, rows = tensors[-3:]
        return Batch(
            input_ids=ids,
            positions=pos,
            meta=host.on_device(tensors[:-3]),
            sample_rows=rows,
            sampling=tuple(sampling),
            prompt_spans=tuple(prompt_spans),
        )
