"""The token embedding and the lm_head split by vocabulary rows across the
tensor-parallel ranks.

The vocabulary is padded up to a multiple of tp_size so every rank holds the
same number of rows (the last rank's padding rows are zeros and never win: the
gathered logits are cut back to the vocabulary). Each rank embeds only the
tokens in its range and the all-reduce fills in the rest; each rank computes
the logits of its rows and an all-gather joins them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from octavo.distributed.communication import tensor_model_parallel_all_reduce, tensor_model_parallel_gather
from octavo.distributed.parallel_state import get_parallel_state
from octavo.quant.base import LinearMethod, LinearWeightHolder
from octavo.quant.unquantized import UnquantizedLinearMethod


class _VocabRows(nn.Module):
    """This rank's rows ``start:end`` of a ``num_embeddings``-row table, held
    in ``rows_per_rank`` rows (the tail padded)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.start = min(self.tp_rank * self.rows_per_rank, num_embeddings)
        self.end = min(self.start + self.rows_per_rank, num_embeddings)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected {expected}")
        mine = self.end - self.start
        param.data[:mine].copy_(loaded[self.start : self.end])
        param.data[mine:].zero_()


class VocabParallelEmbedding(_VocabRows):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, embedding_dim, dtype=torch.get_default_dtype()), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(_VocabRows, LinearWeightHolder):
    """Hidden states -> logits over the whole vocabulary on the group's first
    rank, None on the others. Its weight belongs to ``linear_method`` (packed or quantized like
    any linear layer), or is the embedding's with ``tie_to``."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 linear_method: Optional[LinearMethod] = None, prefix: str = "lm_head") -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.prefix = prefix
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(self, embedding_dim, [self.rows_per_rank], torch.get_default_dtype())
        self.weight.weight_loader = self.weight_loader

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Read the embedding's table (same rows on every rank)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        logits = self.linear_method.apply(self, hidden, None)
        if self.tp_size > 1:
            logits = tensor_model_parallel_gather(logits, dim=-1)
            if logits is not None:
                logits = logits[..., : self.num_embeddings]
        return logits
