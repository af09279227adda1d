"""The sampler end to end: distributions, greedy rows, seeds, logprobs."""
from __future__ import annotations

import dataclasses

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from octavo.sample.logprobs import token_logprobs
from octavo.sample.metadata import SamplingMetadata
from octavo.sample.sampler import Sampler
from octavo.sampling_params import SamplingParams
from sample.batch import make_request, metadata

V = 16
DRAWS = 20_000


def frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).float() / tokens.numel()


def draw(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """DRAWS independent samples of one distribution, in one batched call."""
    reqs = [make_request(params)] * DRAWS
    return Sampler()(logits_row.expand(DRAWS, V), metadata(reqs, V)).token_ids


def test_sampled_frequencies_match_softmax_over_temperature():
    torch.manual_seed(0)
    logits = torch.randn(V) * 1.5
    for temperature in (0.6, 1.0, 1.7):
        expected = torch.softmax(logits / temperature, dim=-1)
        got = frequencies(draw(logits, SamplingParams(temperature=temperature)))
        # 5 standard deviations of a frequency estimated from 20k draws.
        assert (got - expected).abs().max() < 5 * (0.25 / DRAWS) ** 0.5


def test_sampled_frequencies_match_hf_filtered_distribution():
    torch.manual_seed(1)
    logits = torch.randn(V) * 2
    scores = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(6)(None, (logits / 0.8).unsqueeze(0)))
    expected = torch.softmax(scores[0], dim=-1)
    got = frequencies(draw(logits, SamplingParams(temperature=0.8, top_k=6, top_p=0.8)))
    assert got[expected == 0].sum() == 0
    assert (got - expected).abs().max() < 5 * (0.25 / DRAWS) ** 0.5


def test_greedy_rows_take_argmax_after_penalties():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]])
    reqs = [
        make_request(SamplingParams(temperature=0.0)),
        make_request(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0], output=[1]),
        make_request(SamplingParams(temperature=0.0, logit_bias={3: 10.0})),
    ]
    for mate in (None, SamplingParams(temperature=1.0, top_k=2)):
        batch = reqs + ([make_request(mate)] if mate else [])
        rows = torch.cat([logits, logits[:1]]) if mate else logits
        tokens = Sampler()(rows, metadata(batch, 4)).token_ids
        assert tokens[:3].tolist() == [1, 2, 3]


SEEDED = {
    "s1": SamplingParams(temperature=0.9, seed=11),
    "s2": SamplingParams(temperature=1.2, top_p=0.9, seed=12),
    "s3": SamplingParams(temperature=0.7, top_k=10, min_p=0.05, repetition_penalty=1.2, seed=13),
}
MATES = {
    "m1": SamplingParams(temperature=1.0),
    "m2": SamplingParams(temperature=0.0),
    "m3": SamplingParams(temperature=1.5, top_k=3, top_p=0.5, min_p=0.2, presence_penalty=1.0),
    "m4": SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=99),
    "m5": SamplingParams(temperature=1.0, logit_bias={0: 5.0}, allowed_token_ids=list(range(20))),
}


def run_steps(
    names: list[str], step_logits: dict[str, torch.Tensor], **overrides: SamplingParams
) -> dict[str, list[int]]:
    """Decode 4 steps for the named requests batched together; each request
    sees its own logits whatever its row."""
    params = {**SEEDED, **MATES, **overrides}
    reqs = [make_request(params[n], request_id=n) for n in names]
    # The runner keeps one generator per seeded request across steps.
    generators = [
        torch.Generator().manual_seed(r.sampling_params.seed) if r.sampling_params.seed is not None else None
        for r in reqs
    ]
    for step in range(4):
        rows = torch.stack([step_logits[n][step] for n in names])
        meta = SamplingMetadata.from_requests(reqs, generators, 50)
        for req, token in zip(reqs, Sampler()(rows, meta).token_ids.tolist()):
            req.append_output_token(token)
    return {r.request_id: r.output_token_ids for r in reqs}


def test_seeded_rows_reproduce_whatever_their_batch_mates():
    torch.manual_seed(2)
    step_logits = {n: torch.randn(4, 50) for n in {**SEEDED, **MATES}}
    alone = {n: run_steps([n], step_logits)[n] for n in SEEDED}
    for names in (
        ["s1", "s2", "s3"],
        ["m1", "s3", "m3", "s1", "m2", "s2"],
        ["s2", "m4", "m5", "s1", "s3"],
        ["s3", "m1", "m5", "m3", "s2", "s1", "m4"],
    ):
        out = run_steps(names, step_logits)
        assert {n: out[n] for n in SEEDED} == alone
    # A different seed changes the tokens (the check above is not vacuous).
    reseeded = dataclasses.replace(SEEDED["s1"], seed=12345)
    assert run_steps(["s1"], step_logits, s1=reseeded)["s1"] != alone["s1"]


def test_logprobs_are_the_raw_log_softmax():
    torch.manual_seed(3)
    logits = torch.randn(3, 30)
    reqs = [
        make_request(SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=5), output=[1, 2]),
        make_request(SamplingParams(temperature=0.0, logit_bias={4: 50.0}, logprobs=2)),
        make_request(SamplingParams(temperature=1.0)),
    ]
    out = Sampler()(logits, metadata(reqs, 30))
    expected = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, expected)
    assert out.token_ids[1] == 4  # the bias steered the choice, not the reported logprobs

    entries = token_logprobs(out.logprobs, out.token_ids, num_top=5)
    for row, entry in enumerate(entries):
        order = expected[row].argsort(descending=True).tolist()
        assert entry.token_id == out.token_ids[row]
        assert entry.logprob == expected[row, entry.token_id].item()
        assert entry.rank == order.index(entry.token_id) + 1
        assert [t for t, _ in entry.top] == order[:5]
        torch.testing.assert_close(torch.tensor([v for _, v in entry.top]), expected[row, order[:5]])


def test_no_logprobs_unless_asked():
    reqs = [make_request(SamplingParams()), make_request(SamplingParams(temperature=0.0))]
    assert Sampler()(torch.randn(2, 10), metadata(reqs, 10)).logprobs is None


def test_masked_tokens_are_never_sampled():
    torch.manual_seed(4)
    allowed = [3, 7, 8]
    reqs = [make_request(SamplingParams(temperature=2.0, allowed_token_ids=allowed))] * 5000
    tokens = Sampler()(torch.randn(5000, V) * 5, metadata(reqs, V)).token_ids
    assert set(tokens.tolist()) == set(allowed)
