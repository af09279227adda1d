"""The n-gram proposer against the brute-force search its docstring describes."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.core.step_state import CachedRequestState
from octavo.sampling_params import SamplingParams
from octavo.spec_decode.ngram import NgramProposer, ngram_lookup
from octavo.spec_decode.proposer import ProposalInput


def brute_force(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Longest n first; for each n, the latest earlier window equal to the
    last n tokens; copy what followed it, token by token, reading the copy's
    own output once past the end."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[length:]
    return []


# A small alphabet makes repeats (and so matches of every length) common.
_tokens = st.lists(st.integers(0, 3), min_size=0, max_size=60)


@settings(max_examples=400, deadline=None)
@given(tokens=_tokens, ngram_min=st.integers(1, 4), extra=st.integers(0, 4), k=st.integers(0, 6))
def test_matches_brute_force(tokens, ngram_min, extra, k):
    ngram_max = ngram_min + extra
    expected = brute_force(tokens, ngram_min, ngram_max, k) if k > 0 else []
    assert ngram_lookup(tokens, ngram_min, ngram_max, k) == expected


def test_prefers_the_longest_match_then_the_latest():
    # "2 3" occurs at 1-2 (then 9) and at 5-6 (then 7); "1 2 3" only at 0-2.
    tokens = [1, 2, 3, 9, 4, 2, 3, 7, 1, 2, 3]
    assert ngram_lookup(tokens, 1, 3, 2) == [9, 4]
    assert ngram_lookup(tokens, 1, 2, 2) == [7, 1]  # n capped at 2: the latest "2 3"


def test_a_loop_is_continued_for_all_k_tokens():
    assert ngram_lookup([4, 5, 6, 6, 6], 1, 3, 4) == [6, 6, 6, 6]
    assert ngram_lookup([9, 1, 2, 1, 2], 1, 2, 5) == [1, 2, 1, 2, 1]


@settings(max_examples=100, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=30), new=st.lists(st.integers(0, 3), max_size=5),
       limit=st.integers(0, 5))
def test_proposer_reads_prompt_outputs_and_new_tokens(prompt, new, limit):
    state = CachedRequestState("r", prompt[:1], prompt[1:], SamplingParams(), None)
    row = ProposalInput(state, start_pos=0, num_tokens=1, new_token_ids=new, max_proposals=limit)
    (proposal,) = NgramProposer(1, 3).propose([row])
    expected = brute_force(prompt + new, 1, 3, limit) if new and limit else []
    assert proposal.token_ids == expected and proposal.probs is None


@settings(max_examples=50, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20),
       steps=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=80))
def test_proposer_follows_a_request_across_steps(prompt, steps):
    """The proposer keeps each request's tokens between steps (appending
    what is new); the answers stay those of the brute force, past any
    regrowth of its buffer, and a removed request starts afresh."""
    proposer = NgramProposer(1, 3)
    state = CachedRequestState("r", prompt, [], SamplingParams(), None)
    for new in steps:
        row = ProposalInput(state, start_pos=0, num_tokens=1, new_token_ids=new, max_proposals=3)
        (proposal,) = proposer.propose([row])
        assert proposal.token_ids == brute_force(state.all_token_ids + new, 1, 3, 3)
        state.extend(new)  # the next step brings them to the worker's state
    proposer.remove_requests({"r"})
    fresh = CachedRequestState("r", [2, 2], [], SamplingParams(), None)
    (proposal,) = proposer.propose([ProposalInput(fresh, 0, 1, [2], 2)])
    assert proposal.token_ids == [2, 2]
