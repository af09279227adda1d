"""One request's failure stays that request's: a fault in its grammar, its
sampling inputs or its detokenizer ends it with ``RequestOutput.error`` and
frees its blocks, while the requests batched with it finish with the output
they would have had alone, and the engine keeps serving."""
from __future__ import annotations

from typing import Callable

import pytest

from octavo import LLM, SamplingParams
from octavo.engine.llm_engine import LLMEngine
from octavo.outputs import RequestOutput
from octavo.sampling_params import StructuredOutputParams
from tests.engine.conftest import assert_no_leak

GOOD = {f"good{i}": prompt for i, prompt in enumerate(["Hello, world!", "The quick brown fox", "Once upon"])}
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
VICTIM = "victim"


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, dtype="float32", num_blocks=64)


def run(engine: LLMEngine, victim: SamplingParams, sabotage: Callable[[LLMEngine], None]) -> dict[str, RequestOutput]:
    """The good requests plus the victim in one batch; ``sabotage`` breaks the
    victim once it is queued. Returns every final output by request id."""
    for rid, prompt in GOOD.items():
        engine.add_request(rid, prompt, PARAMS)
    engine.add_request(VICTIM, "Some prompt", victim)
    sabotage(engine)
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def reference(llm: LLM) -> dict[str, list[int]]:
    outs = llm.generate(list(GOOD.values()), PARAMS, use_tqdm=False)
    return {rid: out.outputs[0].token_ids for rid, out in zip(GOOD, outs)}


def _raise(*_args: object) -> None:
    raise RuntimeError("injected fault")


def break_grammar_advance(engine: LLMEngine) -> None:
    engine.scheduler.get_request(VICTIM).grammar.accept_tokens = _raise


def break_grammar_mask(engine: LLMEngine) -> None:
    # llguidance's batched mask fill raises on a matcher that is not one.
    engine.scheduler.get_request(VICTIM).grammar.matcher = object()


def break_detokenizer(engine: LLMEngine) -> None:
    detok = engine._requests[VICTIM].sequences[f"{VICTIM}#1"].detokenizer  # one of the three
    calls = iter(range(1_000_000))
    original = detok.update
    # Fails on its fourth update, mid-generation.
    detok.update = lambda ids: _raise() if next(calls) == 3 else original(ids)


REGEX = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputParams(regex=r"[a-z]{30}"))
N3 = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "victim, sabotage, error",
    [
        (REGEX, break_grammar_advance, "injected fault"),
        (REGEX, break_grammar_mask, "structured output failed"),
        (N3, break_detokenizer, "injected fault"),
    ],
    ids=["grammar-advance", "grammar-mask", "detokenizer-of-n3"],
)
def test_a_failing_request_fails_alone(llm, victim, sabotage, error):
    expected = reference(llm)
    final = run(llm.engine, victim, sabotage)
    assert final[VICTIM].finished and error in final[VICTIM].error
    for rid, tokens in expected.items():
        assert final[rid].error is None
        assert final[rid].outputs[0].token_ids == tokens
    assert_no_leak(llm)
    # And it still serves.
    assert reference(llm) == expected
    assert_no_leak(llm)


@pytest.mark.parametrize("depth", [300, 2000])
def test_a_deeply_nested_schema_is_a_value_error(llm, depth):
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputParams(json_schema=deep_schema(depth)))
    with pytest.raises(ValueError, match="too deeply nested"):
        llm.engine.add_request("deep", "Hello", params)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="too deeply nested"):
        llm.generate(["Hello", "World"], [PARAMS, params], use_tqdm=False)
    assert_no_leak(llm)
    assert llm.generate(["Hello"], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_an_unexpected_error_in_add_request_leaves_nothing_queued(llm, monkeypatch):
    """add_request is all or nothing: here the second of three sequences fails
    to queue, after the first was already in the scheduler."""
    sched = llm.engine.scheduler
    original = sched.add_request
    calls = iter(range(100))
    monkeypatch.setattr(sched, "add_request", lambda r: _raise() if next(calls) == 1 else original(r))
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.engine.add_request("forked", "Hello", SamplingParams(n=3, max_tokens=4))
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert_no_leak(llm)
