"""Top-k, top-p and min-p filtering with a different setting per row.

Semantics follow Hugging Face's warpers, applied in the same order (top-k,
then top-p on what top-k kept, then min-p):
- top-k keeps every token whose logit is >= the k-th largest, so ties at the
  boundary all survive; k of 0 keeps everything.
- top-p drops the tokens whose ascending cumulative probability is
  <= 1 - top_p; the most likely token always survives.
- min-p drops tokens with probability < min_p * max probability, computed in
  log space (logit < max logit + log(min_p)), which needs no softmax.
A row whose parameter is neutral (k = 0, top_p = 1, min_p = 0) is left
untouched bit-for-bit, whatever its batch mates ask for.
"""
from __future__ import annotations

from typing import Optional

import torch

_NEG_INF = float("-inf")


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: Optional[torch.Tensor] = None,
    top_p: Optional[torch.Tensor] = None,
    min_p: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Filtered copy of ``logits`` [B, V]; pass None for a filter no row uses.
    ``top_k`` is int64 [B] with 0 = off; ``top_p`` and ``min_p`` are float [B]."""
    if top_k is not None or top_p is not None:
        sorted_logits, order = logits.sort(dim=-1)  # ascending, as Hugging Face does
        if top_k is not None:
            vocab = logits.shape[-1]
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
            kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, _NEG_INF)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
        if top_p is not None:
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= (1.0 - top_p).unsqueeze(1)
            drop[:, -1] = False
            # For top_p = 1 the test reads "cumulative <= 0", true for tokens whose
            # probability underflowed; such rows stay untouched instead.
            drop &= (top_p < 1.0).unsqueeze(1)
            logits = logits.masked_fill(drop.scatter(1, order, drop), _NEG_INF)
    if min_p is not None:
        threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
        logits = logits.masked_fill(logits < threshold, _NEG_INF)
    return logits
