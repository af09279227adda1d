"""Through the server: after a stop string, logprobs (tokens, text_offset, top_logprobs) and
usage.completion_tokens describe exactly the returned text, streamed or not."""
from __future__ import annotations

import pytest

from octavo import SamplingParams

MODEL, PROMPT = "tiny", "The quick brown fox"


@pytest.fixture(scope="module")
def stop(offline_llm):
    """A stop string that starts inside a token of the greedy continuation, and the text before it."""
    out = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    text = out[0].outputs[0].text
    tok = offline_llm.get_tokenizer()
    ids = out[0].outputs[0].token_ids
    for i in range(len(ids)):
        piece = tok.decode(ids[i:i + 1])
        if len(piece) >= 3 and text.count(piece[1:3]) == 1:
            return piece[1:3], text[: text.index(piece[1:3])]
    raise AssertionError(text)


def _check_legacy(text: str, tokens: list[str], offsets: list[int], top: list[dict], n: int) -> None:
    assert len(tokens) == len(offsets) == len(top) == n
    joined = "".join(tokens)
    # The last token may reach past the cut (its text is partly returned); none beyond it is listed.
    assert joined.startswith(text) and len("".join(tokens[:-1])) < len(text)
    assert offsets == [len("".join(tokens[:i])) for i in range(n)]
    assert all(t in d for t, d in zip(tokens, top))


def test_completions(server, stop):
    stop_str, expected = stop
    client = server.openai()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop_str], logprobs=2,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    c = r.choices[0]
    assert c.text == expected and c.finish_reason == "stop"
    _check_legacy(c.text, c.logprobs.tokens, c.logprobs.text_offset, c.logprobs.top_logprobs, r.usage.completion_tokens)

    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    parts = [ch.choices[0] for ch in chunks if ch.choices]
    assert "".join(p.text for p in parts) == expected
    tokens = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
    offsets = [o for p in parts if p.logprobs for o in p.logprobs.text_offset]
    top = [d for p in parts if p.logprobs for d in p.logprobs.top_logprobs]
    assert tokens == c.logprobs.tokens and offsets == c.logprobs.text_offset
    _check_legacy(expected, tokens, offsets, top, chunks[-1].usage.completion_tokens)


def test_chat(server, stop, offline_llm):
    client = server.openai()
    messages = [{"role": "user", "content": "hi"}]
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    content = free.choices[0].message.content
    stop_str = content[5:7]
    kw = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0, stop=[stop_str], logprobs=True,
              top_logprobs=1, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    assert text == content[: content.index(stop_str)]
    tokens = [e.token for e in r.choices[0].logprobs.content]
    assert len(tokens) == r.usage.completion_tokens
    assert "".join(tokens).startswith(text) and len("".join(tokens[:-1])) < len(text)

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = [e.token for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert streamed == tokens and chunks[-1].usage.completion_tokens == len(tokens)
