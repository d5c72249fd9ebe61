"""The input embedding of a model whose LM head is quantized and tied to it: each step gathers
its tokens' rows from the head's int8 / int4 weights and dequantizes just those (a handful a
decode step), so no float [vocab, hidden] matrix is kept for the lookup."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# (T,) int64 token ids -> (T, hidden) float rows of the dequantized weight matrix.
RowReader = Callable[[torch.Tensor], torch.Tensor]


class TiedQuantizedEmbedding(nn.Module):
    """`nn.Embedding` over the rows of a quantized head (`Int8Linear` / `Int4Linear`)."""

    def __init__(self, rows: RowReader, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        # The head's bound `rows` method, not the head itself: a submodule here would register
        # the head twice (and name it after the embedding). `module.to()` converts the head in
        # place, so the method always reads its current weights.
        self.read_rows = rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)  # (T,)
        return self.read_rows(flat).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied to the quantized LM head"
