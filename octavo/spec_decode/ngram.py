"""Prompt lookup (n-gram) proposals: no model, only the request's own tokens.

Output often repeats stretches of the input (code edits, quoting, summaries,
retrieval answers). Find the longest n-gram (``ngram_max`` down to
``ngram_min``) that ends the request's tokens and occurred before, and propose
the k tokens that followed its latest earlier occurrence. The latest, not the
first: nearby text predicts the continuation better. When the continuation
runs into the end of the tokens (the match overlaps the suffix: a repeating
pattern), it goes on copying from the proposals themselves, so a loop of
period p yields k tokens, not p.

Cost: one numpy pass of O(length x ngram_max) per request per step. All
window lengths are matched together: ``run[i]`` is how many tokens ending at
position i equal the tokens ending the sequence (capped at ``ngram_max``).
"""
from __future__ import annotations

import numpy as np

from octavo.spec_decode.proposer import Proposal, ProposalInput, Proposer


def ngram_lookup(token_ids: list[int] | np.ndarray, ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """The ``k`` tokens that followed the latest earlier occurrence of the
    longest suffix of ``token_ids`` of ``ngram_min..ngram_max`` tokens
    (continuing the copy into its own output past the end); empty when no
    such suffix occurred before."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    if k < 1 or length < ngram_min + 1:
        return []
    # Window ends 0 .. length-2 (the window ending at length-1 is the suffix itself).
    ends = length - 1
    run = np.zeros(ends, dtype=np.int64)
    alive = np.ones(ends, dtype=bool)
    for j in range(min(ngram_max, ends)):
        # Does the token j before each window end equal the token j before the last?
        same = np.zeros(ends, dtype=bool)
        same[j:] = tokens[: ends - j] == tokens[length - 1 - j]
        alive &= same
        if not alive.any():
            break
        run += alive
    best = int(run.max())
    if best < ngram_min:
        return []
    end = int(np.flatnonzero(run == best)[-1])
    period = length - 1 - end  # the copy source trails its destination by this much
    following = tokens[end + 1 :].tolist()
    return [following[i % period] for i in range(k)]


class NgramProposer(Proposer):
    """Prompt lookup over prompt + outputs; q is one-hot (``Proposal.probs`` None)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, rows: list[ProposalInput]) -> list[Proposal]:
        out = []
        for row in rows:
            if row.max_proposals < 1 or not row.new_token_ids:
                out.append(Proposal())
                continue
            tokens = row.state.all_token_ids + row.new_token_ids
            out.append(Proposal(ngram_lookup(tokens, self.ngram_min, self.ngram_max, row.max_proposals)))
        return out
