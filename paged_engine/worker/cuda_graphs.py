"""CUDA graphs for decode steps: capture once per batch-size bucket, replay with padding.

Why: a decode step of a small model is hundreds of tiny kernel launches (28 layers x a
dozen ops), and with a few sequences the GPU finishes each faster than Python issues the
next. A captured graph replays the whole step's launches with one call. What it costs: the
graph freezes everything the host decided at capture time (shapes, grid sizes, pointers,
every Python branch), so a replay is only correct when nothing the host would decide
differently has changed. That gives the rules this module keeps:

* **Buckets.** Graphs exist for batch sizes ``capture_sizes(max_num_seqs)`` (nano-vllm's:
  1, 2, 4, 8, then every 16, and ``max_num_seqs`` itself); a batch of ``n`` sequences
  replays the smallest bucket ``>= n``, its rows past ``n`` padded. Larger batches, and
  every prefill, run eagerly.
* **Static buffers.** Everything the step reads that changes between steps lives in
  ``StaticDecodeBuffers``, allocated once for the largest bucket; a replay first copies the
  step's values in (``fill``). Graphs of all buckets read views of the same buffers.
* **Which metadata is static.** Device tensors: token ids, positions, slots, context lengths
  and block tables (the table is ``max_model_len / block_size`` wide, always: the Triton
  decode kernel plans its split-K from the table's width, so a graph captured on any step
  covers every context up to ``max_model_len``). Host fields are frozen at capture: the
  backend must not read them for decode, which is why only backends with
  ``supports_cuda_graphs`` (Triton, flash-attn) are captured; the torch backend gathers
  ``max_seq_len`` positions and plans cascades from host tables.
* **Padding.** A padded row stores nothing (slot -1), attends over nothing (length 0, which
  the kernels turn into zeros) and reads no block (table row of -1); its output is dropped.

``GraphCapture`` is the one place that touches ``torch.cuda.CUDAGraph``; tests pass a stand-in
that records the captured function and replays it by calling it again, so everything else
here (buckets, padding, buffers, the frozen metadata) is checked on a CPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from paged_engine.config import EngineConfig
from paged_engine.layers.attention.base import AttentionBackend, AttentionMetadata

__all__ = [
    "CudaGraphCapture",
    "DecodeGraphs",
    "GraphCapture",
    "StaticDecodeBuffers",
    "bucket_for",
    "capture_decode_graphs",
    "capture_sizes",
    "graphs_problem",
]

MAX_CAPTURED_BATCH = 512
"""nano-vllm's cap: larger decode batches launch few enough kernels per token to run eagerly."""


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture: 1, 2, 4, 8, then multiples of 16, up to ``max_num_seqs``
    (capped at ``MAX_CAPTURED_BATCH``), which is always the last."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, MAX_CAPTURED_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 16))
    return (*sizes, top)


def bucket_for(sizes: tuple[int, ...], batch: int) -> int | None:
    """The smallest captured size that holds ``batch`` rows; None when none does."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) and batch >= 1 else None


class Replayable(Protocol):
    def replay(self) -> None: ...


class GraphCapture(Protocol):
    """Captures ``fn``'s device work into a graph sharing ``pool`` (None: a new pool);
    returns the graph and the pool for the next capture."""

    def __call__(self, fn: Callable[[], None], pool: Any) -> tuple[Replayable, Any]: ...


class CudaGraphCapture:
    """The real ``GraphCapture``: ``torch.cuda.CUDAGraph`` on the current device."""

    def __call__(self, fn: Callable[[], None], pool: Any) -> tuple[Replayable, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph, graph.pool()


@dataclass(slots=True)
class StaticDecodeBuffers:
    """The device tensors every captured decode graph reads, sized for the largest bucket."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    """``arange``: one token per sequence, fixed."""

    @staticmethod
    def allocate(max_batch: int, table_width: int, device: torch.device) -> StaticDecodeBuffers:
        i32, i64 = torch.int32, torch.int64
        return StaticDecodeBuffers(
            input_ids=torch.zeros(max_batch, dtype=i64, device=device),
            positions=torch.zeros(max_batch, dtype=i64, device=device),
            slot_mapping=torch.full((max_batch,), -1, dtype=i64, device=device),
            seq_lens=torch.zeros(max_batch, dtype=i32, device=device),
            block_tables=torch.full((max_batch, table_width), -1, dtype=i32, device=device),
            query_start_loc=torch.arange(max_batch + 1, dtype=i32, device=device),
        )

    @property
    def max_batch(self) -> int:
        return self.input_ids.shape[0]

    def metadata(self, bucket: int) -> AttentionMetadata:
        """The metadata a ``bucket`` graph is captured with: views of the buffers, and host
        fields describing a batch of one-token contexts (frozen; see the module docstring)."""
        qsl = self.query_start_loc[: bucket + 1]
        return AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=qsl,
            seq_start_loc=qsl,
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=self.block_tables.shape[1],
            query_lens_cpu=(1,) * bucket,
            seq_lens_cpu=(1,) * bucket,
            slots_all_valid=False,
        )

    def fill(
        self,
        bucket: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Copy a decode step's ``n <= bucket`` rows in; pad rows ``n..bucket`` (slot -1,
        length 0, table row -1, token and position 0). Device-to-device copies only."""
        n = meta.num_seqs
        if not 1 <= n <= bucket <= self.max_batch:
            raise ValueError(f"cannot put {n} rows into bucket {bucket} of {self.max_batch}")
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(
                f"block tables {width} wide do not fit the captured {self.block_tables.shape[1]}"
            )
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:n, width:].fill_(-1)  # a wider earlier step's blocks must go
        if n < bucket:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].zero_()
            self.block_tables[n:bucket].fill_(-1)


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""``(input_ids, positions, meta) -> hidden [num_tokens, hidden_size]``: the model's forward
pass under ``meta`` (the runner wraps it in ``forward_context``)."""


class DecodeGraphs:
    """Captured decode steps, one graph per bucket, replayed with padded static inputs."""

    def __init__(
        self,
        forward: Forward,
        buffers: StaticDecodeBuffers,
        sizes: tuple[int, ...],
        hidden_size: int,
        dtype: torch.dtype,
        capture: GraphCapture,
    ) -> None:
        if not sizes or sizes[-1] > buffers.max_batch:
            raise ValueError(f"buckets {sizes} do not fit buffers of {buffers.max_batch} rows")
        self.sizes = sizes
        self.buffers = buffers
        self.hidden = torch.zeros(
            buffers.max_batch, hidden_size, dtype=dtype, device=buffers.input_ids.device
        )
        """The graphs' output: each replay writes its bucket's rows."""
        self.graphs: dict[int, Replayable] = {}
        self.replays = 0
        pool = None
        # Largest first: the smaller graphs then reuse the largest one's pool memory.
        for bucket in reversed(sizes):
            meta = buffers.metadata(bucket)

            def step(meta: AttentionMetadata = meta, bucket: int = bucket) -> None:
                # Fresh views on every call: the model memoises per-step work by tensor
                # identity (the rotary factors of a positions tensor), and a memo filled by
                # the warm-up would keep that work out of the captured graph, which would
                # then replay the warm-up's stale factors.
                ids, pos = buffers.input_ids[:bucket], buffers.positions[:bucket]
                self.hidden[:bucket].copy_(forward(ids, pos, meta))

            step()  # eager warm-up: compiles the kernels, settles the allocator
            self.graphs[bucket], pool = capture(step, pool)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The decode step's hidden states ``[n, hidden]`` (a view of ``self.hidden``, valid
        until the next replay), or None when no graph fits (the caller runs eagerly)."""
        if meta.is_prefill or meta.max_query_len != 1:
            return None
        bucket = bucket_for(self.sizes, meta.num_seqs)
        if bucket is None:
            return None
        self.buffers.fill(bucket, input_ids, positions, meta)
        self.graphs[bucket].replay()
        self.replays += 1
        return self.hidden[: meta.num_seqs]


def graphs_problem(
    config: EngineConfig, device: torch.device, backend: AttentionBackend, tp_size: int
) -> str | None:
    """Why decode steps run eagerly here, or None when they can be captured."""
    if config.enforce_eager:
        return "enforce_eager=True"
    if device.type != "cuda":
        return f"CUDA graphs need CUDA; this device is {device.type}"
    if not getattr(backend, "supports_cuda_graphs", False):
        return f"the {backend.name} attention backend reads host data in decode"
    if tp_size > 1:
        return "tensor parallelism: the ranks' collectives are not captured"
    return None


def capture_decode_graphs(
    forward: Forward,
    config: EngineConfig,
    device: torch.device,
    hidden_size: int,
    dtype: torch.dtype,
    capture: GraphCapture,
) -> DecodeGraphs:
    """Decode captured for every bucket up to ``max_num_seqs``, its block tables as wide as
    a ``max_model_len`` sequence's (see the module docstring)."""
    sizes = capture_sizes(config.max_num_seqs)
    buffers = StaticDecodeBuffers.allocate(sizes[-1], config.max_blocks_per_seq(), device)
    return DecodeGraphs(forward, buffers, sizes, hidden_size, dtype, capture)
