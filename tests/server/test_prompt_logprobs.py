"""prompt_logprobs come back where vLLM puts them: on each completions choice, beside the chat choices."""
from __future__ import annotations

import openai
import pytest

from octavo import SamplingParams

MODEL, PROMPT = "tiny", "The quick brown fox jumps"


def _check(body, prompt_ids, reference, num_top: int) -> None:
    assert len(body) == len(prompt_ids) and body[0] is None
    for token_id, position, ref in zip(prompt_ids[1:], body[1:], reference[1:]):
        entry = position[str(token_id)]  # JSON object keys are strings
        assert entry["logprob"] == pytest.approx(ref.logprob, abs=1e-4) and entry["rank"] == ref.rank
        assert isinstance(entry["decoded_token"], str)
        # The top alternatives, ranked, besides the prompt's own token.
        tops = sorted((v["rank"], int(k)) for k, v in position.items() if v["rank"] <= num_top)
        assert tops == [(rank, t) for rank, (t, _) in enumerate(ref.top[:num_top], start=1)]
        assert len(position) == num_top + (ref.rank > num_top)


def test_completions_choices_carry_prompt_logprobs(server, offline_llm):
    ref = offline_llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "n": 2,
                                               "temperature": 0.5, "seed": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    _check(choices[0]["prompt_logprobs"], ref.prompt_token_ids, ref.prompt_logprobs, 2)
    # Not asked for: not there.
    r = server.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert r.choices[0].model_extra.get("prompt_logprobs") is None


def test_chat_response_carries_prompt_logprobs(server, offline_llm):
    messages = [{"role": "user", "content": "hi there"}]
    ref = offline_llm.chat(messages, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    r = server.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                extra_body={"prompt_logprobs": 0})
    _check(r.model_extra["prompt_logprobs"], ref.prompt_token_ids, ref.prompt_logprobs, 0)


def test_prompt_logprobs_cannot_stream(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})
    assert exc.value.body["param"] == "prompt_logprobs"


def test_one_token_prompt_has_one_empty_entry(server):
    # Nothing scores the first prompt token: one entry, null, as vLLM answers.
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_logprobs"] == [None]
