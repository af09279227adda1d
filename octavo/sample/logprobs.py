"""Turning a [N, V] log-softmax into TokenLogprobs (sampled and prompt logprobs).

Logprobs always come from the model's raw distribution, before penalties,
masks, temperature or filters, as the OpenAI API reports them.
"""
from __future__ import annotations

import torch

from octavo.outputs import TokenLogprobs


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """Row i: the logprob and rank of ``token_ids[i]`` plus the ``num_top``
    most likely tokens (best first). Callers wanting fewer per row slice
    ``top``. Everything crosses to the host in one transfer per tensor."""
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1))  # [N, 1]
    # Rank 1 = most likely; ties share the better rank.
    ranks = (logprobs > chosen).sum(dim=1) + 1
    tops: list[list[tuple[int, float]]] = [[] for _ in range(token_ids.shape[0])]
    num_top = min(num_top, logprobs.shape[1])
    if num_top > 0:
        values, ids = logprobs.topk(num_top, dim=1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [
        TokenLogprobs(token_id=t, logprob=lp, rank=r, top=top)
        for t, lp, r, top in zip(
            token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), tops
        )
    ]
