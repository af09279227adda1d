"""Structured output's masks, from the grammars to the logits.

The grammars live on the scheduler side (``Request.grammar``, a
``StructuredOutputGrammar`` of the engine's backend: see
``octavo/core/structured_output.py``). Every step the engine packs what each
sampling request's grammar allows into a ``GrammarBitmask`` that travels
with the step (``grammar_bitmask``); on the driver rank ``GrammarBatch``
unpacks it and the sampler masks the logits; once the tokens are back, the
scheduler advances each grammar by its request's tokens
(``core/step_results.py``). A terminated grammar (complete, or in error)
allows only EOS, so the request ends.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from octavo.core.outputs import GrammarBitmask
from octavo.core.structured_output import StructuredOutputBackend, StructuredOutputGrammar

_BITS = 32  # the mask is packed into int32 words, token t at bit t % 32 of word t // 32


def grammar_bitmask(
    backend: StructuredOutputBackend,
    request_ids: list[str],
    grammars: list[StructuredOutputGrammar],
    vocab_size: int,
    proposals: Optional[list[list[int]]] = None,
) -> GrammarBitmask:
    """What each grammar allows next, packed for the workers (scheduler side:
    the grammars stay here and advance once the step's tokens are known).
    ``vocab_size`` is the logits' width; bits past a grammar's vocabulary
    stay 0 (forbidden).

    With speculative ``proposals``, request i gets a mask at each of its
    k + 1 verified positions: the grammar walks through the proposals and is
    rolled back after. Past the first proposal its grammar refuses, the masks
    repeat the last valid one: that proposal is masked out, so it is always
    rejected and the later positions are never used."""
    words = -(-max(vocab_size, *(g.vocab_size for g in grammars)) // _BITS)
    proposals = proposals or [[] for _ in grammars]
    counts = [len(p) + 1 for p in proposals]
    starts = list(itertools.accumulate(counts, initial=0))
    bitmask = torch.zeros(starts[-1], words, dtype=torch.int32)
    terminated = {rid for rid, g in zip(request_ids, grammars) if g.is_terminated()}
    terminated_at: dict[str, int] = {}
    valid = [g.validate_tokens(p) if p else 0 for g, p in zip(grammars, proposals)]
    consumed = [0] * len(grammars)
    try:
        for j in range(max(valid) + 1):
            live = [i for i, n in enumerate(valid) if j <= n]
            backend.fill_bitmasks(bitmask, [(grammars[i], starts[i] + j) for i in live])
            for i in live:
                if j and request_ids[i] not in terminated_at and grammars[i].is_terminated():
                    terminated_at[request_ids[i]] = j
                if j < valid[i]:
                    grammars[i].accept_tokens([proposals[i][j]])
                    consumed[i] += 1
    finally:
        for g, n in zip(grammars, consumed):
            if n:
                g.rollback(n)
    for i, n in enumerate(valid):
        bitmask[starts[i] + n + 1 : starts[i + 1]] = bitmask[starts[i] + n]
    return GrammarBitmask(
        list(request_ids), words, bitmask.numpy().tobytes(), terminated,
        counts if any(proposals) else None, terminated_at,
    )


@dataclass
class GrammarBatch:
    """The grammar rows of one sampler batch and what their grammars allow next."""

    rows: torch.Tensor  # [R] int64 batch rows that have a grammar
    allowed: torch.Tensor  # [R, V] bool

    @classmethod
    def from_bitmask(
        cls,
        request_ids: Sequence[str],
        shipped: Optional[GrammarBitmask],
        vocab_size: int,
        device: torch.device,
        positions: Optional[Sequence[int]] = None,
    ) -> Optional[GrammarBatch]:
        """The shipped masks of the batch rows ``request_ids`` (at proposal
        ``positions``, when verifying); None when no row has one."""
        if shipped is None:
            return None
        index = shipped.first_rows()
        rows = [row for row, rid in enumerate(request_ids) if rid in index]
        if not rows:
            return None
        packed = torch.frombuffer(bytearray(shipped.bitmask), dtype=torch.int32)
        packed = packed.view(-1, shipped.num_words)
        packed = packed[[index[request_ids[row]] + (positions[row] if positions else 0) for row in rows]]
        shifts = torch.arange(_BITS, dtype=torch.int32)
        bits = (packed.unsqueeze(-1) >> shifts) & 1
        allowed = bits.reshape(len(rows), shipped.num_words * _BITS)[:, :vocab_size].bool()
        return cls(torch.tensor(rows, dtype=torch.int64, device=device), allowed.to(device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Copy of ``logits`` [B, V] with grammar-forbidden tokens at -inf."""
        logits = logits.clone()
        logits[self.rows] = logits[self.rows].masked_fill(~self.allowed, float("-inf"))
        return logits
