"""Verification of speculative proposals: accept a prefix, emit one more token.

A request proposes k tokens d_1..d_k (a draft model drew d_j from its
distribution q_j; n-gram lookup has q_j one-hot at d_j). The target's forward
gives logits at the request's last token and at each proposal, so k+1 rows:
row j is the target's distribution p_j of the token after d_1..d_j. Every row
goes through the sampler's own steps (bias, bans, penalties counting d_1..d_j
as output, the grammar's mask after d_1..d_j, temperature, top-k/p, min-p),
so p_j is exactly what the sampler would draw from had d_1..d_j been sampled.

- Greedy rows: accept d_j while it equals argmax p_{j-1}; the first mismatch
  is replaced by that argmax, and after k matches argmax p_k is the bonus
  token. The output equals greedy decoding without speculation, token for token.
- Random rows (Leviathan et al. 2023, Chen et al. 2023): accept d_j with
  probability min(1, p(d_j) / q(d_j)), testing u_j * q(d_j) < p(d_j) with
  u_j ~ U[0, 1); at the first rejection draw from norm(max(0, p - q)) instead
  and stop; when all k are accepted draw the bonus token from p_k. Each
  emitted token is then distributed exactly as p: P(t) = min(p, q)(t) +
  (1 - sum min(p, q)) * (p - q)+(t) / sum (p - q)+ = p(t), since
  sum (p - q)+ = 1 - sum min(p, q). For one-hot q at d, (p - q)+ is p with
  d removed.
Draws use the exponential race (argmax w / E, E ~ Exp(1)) on unnormalised
weights w, so no row is normalised. A seeded request draws its k uniforms,
then one noise row, from its own generator: its tokens depend on nothing
else in the batch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from octavo.core.step_state import CachedRequestState, ScheduledRow
from octavo.sample.metadata import SamplingMetadata
from octavo.sample.sampler import plain_greedy, process_logits, sample_from_probs, warp_logits
from octavo.sampling_params import GREEDY_TEMPERATURE


def _max_indices(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices


@dataclass
class Drafts:
    """The proposals of a batch. Request b owns ``num_draft[b] + 1``
    consecutive rows of the logits and ``num_draft[b]`` consecutive entries of
    ``token_ids`` (and ``probs``); a request with no proposal has one row."""

    num_draft: list[int]
    token_ids: torch.Tensor  # [D] int64, D = sum(num_draft)
    probs: Optional[torch.Tensor] = None  # [D, V] q of each proposal; None: one-hot (n-gram)


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per request: accepted proposals, then the target's token
    num_accepted: list[int]
    # log-softmax of the raw logits of every row; None when no row asked.
    logprobs: Optional[torch.Tensor] = None  # [R, V]


@dataclass
class VerificationRows:
    """The sampler rows of a batch with proposals: request i's row j is its
    state as if its first j proposals were output (``DraftedState``)."""

    states: list[CachedRequestState | DraftedState]
    generators: list[Optional[torch.Generator]]  # the request's, on each of its rows
    positions: list[int]  # j of each row
    row_starts: list[int]  # each request's first row


class DraftedState:
    """A request's state with proposals appended to its output, read-only
    and lazy (the lists are built only if penalties or bans read them)."""

    def __init__(self, state: CachedRequestState, proposals: list[int]) -> None:
        self._state = state
        self._proposals = proposals
        self.request_id = state.request_id
        self.sampling_params = state.sampling_params
        self.eos_token_id = state.eos_token_id
        self.prompt_token_ids = state.prompt_token_ids
        at = state.grammar_terminated_at
        self.grammar_terminated = state.grammar_terminated or (at is not None and len(proposals) >= at)

    @property
    def output_token_ids(self) -> list[int]:
        return self._state.output_token_ids + self._proposals

    @property
    def all_token_ids(self) -> list[int]:
        return self._state.all_token_ids + self._proposals

    @property
    def num_output_tokens(self) -> int:
        return self._state.num_output_tokens + len(self._proposals)

    @property
    def num_prompt_tokens(self) -> int:
        return self._state.num_prompt_tokens


def verification_rows(
    scheduled: list[ScheduledRow], generators: list[Optional[torch.Generator]]
) -> VerificationRows:
    """Rows for ``verify``: k + 1 per request with k proposals."""
    rows = VerificationRows([], [], [], [])
    for s, gen in zip(scheduled, generators):
        rows.row_starts.append(len(rows.states))
        for j in range(len(s.spec_token_ids) + 1):
            rows.states.append(DraftedState(s.request, s.spec_token_ids[:j]) if j else s.request)
            rows.generators.append(gen)
            rows.positions.append(j)
    return rows


def verify(logits: torch.Tensor, meta: SamplingMetadata, drafts: Drafts,
           argmax: Callable[[torch.Tensor], torch.Tensor] = _max_indices) -> VerifyOutput:
    """``logits`` [R, V]; ``meta`` describes the R rows (``verification_rows``:
    row j of a request as if its first j proposals were output). ``argmax``:
    the sampler's (the model's native one), so that greedy rows choose as
    plain decoding does."""
    if plain_greedy(meta):
        # As the sampler's own fast path: the raw logits' argmax, and the
        # acceptance in Python (a quarter of the tensor path's time at batch 1).
        tokens, accepted = greedy_accept(argmax(logits).tolist(), drafts)
        return VerifyOutput(tokens, accepted)
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
    logits = process_logits(logits, meta)
    best = logits.max(dim=-1).indices
    probs = None if meta.all_greedy else torch.softmax(warp_logits(logits, meta), dim=-1)
    greedy_rows = meta.temperature < GREEDY_TEMPERATURE
    first_rows = itertools.accumulate((k + 1 for k in drafts.num_draft), initial=0)
    generators = [meta.generators[row] for row, _ in zip(first_rows, drafts.num_draft)]
    tokens, accepted = rejection_sample(best, probs, greedy_rows, drafts, generators)
    return VerifyOutput(tokens, accepted, logprobs)


def greedy_accept(argmax: list[int], drafts: Drafts) -> tuple[list[list[int]], list[int]]:
    """Greedy verification from each row's argmax: a request accepts its
    proposals while each equals the argmax of the row before it, then emits
    that row's argmax. Returns each request's emitted tokens and how many
    proposals it accepted (what ``rejection_sample`` gives greedy rows)."""
    ids = drafts.token_ids.tolist()
    tokens, accepted = [], []
    row = draft = 0
    for k in drafts.num_draft:
        n = 0
        while n < k and ids[draft + n] == argmax[row + n]:
            n += 1
        tokens.append(ids[draft : draft + n] + [argmax[row + n]])
        accepted.append(n)
        row, draft = row + k + 1, draft + k
    return tokens, accepted


def rejection_sample(
    argmax: torch.Tensor,
    probs: Optional[torch.Tensor],
    greedy_rows: torch.Tensor,
    drafts: Drafts,
    generators: list[Optional[torch.Generator]],
) -> tuple[list[list[int]], list[int]]:
    """The tensor part of ``verify``: ``argmax`` [R] of the processed logits,
    ``probs`` [R, V] the target distributions (None when every row is
    greedy), ``greedy_rows`` [R] bool. Returns each request's emitted tokens
    and how many proposals it accepted."""
    device = argmax.device
    num_draft = torch.tensor(drafts.num_draft, dtype=torch.int64, device=device)
    num_requests = len(drafts.num_draft)
    row_start = torch.cumsum(num_draft + 1, 0) - (num_draft + 1)  # [B] first row of each request
    draft_start = torch.cumsum(num_draft, 0) - num_draft  # [B] first proposal of each request
    draft_req = torch.repeat_interleave(torch.arange(num_requests, device=device), num_draft)  # [D]
    draft_pos = torch.arange(draft_req.numel(), device=device) - draft_start[draft_req]  # j - 1 of d_j
    draft_row = row_start[draft_req] + draft_pos  # the row whose distribution judges d_j
    ids = drafts.token_ids.to(device)

    accept = ids == argmax[draft_row]
    if probs is not None:
        p = probs[draft_row, ids]
        q = drafts.probs[torch.arange(ids.numel(), device=device), ids] if drafts.probs is not None else 1.0
        u = _uniforms(drafts.num_draft, generators, device)
        accept = torch.where(greedy_rows[draft_row], accept, u * q < p)

    width = max(drafts.num_draft, default=0)
    padded = torch.zeros(num_requests, width, dtype=torch.bool, device=device)
    padded[draft_req, draft_pos] = accept
    num_accepted = padded.to(torch.int64).cumprod(dim=1).sum(dim=1)  # up to the first rejection
    final_row = row_start + num_accepted
    final = argmax[final_row]
    if probs is not None:
        weights = probs[final_row]
        rejected = num_accepted < num_draft
        if rejected.any():
            weights = _residual(weights, rejected, draft_start + num_accepted, drafts, device)
        final = torch.where(greedy_rows[final_row], final, sample_from_probs(weights, generators))

    accepted_list = num_accepted.tolist()
    ids_list, final_list, starts = ids.tolist(), final.tolist(), draft_start.tolist()
    tokens = [ids_list[s : s + a] + [f] for s, a, f in zip(starts, accepted_list, final_list)]
    return tokens, accepted_list


def _residual(
    weights: torch.Tensor, rejected: torch.Tensor, draft_index: torch.Tensor, drafts: Drafts, device: torch.device
) -> torch.Tensor:
    """max(0, p - q) on the rejected rows (their q: the rejected proposal's)."""
    index = draft_index.clamp(max=max(drafts.token_ids.numel() - 1, 0))
    if drafts.probs is not None:
        q = drafts.probs[index]
    else:
        q = torch.zeros_like(weights)
        q.scatter_(1, drafts.token_ids.to(device)[index].unsqueeze(1), 1.0)
    residual = (weights - q).clamp_min(0.0)
    # p == q up to rounding leaves nothing: p itself is then the exact answer.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, weights, residual)
    return torch.where(rejected.unsqueeze(1), residual, weights)


def _uniforms(num_draft: list[int], generators: list[Optional[torch.Generator]], device: torch.device) -> torch.Tensor:
    """U[0, 1) per proposal; a seeded request's from its own generator."""
    u = torch.empty(sum(num_draft), device=device)
    if any(g is None for g in generators):
        u.uniform_()
    start = 0
    for k, gen in zip(num_draft, generators):
        if gen is not None and k:
            u[start : start + k].uniform_(generator=gen)
        start += k
    return u
