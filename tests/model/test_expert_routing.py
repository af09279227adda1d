"""DeepSeek's routers against a hand computation: softmax or sigmoid scores, a correction bias that
chooses but does not weigh, only the best groups of experts eligible, renormalised and scaled."""
from __future__ import annotations

import math

import torch

from octavo.model.config import ExpertRouting
from octavo.model.layers.moe import select_experts


def _hand_routing(scores: list[float], bias: list[float], groups: int, top_groups: int, top_k: int,
                  group_by_top2: bool) -> tuple[list[int], list[float]]:
    """One token's experts and weights, the slow obvious way."""
    size = len(scores) // groups
    choice = [s + b for s, b in zip(scores, bias)]
    group_scores = []
    for g in range(groups):
        members = sorted(choice[g * size:(g + 1) * size], reverse=True)
        group_scores.append(members[0] + members[1] if group_by_top2 else members[0])
    kept = sorted(range(groups), key=lambda g: -group_scores[g])[:top_groups]
    eligible = [e for e in range(len(scores)) if e // size in kept]
    ids = sorted(eligible, key=lambda e: -choice[e])[:top_k]
    return ids, [scores[e] for e in ids]


def test_sigmoid_routing_with_bias_within_the_best_groups_is_the_hand_computation():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 16, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.5
    routing = ExpertRouting(scoring="sigmoid", groups=4, top_groups=2, group_score="top2", score_bias=True,
                            scale=2.5)
    weights, ids = select_experts(logits, 3, True, routing, bias)
    for row in range(5):
        scores = torch.sigmoid(logits[row]).tolist()
        want_ids, want = _hand_routing(scores, bias.tolist(), 4, 2, 3, group_by_top2=True)
        got = dict(zip(ids[row].tolist(), weights[row].tolist()))
        assert sorted(got) == sorted(want_ids)
        for e, w in zip(want_ids, want):
            assert math.isclose(got[e], 2.5 * w / sum(want), rel_tol=1e-6)
    # The bias decides the choice only: without it other experts win (the test would see a router ignoring it).
    assert not torch.equal(select_experts(logits, 3, True, routing, torch.zeros(16))[1].sort().values,
                           ids.sort().values)


def test_softmax_routing_within_the_groups_of_best_experts_is_the_hand_computation():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 8, generator=gen)
    routing = ExpertRouting(groups=4, top_groups=2, scale=1.5)
    weights, ids = select_experts(logits, 2, False, routing)
    for row in range(5):
        scores = torch.softmax(logits[row], dim=-1).tolist()
        want_ids, want = _hand_routing(scores, [0.0] * 8, 4, 2, 2, group_by_top2=False)
        got = dict(zip(ids[row].tolist(), weights[row].tolist()))
        assert sorted(got) == sorted(want_ids)
        for e, w in zip(want_ids, want):
            assert math.isclose(got[e], 1.5 * w, rel_tol=1e-6)
