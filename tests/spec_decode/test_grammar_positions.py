"""Grammar masks at proposed positions: the matcher walks through the
proposals, each row is the mask after the proposals before it, and the
matcher is back where it was afterwards."""
from __future__ import annotations

import torch

from octavo.sample.llguidance_backend import LLGuidanceBackend
from octavo.sample.structured import GrammarBatch, grammar_bitmask
from octavo.sampling_params import StructuredOutputParams
from tests.sample.utf8_tokenizer import load_utf8_tokenizer

VOCAB = 448


def _rows(mask) -> torch.Tensor:
    return torch.frombuffer(bytearray(mask.bitmask), dtype=torch.int32).view(-1, mask.num_words)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_rows_follow_the_proposals_and_the_matcher_rolls_back(tmp_path):
    tokenizer = load_utf8_tokenizer(tmp_path)
    backend = LLGuidanceBackend(tokenizer, VOCAB)
    spec = StructuredOutputParams(regex=r"(cat|dog)-[0-9]{2,4}")
    matcher, other = backend.compile(spec), backend.compile(spec)
    other.accept_tokens([_encode(tokenizer, "d")[0]])
    valid = _encode(tokenizer, "cat-1")
    proposals = valid + _encode(tokenizer, "x2")  # "x" breaks the grammar
    before = _rows(grammar_bitmask(backend, ["m"], [matcher], VOCAB))

    shipped = grammar_bitmask(backend, ["m", "o"], [matcher, other], VOCAB, [proposals, []])
    rows = _rows(shipped)
    assert shipped.num_positions == [len(proposals) + 1, 1]
    step_by_step = backend.compile(spec)
    for j in range(len(valid) + 1):
        assert torch.equal(rows[j], _rows(grammar_bitmask(backend, ["s"], [step_by_step], VOCAB))[0]), j
        if j < len(valid):
            step_by_step.accept_tokens([valid[j]])
    for j in range(len(valid) + 1, len(proposals) + 1):  # past the refused proposal: never used
        assert torch.equal(rows[j], rows[len(valid)])
    assert torch.equal(rows[-1], _rows(grammar_bitmask(backend, ["o"], [other], VOCAB))[0])
    assert torch.equal(_rows(grammar_bitmask(backend, ["m"], [matcher], VOCAB)), before)  # rolled back

    # The sampler side picks row j for a request's position j.
    batch = GrammarBatch.from_bitmask(["m", "m", "o"], shipped, VOCAB, torch.device("cpu"), positions=[0, 2, 0])
    assert batch.allowed[1].nonzero().flatten().tolist() == [_encode(tokenizer, "t")[0]]


def test_termination_inside_the_proposals_is_reported(tmp_path):
    tokenizer = load_utf8_tokenizer(tmp_path)
    backend = LLGuidanceBackend(tokenizer, VOCAB)
    grammar = backend.compile(StructuredOutputParams(choice=["yes", "no"]))
    proposals = _encode(tokenizer, "no")
    shipped = grammar_bitmask(backend, ["r"], [grammar], VOCAB, [proposals])
    assert shipped.terminated == set() and shipped.terminated_at == {"r": len(proposals)}
