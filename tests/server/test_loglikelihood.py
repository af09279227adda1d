"""lm-eval's loglikelihood requests (local-completions: echo + logprobs=1 + max_tokens=1, scored as
``token_logprobs[ctxlen:-1]``), sent as token ids and as text, against transformers' own scores."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from tests.model_factory import BOS_ID, load_hf_model

CONTEXT, CONTINUATION = "The quick brown", " fox jumps over"


@pytest.fixture(scope="module")
def reference(model_path):
    """(context ids, continuation ids, transformers' log-probability of each continuation token), with BOS first."""
    tok = AutoTokenizer.from_pretrained(model_path)
    ctx = [BOS_ID] + tok(CONTEXT, add_special_tokens=False).input_ids
    cont = tok(CONTINUATION, add_special_tokens=False).input_ids
    model = load_hf_model(model_path)
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    scores = [logprobs[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont)]
    return tok, ctx, cont, scores


def _score(server, prompt, ctxlen: int, **extra) -> list[float]:
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True, **extra}
    with server.http() as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["token_logprobs"][ctxlen:-1]


def test_tokenized_and_text_requests_score_like_transformers(server, reference):
    tok, ctx, cont, scores = reference
    by_ids = _score(server, ctx + cont, len(ctx))
    # tokenized_requests=false: lm-eval decodes its ids (BOS included, with add_bos_token) to text;
    # the server must not put a second BOS in front of it.
    by_text = _score(server, tok.decode(ctx + cont), len(ctx))
    assert by_ids == pytest.approx(scores, abs=1e-4)
    assert by_text == pytest.approx(scores, abs=1e-4)


def test_add_special_tokens_false_scores_the_text_alone(server, reference, model_path):
    tok, ctx, cont, _ = reference
    plain_ctx = ctx[1:]  # lm-eval's default: no BOS
    model = load_hf_model(model_path)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([plain_ctx + cont])).logits[0].float(), dim=-1)
    scores = [logprobs[len(plain_ctx) - 1 + i, t].item() for i, t in enumerate(cont)]
    text = CONTEXT + CONTINUATION
    assert _score(server, text, len(plain_ctx), add_special_tokens=False) == pytest.approx(scores, abs=1e-4)
    assert _score(server, plain_ctx + cont, len(plain_ctx)) == pytest.approx(scores, abs=1e-4)
    # The default (vLLM's) adds the tokenizer's BOS to a text prompt.
    with server.http() as http:
        usage = [http.post("/v1/completions", json={"prompt": text, "max_tokens": 1, **kw}).json()["usage"]
                 for kw in ({}, {"add_special_tokens": False})]
    assert usage[0]["prompt_tokens"] == usage[1]["prompt_tokens"] + 1 == len(plain_ctx + cont) + 1
