"""Broken tensor-parallel pieces, and worker entry points that run them.

``WorkerGroup`` starts each worker with the ``worker_main`` of its module
(``tp_worker.worker_main``, imported from ``tp_process``), so a test that monkeypatches
``tp_worker.worker_main`` starts one of the entry points below instead: it patches the
worker process, then runs the real ``worker_main``. A mutant of a layer must run on every
rank (rank 0 too, patched by the test), or the ranks would make different collective
calls and crash rather than compute something wrong.

Each mutant computes *wrong tokens without crashing*, so the equality test catches it by
comparison (tests/test_tp.py). ``raising_worker`` and ``exiting_worker`` are faults, not
mutants: the failure tests check that they surface as a clear error.
``config_unreadable_worker`` is a probe: it starts only if the worker builds its rank
without reading config.json (tests/test_load_path.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

import paged_engine.layers.decoder as decoder
import paged_engine.utils.model_config as model_config
from paged_engine.engine.sequence import Sequence
from paged_engine.layers.embed_head import VocabParallelEmbedding
from paged_engine.layers.linear import RowParallelLinear
from paged_engine.worker.model_runner import ModelRunner
from paged_engine.worker.tp_process import worker_main as real_worker_main


class RowParallelWithoutAllReduce(RowParallelLinear):
    """o_proj and down keep each rank's partial sum: the all-reduce is missing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, None)  # the weight may be oneDNN-packed (Linear's docstring)
        return out if self.bias is None else out + self.bias


class VocabEmbeddingWithoutMask(VocabParallelEmbedding):
    """Every token is looked up on every rank (its id wrapped into the local rows, so
    nothing is out of range) and no rank's row is zeroed: the all-reduce adds rows of
    other tokens to each token's embedding."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        out = F.embedding((input_ids - self.first) % self.weight.shape[0], self.weight)
        return self.tp.all_reduce(out)


def patch_row_parallel() -> None:
    decoder.RowParallelLinear = RowParallelWithoutAllReduce  # type: ignore[misc]


def patch_vocab_embedding() -> None:
    decoder.VocabParallelEmbedding = VocabEmbeddingWithoutMask  # type: ignore[misc]


def run_worker_from_token_ids(self: ModelRunner, seqs: list[Sequence], is_prefill: bool) -> None:
    """A worker that feeds a decoding sequence from the token ids it was handed, not from
    ``last_token``. A decoding hand-off carries no token ids, so this worker keeps each
    sequence's list from its prefill hand-off (a plausible cache) and reads its last
    entry, which is stale from the first decode step on."""
    seen: dict[int, list[int]] = self.__dict__.setdefault("_token_ids_seen", {})
    for s in seqs:
        if s.is_prefill:
            seen[s.seq_id] = s.token_ids
        else:
            s.last_token = seen[s.seq_id][-1]
    self._forward(seqs, is_prefill)


def run_worker_reading_last_of_token_ids(
    self: ModelRunner, seqs: list[Sequence], is_prefill: bool
) -> None:
    """The direct form of that bug: ``token_ids[-1]`` of a decoding hand-off, which holds
    no token ids. It raises IndexError in the worker: a fault, surfaced by rank 0."""
    for s in seqs:
        s.last_token = s.token_ids[-1]
    self._forward(seqs, is_prefill)


def exit_on_third_decode_step(self: ModelRunner, seqs: list[Sequence], is_prefill: bool) -> None:
    """A worker that dies mid-step (in the middle of the forward pass, so rank 0 waits in
    a collective when it goes), as a segfault or the OOM killer would end it."""
    count = self.__dict__.get("_decode_steps", 0) + (not is_prefill)
    self.__dict__["_decode_steps"] = count
    if count == 3:  # after layer 0's attention all-reduce, before its MLP's

        def die(x: torch.Tensor) -> torch.Tensor:
            os._exit(77)

        self.model.model.layers[0].mlp.forward = die
    self._forward(seqs, is_prefill)


# ---- worker entry points (the signature of tp_process.worker_main) ----------------------


def row_parallel_worker(rank: int, spec: Any, signal: Any, conn: Any) -> None:
    patch_row_parallel()
    real_worker_main(rank, spec, signal, conn)


def vocab_embedding_worker(rank: int, spec: Any, signal: Any, conn: Any) -> None:
    patch_vocab_embedding()
    real_worker_main(rank, spec, signal, conn)


def token_ids_worker(rank: int, spec: Any, signal: Any, conn: Any) -> None:
    ModelRunner.run_worker = run_worker_from_token_ids  # type: ignore[method-assign]
    real_worker_main(rank, spec, signal, conn)


def raising_worker(rank: int, spec: Any, signal: Any, conn: Any) -> None:
    ModelRunner.run_worker = run_worker_reading_last_of_token_ids  # type: ignore[method-assign]
    real_worker_main(rank, spec, signal, conn)


def exiting_worker(rank: int, spec: Any, signal: Any, conn: Any) -> None:
    ModelRunner.run_worker = exit_on_third_decode_step  # type: ignore[method-assign]
    real_worker_main(rank, spec, signal, conn)


def config_unreadable_worker(rank: int, spec: Any, signal: Any, conn: Any) -> None:
    """A worker in which reading config.json raises, by this package's reader and by
    transformers': it starts only if it builds its rank from the ``ModelConfig`` that rank
    0 pickled into its spec."""
    from transformers import AutoConfig

    real_read = model_config.read_json_object

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"worker rank {rank} parsed config.json: {args}")

    def read_json_object(path: Any) -> Any:
        if path.name == "config.json":
            refuse(path)
        return real_read(path)

    model_config.read_json_object = read_json_object  # type: ignore[assignment]
    AutoConfig.from_pretrained = refuse  # type: ignore[method-assign]
    real_worker_main(rank, spec, signal, conn)
