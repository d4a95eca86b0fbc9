"""Token embedding and the LM head, which may share one matrix; and their
vocabulary-parallel forms (``parallel.py``), each rank holding rows ``[r V/N, (r+1) V/N)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.linear import pack_weight, packed_linear
from paged_engine.layers.parallel import SINGLE, TPGroup, split

Index = tuple[slice, ...]


class VocabEmbedding(nn.Module):
    """``[vocab, hidden]`` lookup table (single device: no vocab sharding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states → vocabulary logits.

    With ``tied_to`` the head holds the embedding's own Parameter (one tensor, loaded once,
    listed once by ``named_parameters``), as tied checkpoints store only the embedding.

    On CPU ``process_weights_after_loading`` packs the matrix for oneDNN, as ``Linear``
    does its projections and for the same reason (``F.linear`` repacks a plain weight on
    every call): the head is the model's widest matmul, and with a large vocabulary one
    of its largest (``bench/test_linear_bench.py``). An untied head's dense weight is then
    emptied; a tied one stays, since the embedding looks rows up in it, so the packed copy
    costs one more ``[vocab, hidden]`` matrix.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tied_to: VocabEmbedding | None = None
    ) -> None:
        super().__init__()
        if tied_to is not None:
            if tuple(tied_to.weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError("a tied LM head needs the embedding's shape")
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(num_embeddings, embedding_dim), requires_grad=False
            )
        self.tied = tied_to is not None
        self._packed: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        """Pack the weight for oneDNN where ``linear.packs`` says this CPU can, once."""
        if self._packed is not None:
            return
        self._packed = pack_weight(self.weight)
        if self._packed is not None and not self.tied:
            self.weight.data = self.weight.data.new_empty((0, self.weight.shape[1]))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden W^T``, through the packed weight when there is one."""
        if self._packed is None:
            return F.linear(hidden, self.weight)
        return packed_linear(hidden, self._packed, None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)


def _vocab_rows(vocab: int, tp: TPGroup, shape: tuple[int, ...]) -> Index | None:
    """This rank's rows of a ``[vocab, hidden]`` checkpoint tensor (None at one rank)."""
    if tp.size == 1:
        return None
    if shape[0] != vocab:
        raise ValueError(f"expected {vocab} rows, got shape {shape}")
    first, count = split(vocab, tp)
    return (slice(first, first + count),)


class VocabParallelEmbedding(VocabEmbedding):
    """This rank's vocabulary rows. A token outside them is looked up at row 0 and its
    output zeroed (the mask), so after the all-reduce each token's row is the one rank's
    that holds it. One all-reduce of ``[tokens, hidden]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE) -> None:
        self.first, count = split(num_embeddings, tp)
        super().__init__(count, embedding_dim)
        self.tp = tp
        self.vocab_size = num_embeddings
        self.weight.checkpoint_slice = self.checkpoint_slice  # type: ignore[attr-defined]

    def checkpoint_slice(self, shard_id: object, shape: tuple[int, ...]) -> Index | None:
        return _vocab_rows(self.vocab_size, self.tp, shape)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(LMHead):
    """This rank's vocabulary slice of the head (tied: the parallel embedding's own rows).
    Rank 0 gathers the slices into ``[rows, vocab]`` logits; the other ranks, which never
    sample, get an uninitialised tensor of that shape, so that they can run the same code
    as rank 0 (and so make the same collective calls) and discard what it computes."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tied_to: VocabParallelEmbedding | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__(split(num_embeddings, tp)[1], embedding_dim, tied_to)
        self.tp = tp
        self.vocab_size = num_embeddings
        if tied_to is None:
            self.weight.checkpoint_slice = self.checkpoint_slice  # type: ignore[attr-defined]

    def checkpoint_slice(self, shard_id: object, shape: tuple[int, ...]) -> Index | None:
        return _vocab_rows(self.vocab_size, self.tp, shape)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.logits(hidden)
        if self.tp.size == 1:
            return local
        full = self.tp.gather_last_dim(local)
        return full if full is not None else local.new_empty(*local.shape[:-1], self.vocab_size)
