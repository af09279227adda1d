"""SamplingParams validation: every bad value is a ValueError naming its field."""
from __future__ import annotations

import dataclasses

import pytest

from octavo.sampling_params import SamplingParams, StructuredOutputParams
from sample.utf8_tokenizer import load_utf8_tokenizer

INVALID = [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": True}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 1, "best_of": 2, "temperature": 0.0}, "best_of"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"seed": 1.0}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": ("a",)}, "stop"),
    ({"stop": ["x"], "detokenize": False}, "detokenize"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"detokenize": 0}, "detokenize"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 1.0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"bogus": 1}}, "structured_outputs"),
    ({"output_kind": "streaming"}, "output_kind"),
    ({"output_kind": None}, "output_kind"),
]


@pytest.mark.parametrize("kwargs,field", INVALID, ids=[f"{f}-{i}" for i, (_, f) in enumerate(INVALID)])
def test_invalid_value_names_its_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({}, "structured_outputs"),
        ({"regex": "a", "json_object": True}, "structured_outputs"),
        ({"json_object": "yes"}, "json_object"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": [1, 2]}, "json_schema"),
        ({"regex": ""}, "regex"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", ""]}, "choice"),
        ({"choice": "a"}, "choice"),
    ],
)
def test_invalid_structured_outputs(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StructuredOutputParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="END", logit_bias={"7": 2}, structured_outputs={"regex": "[a-z]+"})
    assert p.stop == ["END"] and p.best_of == p.n == 1
    assert p.logit_bias == {7: 2.0}
    assert p.structured_outputs == StructuredOutputParams(regex="[a-z]+")
    assert StructuredOutputParams(json_schema='{"type": "integer"}').json_schema == {"type": "integer"}
    assert not p.greedy and SamplingParams(temperature=0.0).greedy


def test_accepted_edge_values():
    SamplingParams(n=3, temperature=0.0)  # n greedy copies, nothing to rank
    SamplingParams(n=2, best_of=4, temperature=0.8)
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, max_tokens=0, logprobs=20, prompt_logprobs=0)
    SamplingParams(seed=-(2**63)), SamplingParams(seed=2**63 - 1)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, logit_bias={0: -100, 1: 100})


def test_check_vocab_names_the_field():
    for kwargs, field in [
        ({"stop_token_ids": [10]}, "stop_token_ids"),
        ({"allowed_token_ids": [3, 10]}, "allowed_token_ids"),
        ({"logit_bias": {10: 1.0}}, "logit_bias"),
        ({"bad_words": ["x"], "_bad_words_token_ids": [[10]]}, "bad_words"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs).check_vocab(10)
    SamplingParams(stop_token_ids=[9], allowed_token_ids=[9], logit_bias={9: 1.0}).check_vocab(10)


def test_resolve_bad_words(tmp_path):
    tok = load_utf8_tokenizer(tmp_path)
    words = ["café", "quick brown", " lazy"]
    p = SamplingParams(bad_words=words)
    with pytest.raises(ValueError, match="resolve_bad_words"):
        p.bad_words_token_ids
    p.resolve_bad_words(tok)
    resolved = p.bad_words_token_ids
    variants = [
        tok.encode(text, add_special_tokens=False)
        for w in words
        for text in (w.lstrip(), " " + w.lstrip())
    ]
    # Every kept sequence is a real spelling of a bad word ...
    assert all(seq in variants for seq in resolved)
    # ... and banning the kept ones bans every spelling: each variant ends with one.
    for v in variants:
        assert any(v[len(v) - len(seq):] == seq for seq in resolved)
    # Copies made with dataclasses.replace (the engine does this) keep them.
    assert dataclasses.replace(p, seed=3).bad_words_token_ids == resolved
    assert SamplingParams().bad_words_token_ids == []
