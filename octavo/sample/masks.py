"""Per-request token biases and bans: logit_bias, allowed_token_ids, bad_words, min_tokens.

Everything is gathered into sparse (row, token) index tensors, so a batch
costs O(number of biased or banned tokens), never B x V Python work. A ban
sets the logit to -inf; since -inf absorbs any later bias or penalty, the bans
can be applied together after the bias.

- bad_words: a single-token word is always banned; for a longer word the last
  token is banned when the output ends with the word's preceding tokens.
- min_tokens: while fewer tokens than that were generated, EOS and the
  stop_token_ids are banned. A request whose grammar has terminated is exempt:
  its grammar allows only EOS, and the grammar must win.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from octavo.core.step_state import CachedRequestState

_NEG_INF = float("-inf")


@dataclass
class TokenMasks:
    bias_index: Optional[tuple[torch.Tensor, torch.Tensor]]  # (rows, tokens) int64
    bias_values: Optional[torch.Tensor]  # float32, one per index
    allowed_rows: Optional[torch.Tensor]  # [R] int64: rows restricted by allowed_token_ids
    allowed_keep: Optional[torch.Tensor]  # [R, V] bool: True = allowed
    ban_index: Optional[tuple[torch.Tensor, torch.Tensor]]  # (rows, tokens) int64

    @classmethod
    def from_requests(
        cls, requests: Sequence[CachedRequestState], vocab_size: int, device: torch.device
    ) -> Optional[TokenMasks]:
        """None when no request biases or bans anything this step."""
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        allowed_rows: list[int] = []
        allowed_lists: list[list[int]] = []
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        for row, req in enumerate(requests):
            params = req.sampling_params
            if params.logit_bias:
                bias_rows.extend([row] * len(params.logit_bias))
                bias_tokens.extend(params.logit_bias)
                bias_values.extend(params.logit_bias.values())
            if params.allowed_token_ids is not None:
                allowed_rows.append(row)
                allowed_lists.append(params.allowed_token_ids)
            banned = list(_bad_word_bans(req.output_token_ids, params.bad_words_token_ids))
            if _below_min_tokens(req):
                banned.extend(params.stop_token_ids)
                # ignore_eos makes EOS an ordinary token, as in vLLM.
                if req.eos_token_id is not None and not params.ignore_eos:
                    banned.append(req.eos_token_id)
            ban_rows.extend([row] * len(banned))
            ban_tokens.extend(banned)
        if not (bias_rows or allowed_rows or ban_rows):
            return None

        def index(rows: list[int], tokens: list[int]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
            if not rows:
                return None
            return (
                torch.tensor(rows, dtype=torch.int64, device=device),
                torch.tensor(tokens, dtype=torch.int64, device=device),
            )

        keep = None
        if allowed_rows:
            keep = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool)
            for i, ids in enumerate(allowed_lists):
                keep[i, ids] = True
            keep = keep.to(device)
        return cls(
            bias_index=index(bias_rows, bias_tokens),
            bias_values=(
                torch.tensor(bias_values, dtype=torch.float32, device=device) if bias_rows else None
            ),
            allowed_rows=(
                torch.tensor(allowed_rows, dtype=torch.int64, device=device) if allowed_rows else None
            ),
            allowed_keep=keep,
            ban_index=index(ban_rows, ban_tokens),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Biased and masked copy of ``logits`` [B, V]."""
        logits = logits.clone()
        if self.bias_index is not None:
            logits.index_put_(self.bias_index, self.bias_values, accumulate=True)
        if self.allowed_rows is not None:
            rows = logits[self.allowed_rows]
            logits[self.allowed_rows] = rows.masked_fill(~self.allowed_keep, _NEG_INF)
        if self.ban_index is not None:
            logits[self.ban_index] = _NEG_INF
        return logits


def _bad_word_bans(output: list[int], sequences: list[list[int]]) -> Iterator[int]:
    for seq in sequences:
        prefix = seq[:-1]
        if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
            yield seq[-1]


def _below_min_tokens(req: CachedRequestState) -> bool:
    if req.num_output_tokens >= req.sampling_params.min_tokens:
        return False
    return not req.grammar_terminated
