"""RequestOutputKind.DELTA: each step's output holds only what is new, so the
output of a long generation costs linear time; folded together, the deltas
are exactly the final output (text, logprobs, n, best_of, stop strings, abort)."""
from __future__ import annotations

import dataclasses

import pytest

from octavo import LLM, SamplingParams
from octavo.outputs import OutputAccumulator, RequestOutput
from tests.engine.conftest import assert_no_leak, random_prompts


@pytest.fixture(scope="module")
def llm(folder):
    # Chunked prefills; no prefix cache, so that a second run batches exactly as the first.
    return LLM(folder, dtype="float32", num_blocks=256, max_num_batched_tokens=32, enable_prefix_caching=False)


def _run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    engine = llm.engine
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    seen: dict[str, list[RequestOutput]] = {r: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


def _fold(prompt: list[int], deltas: list[RequestOutput]) -> RequestOutput:
    acc = OutputAccumulator(prompt)
    for d in deltas:
        acc.add(d)
    return acc.take()


_CASES = {
    "n2-logprobs": SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20, logprobs=2, prompt_logprobs=1,
                                  ignore_eos=True),
    "stop-string": SamplingParams(temperature=0.0, max_tokens=30, stop=["e", "a"], ignore_eos=True),
    "best-of": SamplingParams(n=1, best_of=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
    "n3-eos": SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=40),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_deltas_fold_into_the_final_output(llm, case):
    base = _CASES[case]
    prompts = random_prompts([5, 40, 70], seed=4)  # 40 and 70: prefills over several steps
    # One run per kind: the same batches, so the same logprobs to the last bit.
    delta = _run(llm, {f"d{i}": (p, dataclasses.replace(base, output_kind="delta")) for i, p in enumerate(prompts)})
    final = _run(llm, {f"f{i}": (p, dataclasses.replace(base, output_kind="final_only")) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        (whole,) = final[f"f{i}"]
        deltas = delta[f"d{i}"]
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        folded = _fold(p, deltas)
        assert folded.outputs == whole.outputs, case
        assert folded.prompt_logprobs == whole.prompt_logprobs
        assert [c.index for c in folded.outputs] == list(range(base.n))
    assert_no_leak(llm)


def test_each_step_carries_only_its_new_tokens(llm):
    """The linear-cost property itself: over a long generation the engine's
    outputs for a request hold each token, logprob and character once (a
    cumulative output would hold 1 + 2 + ... + N tokens), and every decode
    step's output holds that step's one token."""
    num_tokens = 400
    prompt = random_prompts([3], seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=1)
    deltas = _run(llm, {"long": (prompt, dataclasses.replace(params, output_kind="delta"))})["long"]
    (final,) = _run(llm, {"whole": (prompt, dataclasses.replace(params, output_kind="final_only"))})["whole"]
    assert len(deltas) == num_tokens  # one output per step, one token each
    assert all(len(d.outputs) == 1 and len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert sum(len(d.outputs[0].logprobs) for d in deltas) == num_tokens
    assert "".join(d.outputs[0].text for d in deltas) == final.outputs[0].text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == final.outputs[0].token_ids


def test_an_aborted_delta_request_ends_with_only_its_new_part(llm):
    engine = llm.engine
    prompt = [9, 10, 11]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, output_kind="delta")
    engine.add_request("abort-delta", prompt, params)
    deltas = []
    for _ in range(6):
        deltas += engine.step()
    engine.abort_request(["abort-delta"])
    (last,) = engine.step()
    assert last.finished and last.outputs[0].finish_reason == "abort"
    folded = _fold(prompt, deltas + [last])
    tokens = folded.outputs[0].token_ids
    assert len(tokens) == 6  # nothing sent twice
    assert folded.outputs[0].text == llm.get_tokenizer().decode(tokens)
    assert_no_leak(llm)


def test_llm_stream_folds_into_generate_and_closing_it_aborts(llm):
    """``LLM.stream``: deltas as produced, which fold into exactly what
    ``generate`` returns; leaving the loop early frees every KV block."""
    prompts = random_prompts([5, 17, 40], seed=11)
    params = SamplingParams(temperature=0, max_tokens=12)
    deltas: dict[int, list[RequestOutput]] = {i: [] for i in range(3)}
    for i, out in llm.stream(prompts, params):
        deltas[i].append(out)
    assert all(len(d) > 1 for d in deltas.values())  # several pieces each, not one final output
    finals = llm.generate(prompts, params, use_tqdm=False)
    for i, final in enumerate(finals):
        folded = _fold(prompts[i], deltas[i])
        assert folded.outputs[0].text == final.outputs[0].text
        assert folded.outputs[0].token_ids == final.outputs[0].token_ids
    stream = llm.stream(prompts, params)
    next(stream)
    stream.close()
    assert_no_leak(llm)
