"""/v1/embeddings and /v1/responses through the gateway to real replicas:
the openai client's answers equal a replica's, prefix routing keeps a shared
prefix on one replica, deterministic requests come back from the cache, and
a Responses stream passes event by event."""
from __future__ import annotations

import httpx
import pytest

from octavo.gateway.app import _token_ids
from octavo.tokenizer import Tokenizer
from tests.gateway.conftest import GatewayProcess
from tests.model_factory import make_sentence_transformers_model
from tests.server.conftest import ServerProcess, stop_all, wait_all_healthy

# Longer than one prefix chunk (256 bytes), so requests sharing it share a routing hash.
SHARED = "You answer in one short sentence about the weather in the mountains. " * 5


@pytest.fixture(scope="module")
def embed_replicas(tmp_path_factory):
    folder = make_sentence_transformers_model(tmp_path_factory.mktemp("emb-model"), "mean", arch="qwen3")
    log_dir = tmp_path_factory.mktemp("emb-logs")
    procs = wait_all_healthy([ServerProcess(folder, log_dir / f"emb{i}.log", "--num-blocks", "128",
                                            "--served-model-name", "emb", "--max-model-len", "256", api_key=None,
                                            wait=False) for i in range(2)])
    yield procs
    stop_all(procs)


def _gateway(tmp_path_factory, replicas) -> GatewayProcess:
    args = [a for r in replicas for a in ("--replica", r.url)]
    return GatewayProcess(tmp_path_factory.mktemp("gw") / "gw.log", *args, "--routing", "prefix")


@pytest.fixture(scope="module")
def embed_gateway(embed_replicas, tmp_path_factory):
    gw = _gateway(tmp_path_factory, embed_replicas)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def chat_gateway(replicas, tmp_path_factory):
    gw = _gateway(tmp_path_factory, replicas[:2])
    yield gw
    gw.stop()


def test_embeddings_equal_a_replica_and_are_cached(embed_gateway, embed_replicas):
    texts = ["Hello, world!", "The quick brown fox."]
    direct = embed_replicas[0].openai().embeddings.create(model="emb", input=texts)
    first = embed_gateway.openai().embeddings.with_raw_response.create(model="emb", input=texts)
    assert "x-octavo-cache" not in first.headers
    got = first.parse()
    for mine, theirs in zip(got.data, direct.data, strict=True):
        assert mine.embedding == pytest.approx(theirs.embedding, abs=1e-5)
    # No temperature or seed: an embedding is deterministic all the same.
    again = embed_gateway.openai().embeddings.with_raw_response.create(model="emb", input=texts)
    assert again.headers["x-octavo-cache"] == "hit"
    assert [d.embedding for d in again.parse().data] == [d.embedding for d in got.data]


def test_embeddings_with_a_shared_prefix_go_to_one_replica(embed_gateway):
    client = embed_gateway.openai().with_options(default_headers={"Cache-Control": "no-cache"})
    served = {client.embeddings.with_raw_response.create(model="emb", input=SHARED + tail).headers["x-octavo-replica"]
              for tail in ("a", "b", "c", "d")}
    assert len(served) == 1


def test_bad_embedding_input_is_a_400_from_the_gateway(embed_gateway):
    r = httpx.post(f"{embed_gateway.url}/v1/embeddings", json={"model": "emb", "input": {"a": 1}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "x-octavo-replica" not in r.headers  # answered by the gateway's own validation


def test_responses_equal_a_replica_and_are_cached(chat_gateway, replicas):
    kwargs = dict(model="tiny", instructions="Be brief.", input="Say hi", max_output_tokens=6, temperature=0)
    direct = replicas[0].openai().responses.create(**kwargs)
    first = chat_gateway.openai().responses.with_raw_response.create(**kwargs)
    assert "x-octavo-cache" not in first.headers
    assert first.parse().output_text == direct.output_text
    again = chat_gateway.openai().responses.with_raw_response.create(**kwargs)
    assert again.headers["x-octavo-cache"] == "hit"
    assert again.parse().output_text == direct.output_text
    # Sampled: never from the cache.
    sampled = chat_gateway.openai().responses.with_raw_response.create(**{**kwargs, "temperature": 1.0})
    assert "x-octavo-cache" not in sampled.headers


def _events(client, **kwargs) -> list:
    with client.responses.create(stream=True, **kwargs) as stream:
        return list(stream)


def _kinds(events: list) -> list[str]:
    kinds = [e.type for e in events]
    return [k for i, k in enumerate(kinds) if not (k == "response.output_text.delta" and kinds[i - 1] == k)]


def test_streamed_responses_pass_event_by_event_and_replay_from_the_cache(chat_gateway, replicas):
    kwargs = dict(model="tiny", input="Stream me", max_output_tokens=6, temperature=0)
    direct = _events(replicas[0].openai(), **kwargs)
    through = _events(chat_gateway.openai(), **kwargs)
    # How the text splits into deltas follows the replica's steps; the events around them do not.
    assert _kinds(through) == _kinds(direct)
    assert [e.sequence_number for e in through] == list(range(len(through)))
    assert through[-1].type in ("response.completed", "response.incomplete")
    assert through[-1].response.output_text == direct[-1].response.output_text
    with httpx.stream("POST", f"{chat_gateway.url}/v1/responses", json={**kwargs, "stream": True}, timeout=60) as r:
        assert r.headers.get("x-octavo-cache") == "hit"
        replayed = [line for line in r.iter_lines() if line.startswith("event: ")]
    assert replayed == [f"event: {e.type}" for e in through]


def test_responses_with_shared_instructions_go_to_one_replica(chat_gateway):
    client = chat_gateway.openai()
    served = {client.responses.with_raw_response.create(model="tiny", instructions=SHARED, input=tail,
                                                         max_output_tokens=2).headers["x-octavo-replica"]
              for tail in ("a", "b", "c", "d")}
    assert len(served) == 1


def test_kv_aware_ids_of_a_responses_request_are_the_replicas(model_path, replicas):
    """The gateway's token ids for a Responses request (instructions, a
    developer turn, text parts) are as many as the replica counts for it."""
    body = {"model": "tiny", "instructions": "Be brief.", "max_output_tokens": 1,
            "input": [{"role": "developer", "content": "Use plain words."},
                      {"role": "user", "content": [{"type": "input_text", "text": "one"},
                                                   {"type": "input_text", "text": "two"}]}]}
    ids = _token_ids(Tokenizer(str(model_path)), body, "/v1/responses")
    usage = httpx.post(f"{replicas[0].url}/v1/responses", json=body, timeout=60).json()["usage"]
    assert len(ids) == usage["input_tokens"] > 0
