"""The rejection sampler keeps the target distribution exactly, accepts as
often as theory says, and draws a seeded request's tokens from its own stream."""
from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from octavo.sample.rejection import Drafts, greedy_accept, rejection_sample

VOCAB = 8
DRAWS = 200_000


def _random_pair(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, 0)
    q = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, 0)
    return p, q


def _first_tokens(p: torch.Tensor, q: Optional[torch.Tensor], gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """DRAWS independent requests, one proposal each drawn from q (None: a
    one-hot proposal of token 0), verified against p."""
    if q is None:
        draft = torch.zeros(DRAWS, dtype=torch.int64)
        draft_probs = None
    else:
        draft = torch.multinomial(q, DRAWS, replacement=True, generator=gen)
        draft_probs = q.expand(DRAWS, VOCAB)
    probs = p.expand(2 * DRAWS, VOCAB)  # rows: the proposal's position, then the bonus position
    greedy = torch.zeros(2 * DRAWS, dtype=torch.bool)
    tokens, accepted = rejection_sample(
        probs.argmax(-1), probs, greedy, Drafts([1] * DRAWS, draft, draft_probs), [None] * DRAWS
    )
    return torch.tensor([t[0] for t in tokens]), accepted


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_output_follows_the_target_and_acceptance_matches_theory(seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(100 + seed)
    p, q = _random_pair(gen)
    first, accepted = _first_tokens(p, q, gen)
    freq = torch.bincount(first, minlength=VOCAB).double() / DRAWS
    assert 0.5 * (freq - p.double()).abs().sum().item() < 0.01
    expected = torch.minimum(p, q).sum().item()
    sigma = math.sqrt(expected * (1 - expected) / DRAWS)
    assert abs(sum(accepted) / DRAWS - expected) < 3 * sigma


def test_one_hot_proposals_keep_the_target_too():
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    p, _ = _random_pair(gen)
    first, accepted = _first_tokens(p, None, gen)
    freq = torch.bincount(first, minlength=VOCAB).double() / DRAWS
    assert 0.5 * (freq - p.double()).abs().sum().item() < 0.01
    # q one-hot at token 0: accepted with probability p(0).
    sigma = math.sqrt(p[0].item() * (1 - p[0].item()) / DRAWS)
    assert abs(sum(accepted) / DRAWS - p[0].item()) < 3 * sigma


def test_greedy_accepts_while_equal_to_the_argmax_then_emits_the_argmax():
    # Request 0: 3 proposals, rows 0..3; request 1: none, row 4; request 2: 2 proposals, rows 5..7.
    argmax = torch.tensor([4, 5, 9, 1, 3, 2, 6, 8])
    drafts = Drafts([3, 0, 2], torch.tensor([4, 5, 7, 2, 6]))
    tensor_path = rejection_sample(argmax, None, torch.ones(8, dtype=torch.bool), drafts, [None] * 3)
    # verify's path for plain greedy batches: the same, from the argmax as a list.
    for tokens, accepted in (tensor_path, greedy_accept(argmax.tolist(), drafts)):
        assert tokens == [[4, 5, 9], [3], [2, 6, 8]]
        assert accepted == [2, 0, 2]


def test_the_greedy_path_agrees_with_the_rejection_sampler_on_greedy_rows():
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        num_draft = torch.randint(0, 5, (6,), generator=gen).tolist()
        rows = sum(num_draft) + len(num_draft)
        argmax = torch.randint(0, 3, (rows,), generator=gen)  # 3 tokens: proposals often agree
        drafts = Drafts(num_draft, torch.randint(0, 3, (sum(num_draft),), generator=gen))
        want = rejection_sample(argmax, None, torch.ones(rows, dtype=torch.bool), drafts, [None] * len(num_draft))
        assert greedy_accept(argmax.tolist(), drafts) == want


def test_a_token_the_target_forbids_is_never_accepted():
    p = torch.tensor([0.0, 0.5, 0.5, 0.0])
    probs = p.expand(2, 4)
    for _ in range(50):
        tokens, accepted = rejection_sample(
            probs.argmax(-1), probs, torch.zeros(2, dtype=torch.bool), Drafts([1], torch.tensor([3])), [None]
        )
        assert accepted == [0] and tokens[0][0] in (1, 2)


def test_seeded_requests_do_not_depend_on_their_batch():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(5, VOCAB, generator=gen), -1)  # one request: 4 proposals + bonus row
    q = torch.softmax(torch.randn(4, VOCAB, generator=gen), -1)
    ids = torch.multinomial(q, 1, generator=gen).squeeze(1)

    def alone() -> list[int]:
        g = torch.Generator().manual_seed(42)
        tokens, _ = rejection_sample(p.argmax(-1), p, torch.zeros(5, dtype=torch.bool), Drafts([4], ids, q), [g])
        return tokens[0]

    def in_batch(others: int) -> list[int]:
        """The same request after ``others`` unseeded requests of one proposal each."""
        g = torch.Generator().manual_seed(42)
        probs = torch.cat([torch.softmax(torch.randn(2 * others, VOCAB), -1), p])
        ids_all = torch.cat([torch.randint(VOCAB, (others,)), ids])
        draft_probs = torch.cat([torch.softmax(torch.randn(others, VOCAB), -1), q])
        drafts = Drafts([1] * others + [4], ids_all, draft_probs)
        greedy = torch.zeros(len(probs), dtype=torch.bool)
        tokens, _ = rejection_sample(probs.argmax(-1), probs, greedy, drafts, [None] * others + [g])
        return tokens[-1]

    reference = alone()
    assert in_batch(1) == reference
    assert in_batch(6) == reference
