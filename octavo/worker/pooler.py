"""Pooling for embedding models: each request's final hidden states (after the
model's last norm, as transformers' ``last_hidden_state``) become one vector.

A prompt may be computed in several chunks (chunked prefill), so the pooler
keeps what a request's earlier chunks contributed: the running sum of its rows
(mean, mean_sqrt_len_tokens), of its rows weighted by their 1-based position
(weightedmean), their element-wise max (max), or its first row (cls);
last-token pooling needs only the final chunk. The prompt's length divides
(or its square root, or the sum of the weights 1..n) once the last chunk is in.
A request recomputed from position 0 (after preemption) starts over; the
state of requests that left is dropped with the step's finished ids. Sums are
kept in float32 whatever the model's dtype, so long prompts do not lose
precision to bf16 accumulation."""
from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch

from octavo.core.step_state import ScheduledRow
from octavo.pooling import PoolerConfig

# The pooling types that read every row and keep a running state across chunks.
_RUNNING = ("mean", "mean_sqrt_len_tokens", "weightedmean", "max")


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._partial: dict[str, torch.Tensor] = {}  # request id -> what its earlier chunks left (module docstring)

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._partial.pop(rid, None)

    def pool(
        self,
        rows: Sequence[ScheduledRow],
        first_rows: Sequence[int],
        hidden: torch.Tensor,
        final_norm: Callable[[torch.Tensor], torch.Tensor],
    ) -> dict[str, list[float]]:
        """The vectors of the requests whose prompt this step completes.
        ``rows[i]``'s tokens are ``hidden[first_rows[i] : first_rows[i] + rows[i].num_tokens]``
        (hidden states before the final norm)."""
        kind = self.config.pooling_type
        # The norm runs over the rows this pooling type reads, all in one call.
        if kind in _RUNNING:
            picks = list(range(hidden.shape[0]))
        elif kind == "cls":
            picks = [first for s, first in zip(rows, first_rows) if s.start_pos == 0]
        else:
            picks = [first + s.num_tokens - 1 for s, first in zip(rows, first_rows) if _completes(s)]
        normed = hidden.new_empty(0)
        if picks:  # none: a cls step with only later chunks (whose first rows are kept already)
            index = torch.tensor(picks, dtype=torch.int64, device=hidden.device)
            normed = final_norm(hidden.index_select(0, index)).float()
        at = {row: i for i, row in enumerate(picks)}
        done_ids: list[str] = []
        vectors: list[torch.Tensor] = []
        for s, first in zip(rows, first_rows):
            rid = s.request.request_id
            if kind in _RUNNING:
                part = _fold(kind, normed[at[first] : at[first] + s.num_tokens], s.start_pos)
                self._partial[rid] = part if s.start_pos == 0 else _merge(kind, self._partial[rid], part)
            elif kind == "cls" and s.start_pos == 0:
                self._partial[rid] = normed[at[first]]
            if not _completes(s):
                continue
            if kind == "last":
                vector = normed[at[first + s.num_tokens - 1]]
            else:
                vector = _finish(kind, self._partial.pop(rid), s.request.num_prompt_tokens)
            done_ids.append(rid)
            vectors.append(vector)
        if not vectors:
            return {}
        stacked = torch.stack(vectors)
        if self.config.normalize:
            stacked = torch.nn.functional.normalize(stacked, p=2.0, dim=-1)
        return dict(zip(done_ids, stacked.tolist()))


def _completes(row: ScheduledRow) -> bool:
    """This chunk computes the last prompt token (embedding requests have no outputs)."""
    return row.start_pos + row.num_tokens == row.request.num_prompt_tokens



def _fold(kind: str, rows: torch.Tensor, start_pos: int) -> torch.Tensor:
    """One chunk's contribution: ``rows`` are prompt positions ``start_pos ..``."""
    if kind == "max":
        return rows.amax(dim=0)
    if kind == "weightedmean":
        # sentence-transformers weighs the prompt's first token 1, its n-th n.
        weights = torch.arange(start_pos + 1, start_pos + 1 + rows.shape[0], dtype=rows.dtype, device=rows.device)
        return weights @ rows
    return rows.sum(dim=0)


def _merge(kind: str, kept: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    return torch.maximum(kept, part) if kind == "max" else kept + part


def _finish(kind: str, state: torch.Tensor, length: int) -> torch.Tensor:
    """The vector of a whole prompt of ``length`` tokens from its running state."""
    if kind == "mean":
        return state / length
    if kind == "mean_sqrt_len_tokens":
        return state / math.sqrt(length)
    if kind == "weightedmean":
        return state / (length * (length + 1) / 2)
    return state  # max, cls: the state is the vector
