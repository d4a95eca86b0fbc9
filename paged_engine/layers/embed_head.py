"""Token embedding and the LM head, which may share one matrix."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
