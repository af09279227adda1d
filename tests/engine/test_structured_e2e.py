"""Structured output through LLM.generate: with a random model only the
grammar makes the text valid, so validity proves the grammar is in charge,
also for parallel samples and across preemption."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from octavo import LLM, SamplingParams
from octavo.sampling_params import StructuredOutputParams
from tests.engine.conftest import assert_no_leak

BLOCKS = 64  # 1024 tokens: ample here, and quick to allocate
MAX_TOKENS = 200  # far more than any of these grammars needs
PROMPTS = ["Hello, world!", "The quick brown fox", "Once upon a time"]
SCHEMA = {
    "type": "object",
    "properties": {
        # Bounded, because a random model never closes a string by itself.
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-\d{2}"
CHOICES = ["yes", "no", "maybe so"]


def structured(spec: StructuredOutputParams, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=spec, **kw)


def workload(llm: LLM) -> tuple[list[str], list[SamplingParams], list[str]]:
    """Every kind of grammar, greedy and seeded; returns prompts, params and
    each request's kind."""
    tok = llm.get_tokenizer()
    # Free JSON has no length limit; favouring the closing characters lets the
    # random model finish, while the grammar alone still decides validity.
    (quote,), (brace,) = tok.encode('"', add_special_tokens=False), tok.encode("}", add_special_tokens=False)
    closing = {quote: 5.0, brace: 5.0}
    kinds = {
        "schema": StructuredOutputParams(json_schema=SCHEMA),
        "object": StructuredOutputParams(json_object=True),
        "regex": StructuredOutputParams(regex=REGEX),
        "choice": StructuredOutputParams(choice=CHOICES),
    }
    prompts, params, names = [], [], []
    for name, spec in kinds.items():
        bias = closing if name == "object" else None
        for i, prompt in enumerate(PROMPTS):
            greedy = i == 0
            kw = dict(temperature=0.0) if greedy else dict(temperature=1.0, seed=50 + i)
            if name == "choice" and not greedy:
                kw["n"] = 3  # each parallel sample advances its own matcher
            prompts.append(prompt)
            params.append(structured(spec, logit_bias=bias, **kw))
            names.append(name)
    return prompts, params, names


def assert_valid(kind: str, text: str) -> None:
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES


def test_grammars_force_valid_outputs_also_when_preempted(folder):
    llm = LLM(folder, dtype="float32", num_blocks=BLOCKS)
    prompts, params, kinds = workload(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for kind, p, out in zip(kinds, params, outs):
        assert len(out.outputs) == p.n
        for seq in out.outputs:
            assert seq.finish_reason == "stop", (kind, seq.text)
            assert_valid(kind, seq.text)
    assert_no_leak(llm)

    # A pool this small evicts requests mid-output; their matchers must
    # carry on from where they were, giving the very same texts.
    tight = LLM(folder, dtype="float32", num_blocks=4, max_num_batched_tokens=32)
    again = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.get_stats().num_preemptions > 0
    assert [[s.text for s in o.outputs] for o in again] == [[s.text for s in o.outputs] for o in outs]
    assert_no_leak(tight)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputParams(json_schema={"type": "object", "properties": {"a": {"type": "wibble"}}}),
        StructuredOutputParams(regex="([a-z]"),
    ],
)
def test_invalid_grammar_is_value_error_and_the_engine_keeps_serving(folder, spec):
    llm = LLM(folder, dtype="float32", num_blocks=BLOCKS)
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=4), structured(spec)], use_tqdm=False)
    assert_no_leak(llm)
    params = structured(StructuredOutputParams(choice=CHOICES), temperature=0.0)
    assert llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].text in CHOICES
    assert_no_leak(llm)
