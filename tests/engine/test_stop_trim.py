"""After a stop string cuts the text, token ids, logprobs and the cumulative logprob describe exactly
the returned text, in whole and in delta outputs (streaming never sends a token a stop later removes)."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from octavo.sampling_params import RequestOutputKind
from tests.engine.conftest import assert_no_leak

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, dtype="float32", num_blocks=128)


@pytest.fixture(scope="module")
def free_run(llm):
    """The unstopped greedy output and each of its tokens' text."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    tok = llm.get_tokenizer()
    pieces = [tok.decode(ids[: i + 1])[len(tok.decode(ids[:i])):] for i in range(len(ids))]
    assert "".join(pieces) == out.outputs[0].text
    return ids, pieces


def _stops(pieces):
    """A stop string that starts on a token boundary and one that starts inside a token."""
    cases = []
    for i in range(4, len(pieces) - 2):
        at = len("".join(pieces[:i]))
        text = "".join(pieces)
        on_boundary = pieces[i][:2]
        if len(on_boundary) == 2 and text.find(on_boundary) == at:
            cases.append(on_boundary)
            break
    for i in range(4, len(pieces) - 2):
        if len(pieces[i]) >= 3:
            inside = pieces[i][1:3]
            at = "".join(pieces).find(inside)
            if at == len("".join(pieces[:i])) + 1:
                cases.append(inside)
                break
    assert len(cases) == 2, pieces
    return cases


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_tokens_and_logprobs_match_the_cut_text(llm, free_run, include, kind):
    ids, pieces = free_run
    tok = llm.get_tokenizer()
    full = "".join(pieces)
    boundaries = {len("".join(pieces[:i])) for i in range(len(pieces) + 1)}
    for stop in _stops(pieces):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], logprobs=2,
                                include_stop_str_in_output=include, output_kind=kind)
        outs = llm.generate([PROMPT], params, use_tqdm=False)
        c = outs[0].outputs[0]
        at = full.index(stop)
        expected = full[: at + len(stop)] if include else full[:at]
        assert c.text == expected and c.finish_reason == "stop" and c.stop_reason == stop
        # The fewest tokens that make the text: all of it, and the last one is needed.
        decoded = tok.decode(c.token_ids)
        assert decoded.startswith(expected) and len(tok.decode(c.token_ids[:-1])) < len(expected)
        # A cut inside a token keeps that token (its text is partly returned).
        assert (decoded == expected) == (len(expected) in boundaries)
        assert c.token_ids == ids[: len(c.token_ids)]
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
        assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs))
    assert_no_leak(llm)


def test_streamed_tokens_never_run_ahead_of_the_text(llm, free_run):
    ids, pieces = free_run
    tok = llm.get_tokenizer()
    for stop in _stops(pieces):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                output_kind=RequestOutputKind.DELTA)
        engine = llm.engine
        engine.add_request("r", PROMPT, params)
        text, tokens = "", []
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    text, tokens = text + c.text, tokens + c.token_ids
                    if not c.finished:
                        # Every token sent so far made text that was sent too.
                        assert text.startswith(tok.decode(tokens))
        assert text == "".join(pieces)[: "".join(pieces).index(stop)]
        assert tokens == ids[: len(tokens)] and len(tok.decode(tokens[:-1])) < len(text)
    assert_no_leak(llm)
