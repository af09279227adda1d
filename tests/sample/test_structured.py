"""Structured output through the sampler, with random logits: whatever the
model prefers, the text must parse and match its constraint."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from octavo.sample.metadata import SamplingMetadata
from octavo.sample.sampler import Sampler, process_logits
from octavo.sample.llguidance_backend import LLGuidanceBackend
from octavo.sample.structured import GrammarBatch, grammar_bitmask
from octavo.sampling_params import SamplingParams, StructuredOutputParams
from sample.batch import make_request
from sample.utf8_tokenizer import EOS_ID, load_utf8_tokenizer

MODEL_VOCAB = 448  # padded past the tokenizer's 420, as many checkpoints are
MAX_TOKENS = 50
CLOSE_AFTER = 25

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["fast", "small"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{2,4}-[a-z]{1,5}"
CHOICES = ["yes", "no", "maybe so", "中文 ok", 'say "hi"']


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_utf8_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def backend(tokenizer):
    return LLGuidanceBackend(tokenizer, MODEL_VOCAB)


def closing_bias(tokenizer) -> torch.Tensor:
    """Late in a run, prefer EOS, then tokens that close strings, objects and
    arrays: random text under a JSON grammar then always finishes."""
    bias = torch.zeros(MODEL_VOCAB)
    for strength, text in [(40.0, None), (30.0, '"'), (20.0, "}"), (10.0, "]")]:
        ids = [EOS_ID] if text is None else tokenizer.encode(text, add_special_tokens=False)
        bias[ids] = strength
    return bias


def generate(backend, tokenizer, spec: StructuredOutputParams, seed: int, batch_mates: int = 1, **params):
    """Sample up to MAX_TOKENS for a grammar request batched with plain ones;
    returns (text, finished_with_eos)."""
    torch.manual_seed(seed)
    req = make_request(
        SamplingParams(structured_outputs=spec, **params),
        eos_token_id=EOS_ID,
        grammar=backend.compile(spec),
        request_id="g",
    )
    mates = [make_request(SamplingParams(temperature=1.0), request_id=f"m{i}") for i in range(batch_mates)]
    bias = closing_bias(tokenizer)
    for step in range(MAX_TOKENS):
        logits = torch.randn(1 + batch_mates, MODEL_VOCAB) * 3
        if step >= CLOSE_AFTER:
            logits[0] += bias
        batch = [req] + mates
        # As the engine does: the mask is packed where the matcher lives, the
        # sampler reads it, and the matcher advances with the sampled token.
        shipped = grammar_bitmask(backend, [req.request_id], [req.grammar], MODEL_VOCAB)
        meta = SamplingMetadata.from_requests(batch, [None] * len(batch), MODEL_VOCAB, grammar=shipped)
        tokens = Sampler()(logits, meta).token_ids.tolist()
        req.grammar.accept_tokens([tokens[0]])
        for r, t in zip(batch, tokens):
            r.append_output_token(t)
        if tokens[0] == EOS_ID:
            return tokenizer.decode(req.output_token_ids[:-1]), True
    return tokenizer.decode(req.output_token_ids), False


@pytest.mark.parametrize("seed", range(4))
def test_json_schema(backend, tokenizer, seed):
    text, done = generate(backend, tokenizer, StructuredOutputParams(json_schema=SCHEMA), seed)
    assert done, text
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", range(4))
def test_json_object(backend, tokenizer, seed):
    text, done = generate(backend, tokenizer, StructuredOutputParams(json_object=True), seed)
    assert done, text
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", range(4))
def test_regex(backend, tokenizer, seed):
    text, done = generate(backend, tokenizer, StructuredOutputParams(regex=REGEX), seed)
    assert done and re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("seed", range(3))
def test_choice(backend, tokenizer, seed, temperature):
    spec = StructuredOutputParams(choice=CHOICES)
    text, done = generate(backend, tokenizer, spec, seed, temperature=temperature)
    assert done and text in CHOICES, text


def test_penalties_and_grammar_together(backend, tokenizer):
    spec = StructuredOutputParams(json_schema=SCHEMA)
    text, done = generate(
        backend, tokenizer, spec, seed=7, repetition_penalty=1.5, top_k=20, top_p=0.9,
        max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,  # the grammar wins over min_tokens once it is complete
    )
    assert done
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputParams(json_schema={"type": "foo"}),
        StructuredOutputParams(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
        StructuredOutputParams(json_schema={"type": "string", "format": "no-such-format"}),
        StructuredOutputParams(regex="[a-"),
        StructuredOutputParams(regex="(unclosed"),
    ],
)
def test_invalid_specs_raise_value_error(backend, spec):
    with pytest.raises(ValueError, match="structured_outputs"):
        backend.compile(spec)


def test_grammars_of_one_spec_are_independent_and_reset(backend, tokenizer):
    spec = StructuredOutputParams(choice=["yes", "no"])
    first, second = backend.compile(spec), backend.compile(spec)
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert first.accept_tokens([t])
    assert first.is_terminated() and not second.is_terminated()
    shipped = grammar_bitmask(backend, ["first", "second"], [first, second], MODEL_VOCAB)
    assert shipped.terminated == {"first"}
    allowed = GrammarBatch.from_bitmask(["first", "second"], shipped, MODEL_VOCAB, torch.device("cpu")).allowed
    assert allowed[0].nonzero().flatten().tolist() == [EOS_ID]  # terminated: only EOS
    assert not allowed[1, EOS_ID] and allowed[1].any()
    assert not allowed[:, tokenizer.vocab_size:].any()  # padding ids are never allowed
    first.reset()  # back to the start: as fresh as its sibling
    assert not first.is_terminated()
    again = grammar_bitmask(backend, ["first", "second"], [first, second], MODEL_VOCAB)
    assert again.bitmask[: len(again.bitmask) // 2] == again.bitmask[len(again.bitmask) // 2 :]


def test_rejected_token_terminates_the_matcher(backend, tokenizer):
    matcher = backend.compile(StructuredOutputParams(regex="[0-9]+"))
    assert not matcher.accept_tokens([tokenizer.encode("x", add_special_tokens=False)[0]])
    assert matcher.is_terminated()


def test_only_grammar_rows_are_masked(backend):
    spec = StructuredOutputParams(regex="[0-9]{3}")
    plain = make_request(SamplingParams(), request_id="p")
    constrained = make_request(
        SamplingParams(structured_outputs=spec), grammar=backend.compile(spec), request_id="c"
    )
    logits = torch.randn(3, MODEL_VOCAB)
    batch = [plain, constrained, plain]
    shipped = grammar_bitmask(backend, ["c"], [constrained.grammar], MODEL_VOCAB)
    out = process_logits(logits, SamplingMetadata.from_requests(batch, [None] * 3, MODEL_VOCAB, grammar=shipped))
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    assert 0 < torch.isfinite(out[1]).sum() < MODEL_VOCAB // 4
