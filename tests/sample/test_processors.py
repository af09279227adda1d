"""Logit processing against Hugging Face's logits processors on the same logits."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from octavo.sample.sampler import process_logits, warp_logits
from octavo.sample.topk_topp import apply_top_k_top_p_min_p
from octavo.sampling_params import SamplingParams
from sample.batch import make_request, metadata

V = 64
NO_IDS = torch.zeros(1, 0, dtype=torch.long)


@pytest.fixture
def logits():
    return torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 3


def assert_same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    torch.testing.assert_close(ours[finite], ref[finite])


def test_top_k_matches_hf_per_row(logits):
    ks = [1, 5, 0, 63, 64, 17]  # 0 = off
    ours = apply_top_k_top_p_min_p(logits, top_k=torch.tensor(ks))
    for row, k in enumerate(ks):
        ref = TopKLogitsWarper(k)(NO_IDS, logits[row:row + 1]) if k else logits[row:row + 1]
        assert_same(ours[row:row + 1], ref)


def test_top_k_keeps_ties_like_hf():
    row = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0]])
    ours = apply_top_k_top_p_min_p(row, top_k=torch.tensor([2]))
    assert_same(ours, TopKLogitsWarper(2)(NO_IDS, row))
    assert torch.isfinite(ours).sum() == 3


def test_top_p_matches_hf_per_row(logits):
    ps = [0.1, 0.5, 0.9, 1.0, 0.99, 0.01]
    ours = apply_top_k_top_p_min_p(logits, top_p=torch.tensor(ps))
    for row, p in enumerate(ps):
        assert_same(ours[row:row + 1], TopPLogitsWarper(p)(NO_IDS, logits[row:row + 1]))


def test_min_p_matches_hf_per_row(logits):
    ps = [0.0, 0.05, 0.2, 0.5, 0.9, 1.0]
    ours = apply_top_k_top_p_min_p(logits, min_p=torch.tensor(ps))
    for row, p in enumerate(ps):
        ref = MinPLogitsWarper(p)(NO_IDS, logits[row:row + 1]) if p else logits[row:row + 1]
        assert_same(ours[row:row + 1], ref)


def test_temperature_top_k_top_p_min_p_chain_matches_hf(logits):
    settings = [
        dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05),
        dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
        dict(temperature=0.5, top_k=20, top_p=1.0, min_p=0.1),
        dict(temperature=1.0, top_k=3, top_p=0.5, min_p=0.0),
        dict(temperature=2.0, top_k=0, top_p=1.0, min_p=0.3),
        dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02),
    ]
    reqs = [make_request(SamplingParams(**s)) for s in settings]
    ours = warp_logits(logits, metadata(reqs, V))
    for row, s in enumerate(settings):
        ref = TemperatureLogitsWarper(s["temperature"])(NO_IDS, logits[row:row + 1])
        if s["top_k"]:
            ref = TopKLogitsWarper(s["top_k"])(NO_IDS, ref)
        if s["top_p"] < 1:
            ref = TopPLogitsWarper(s["top_p"])(NO_IDS, ref)
        if s["min_p"]:
            ref = MinPLogitsWarper(s["min_p"])(NO_IDS, ref)
        assert_same(ours[row:row + 1], ref)


def test_repetition_penalty_matches_hf(logits):
    gen = torch.Generator().manual_seed(1)
    penalties = [1.0, 1.3, 0.7, 2.0, 1.1, 1.5]
    reqs = []
    for row, pen in enumerate(penalties):
        prompt = torch.randint(0, V, (7,), generator=gen).tolist()
        output = torch.randint(0, V, (row,), generator=gen).tolist()
        reqs.append(make_request(SamplingParams(repetition_penalty=pen), prompt, output))
    ours = process_logits(logits, metadata(reqs, V))
    for row, (req, pen) in enumerate(zip(reqs, penalties)):
        ids = torch.tensor([req.all_token_ids])
        ref = RepetitionPenaltyLogitsProcessor(pen)(ids, logits[row:row + 1].clone())
        assert_same(ours[row:row + 1], ref)


def test_presence_and_frequency_penalties_follow_openai_formula(logits):
    gen = torch.Generator().manual_seed(2)
    settings = [(0.0, 0.0), (0.5, 0.0), (0.0, 0.8), (-1.0, 1.5), (2.0, -2.0), (0.3, 0.3)]
    reqs = []
    for presence, frequency in settings:
        output = torch.randint(0, 8, (12,), generator=gen).tolist()  # repeats guaranteed
        prompt = torch.randint(0, V, (5,), generator=gen).tolist()  # must not count
        reqs.append(make_request(
            SamplingParams(presence_penalty=presence, frequency_penalty=frequency), prompt, output
        ))
    ours = process_logits(logits, metadata(reqs, V))
    for row, (req, (presence, frequency)) in enumerate(zip(reqs, settings)):
        ref = logits[row].clone()
        for token in set(req.output_token_ids):
            count = req.output_token_ids.count(token)
            ref[token] -= frequency * count + presence
        torch.testing.assert_close(ours[row], ref)


def test_logit_bias_allowed_ids_bad_words_min_tokens(logits):
    bias = make_request(SamplingParams(logit_bias={3: 5.0, 9: -7.5}))
    allowed = make_request(SamplingParams(allowed_token_ids=[2, 11, 40]))
    bad = make_request(
        SamplingParams(bad_words=["w"], _bad_words_token_ids=[[7], [20, 21, 22], [30, 31]]),
        output=[5, 20, 21],
    )
    min_tok = make_request(SamplingParams(min_tokens=3, stop_token_ids=[12, 13]), output=[4, 4], eos_token_id=1)
    # ignore_eos makes EOS an ordinary token: min_tokens bans only the stop ids.
    no_eos = make_request(
        SamplingParams(min_tokens=3, stop_token_ids=[12], ignore_eos=True), output=[4], eos_token_id=1
    )
    done = make_request(SamplingParams(min_tokens=2, stop_token_ids=[12]), output=[4, 4], eos_token_id=1)
    plain = make_request(SamplingParams())
    reqs = [bias, allowed, bad, min_tok, no_eos, done, plain]
    ours = process_logits(logits, metadata(reqs, V))

    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 9] -= 7.5
    keep = torch.zeros(V, dtype=torch.bool)
    keep[[2, 11, 40]] = True
    expected[1, ~keep] = float("-inf")
    expected[2, [7, 22]] = float("-inf")  # single token always; 22 as the output ends with 20 21
    expected[3, [1, 12, 13]] = float("-inf")  # eos and stop ids while below min_tokens
    expected[4, 12] = float("-inf")
    assert_same(ours, expected)
    assert torch.equal(ours[5:], logits[5:])  # untouched rows stay bit-identical


def test_bad_word_prefix_must_match_the_end_of_the_output(logits):
    params = SamplingParams(bad_words=["w"], _bad_words_token_ids=[[20, 21, 22]])
    reqs = [
        make_request(params, output=[21]),
        make_request(params, output=[20, 21, 5]),
        make_request(params, prompt=[20], output=[21]),  # the prompt does not count
        make_request(params, output=[9, 20, 21]),
    ]
    ours = process_logits(logits[:4], metadata(reqs, V))
    assert torch.isinf(ours[:, 22]).tolist() == [False, False, False, True]


def test_neutral_rows_are_untouched_by_busy_batch_mates(logits):
    busy = SamplingParams(
        temperature=0.5, top_k=5, top_p=0.7, min_p=0.1, repetition_penalty=1.5,
        presence_penalty=1.0, frequency_penalty=1.0, logit_bias={1: 3.0},
    )
    reqs = [make_request(busy, output=[1, 2, 2]), make_request(SamplingParams(), output=[1, 2, 2])]
    meta = metadata(reqs, V)
    out = warp_logits(process_logits(logits[:2], meta), meta)
    assert torch.equal(out[1], logits[1])
