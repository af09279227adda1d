"""/v1/embeddings against a real `octavo serve` of a sentence-transformers
style folder, through the openai client and langchain-openai."""
from __future__ import annotations

import httpx
import pytest
import torch

from tests.model_factory import hf_embeddings, make_sentence_transformers_model
from tests.server.conftest import ServerProcess

TEXTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n" * 4]


@pytest.fixture(scope="module")
def embed_folder(tmp_path_factory):
    # Mean pooling, normalized, trained for 16 and 32 of its 64 dimensions.
    return make_sentence_transformers_model(tmp_path_factory.mktemp("emb-model"), "mean", arch="qwen3",
                                            matryoshka_dimensions=[16, 32])


@pytest.fixture(scope="module")
def embed_server(embed_folder, tmp_path_factory):
    srv = ServerProcess(embed_folder, tmp_path_factory.mktemp("logs") / "embed.log", "--num-blocks", "128",
                        "--max-num-batched-tokens", "32", "--served-model-name", "emb", "--max-model-len", "256")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(embed_folder):
    from octavo.tokenizer import Tokenizer

    tokenizer = Tokenizer(str(embed_folder))
    ids = [tokenizer.encode(t) for t in TEXTS]
    return ids, hf_embeddings(embed_folder, ids, "mean", True)


def _close(vectors, expected) -> bool:
    return max((torch.tensor(v) - torch.tensor(e)).abs().max().item() for v, e in zip(vectors, expected)) < 1e-4


def test_openai_client_float_and_base64(embed_server, reference):
    ids, expected = reference
    client = embed_server.openai()
    as_float = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64 by default
    for r in (as_float, as_base64):
        assert [d.index for d in r.data] == [0, 1, 2] and r.model == "emb"
        assert _close([d.embedding for d in r.data], expected)
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model="emb", input=ids, encoding_format="float")
    # Close, not equal: a repeat hits the prefix cache, so its last token is computed in a smaller batch.
    assert _close([d.embedding for d in by_ids.data], [d.embedding for d in as_float.data])
    one = client.embeddings.create(model="emb", input=ids[1], encoding_format="float")
    assert _close([one.data[0].embedding], [as_float.data[1].embedding])
    embed_server.wait_idle()  # every KV block back in the pool


def test_matryoshka_dimensions(embed_server, reference):
    _, expected = reference
    r = embed_server.openai().embeddings.create(model="emb", input=TEXTS[0], dimensions=16, encoding_format="float")
    # The model normalizes, so the first 16 values are normalized again.
    cut = torch.nn.functional.normalize(torch.tensor(expected[0][:16]), dim=-1)
    assert len(r.data[0].embedding) == 16 and _close([r.data[0].embedding], [cut.tolist()])


def test_langchain_openai_embeddings(embed_server, reference):
    from langchain_openai import OpenAIEmbeddings

    _, expected = reference
    emb = OpenAIEmbeddings(model="emb", base_url=f"{embed_server.url}/v1", api_key=embed_server.api_key,
                           check_embedding_ctx_length=False, max_retries=0)
    assert _close(emb.embed_documents(TEXTS), expected)
    assert _close([emb.embed_query(TEXTS[1])], [expected[1]])


@pytest.mark.parametrize("body,param,words", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": [[]]}, "input", "empty"),
    ({"input": [5, 100000]}, "input", "vocabulary"),
    ({"input": "word " * 400}, "input", "maximum context length"),
    ({"input": "x", "dimensions": 20}, "dimensions", "one of 16, 32"),
    ({"input": "x", "dimensions": 0}, "dimensions", "positive"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
])
def test_bad_requests_name_the_field(embed_server, body, param, words):
    with embed_server.http() as http:
        r = http.post("/v1/embeddings", json={"model": "emb", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_one_task_per_server(embed_server, server):
    with embed_server.http() as http:
        chat = http.post("/v1/chat/completions", json={"model": "emb", "messages": [{"role": "user", "content": "hi"}]})
        completion = http.post("/v1/completions", json={"model": "emb", "prompt": "hi"})
    for r in (chat, completion):
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert "embedding model" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "tiny", "input": "hi"}, headers=server.headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "serves no embeddings" in r.json()["error"]["message"]
