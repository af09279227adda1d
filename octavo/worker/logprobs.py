"""Log-softmax rows -> TokenLogprobs (chosen token, its rank, the top alternatives)."""
from __future__ import annotations

import torch

from octavo.core.outputs import TokenLogprobs


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs [N, V] (already log-softmaxed), token_ids [N]; row i keeps its
    ``num_top[i]`` best alternatives. One topk for all rows, one transfer."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    # Rank 1 is the most likely token; ties share the better rank.
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    k = max(num_top, default=0)
    top_lp, top_ids = logprobs.topk(k, dim=1)  # k = 0 gives empty rows
    rows = zip(token_ids.tolist(), chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist(), num_top)
    return [
        TokenLogprobs(token_id=t, logprob=lp, rank=r, top=list(zip(ids[:n], lps[:n])))
        for t, lp, r, ids, lps, n in rows
    ]
