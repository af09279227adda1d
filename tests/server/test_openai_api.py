"""The OpenAI API through the official `openai` client, against the real server."""
from __future__ import annotations

import json
import math

import jsonschema
import pytest

from octavo import SamplingParams

MODEL = "tiny"
PROMPT = "The quick brown fox"


def _greedy(llm, prompt, max_tokens: int, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw), use_tqdm=False)[0]


def test_completion_matches_offline_llm(server, offline_llm):
    client = server.openai()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = _greedy(offline_llm, PROMPT, 12)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_token_prompts_and_batches(server, offline_llm):
    client = server.openai()
    ids = offline_llm.get_tokenizer().encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=[ids, "Hello, world"], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    refs = [_greedy(offline_llm, ids, 6), _greedy(offline_llm, "Hello, world", 6)]
    assert [c.text for c in r.choices] == [refs[0].outputs[0].text] * 2 + [refs[1].outputs[0].text] * 2
    assert r.usage.prompt_tokens == len(ids) + len(refs[1].prompt_token_ids)


def test_completion_stream_with_usage(server, offline_llm):
    client = server.openai()
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ref = _greedy(offline_llm, PROMPT, 10)
    assert text == ref.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == ref.outputs[0].finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_completion_logprobs_and_echo(server, offline_llm):
    client = server.openai()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, echo=True)
    ref = offline_llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=3), use_tqdm=False
    )[0]
    choice = r.choices[0]
    lp = choice.logprobs
    n_prompt = len(ref.prompt_token_ids)
    assert choice.text == PROMPT + ref.outputs[0].text
    assert len(lp.tokens) == n_prompt + 5 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref_prompt = [e.logprob for e in ref.prompt_logprobs[1:]]
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(ref_prompt, abs=1e-4)
    gen = [e.logprob for e in ref.outputs[0].logprobs]
    assert lp.token_logprobs[n_prompt:] == pytest.approx(gen, abs=1e-4)
    # Greedy: the chosen token is the best alternative; offsets increase along the text.
    for i in range(n_prompt, n_prompt + 5):
        assert 3 <= len(lp.top_logprobs[i]) <= 4
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)
    # Offsets index the returned text (the skipped BOS takes no room in it).
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n_prompt] == len(PROMPT)


def test_chat_and_stream(server, offline_llm):
    client = server.openai()
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello"}]},
    ]
    ref = offline_llm.chat(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say\nhello"}],
        SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False,
    )[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[0].finish_reason
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_n_and_logprobs(server):
    client = server.openai()
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3, temperature=1.0, seed=7,
        logprobs=True, top_logprobs=2,
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        entries = c.logprobs.content
        assert entries
        for e in entries:
            assert len(e.top_logprobs) == 2 and e.logprob <= 0.0
            assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
            assert e.bytes == list(e.token.encode())
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    # Streaming n > 1: each choice's chunks carry its own index.
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=2, temperature=1.0, stream=True
    )
    finished = {}
    for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert sorted(finished) == [0, 1]


def test_seed_reproducible(server):
    client = server.openai()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_json_schema_response_format(server):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    client = server.openai()
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A person as JSON"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # A random model need not close a free-form object within max_tokens; it must start one.
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON"}], max_tokens=8, temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].message.content.lstrip().startswith("{")
    # The vLLM-style extension, here with a choice constraint.
    r = client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert r.choices[0].text in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"


def test_extensions_are_accepted(server, offline_llm):
    with server.http() as http:
        body = {
            "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "top_k": 5, "min_p": 0.05,
            "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 8, "priority": 1,
            "skip_special_tokens": True, "include_stop_str_in_output": False, "stop_token_ids": [],
            "truncate_prompt_tokens": 3, "add_special_tokens": True,
        }
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    ids = offline_llm.get_tokenizer().encode(PROMPT)[-3:]
    ref = _greedy(offline_llm, ids, 8, top_k=5, min_p=0.05, repetition_penalty=1.1, ignore_eos=True, min_tokens=8)
    assert r.json()["choices"][0]["text"] == ref.outputs[0].text
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}


def test_stop_string(server, offline_llm):
    ref = _greedy(offline_llm, PROMPT, 12, ignore_eos=True).outputs[0].text
    stop = ref[3:5]
    assert stop.strip()
    r = server.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == ref[: ref.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_models_tokenize_detokenize_version(server, offline_llm):
    with server.http() as http:
        models = http.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == MODEL
        assert models["data"][0]["max_model_len"] == offline_llm.engine.max_model_len
        tok = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tok["tokens"] == offline_llm.get_tokenizer().encode(PROMPT) and tok["count"] == len(tok["tokens"])
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        ref = offline_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert chat["tokens"] == ref.prompt_token_ids
        assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith(PROMPT)
        assert http.get("/version").json()["version"]
    assert math.isfinite(server.metrics()["octavo:kv_total_blocks"])
