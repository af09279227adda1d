"""generation_config.json's ``max_new_tokens`` is the default completion length
of a request that sets none (chat and responses; /v1/completions defaults to 16
as OpenAI's API does, so there a body sends max_tokens null), capped by the rest
of the context; a request's own max_tokens is taken as it is. Real clients
against a server given the file with --generation-config."""
from __future__ import annotations

import json

import pytest

from tests.server.conftest import ServerProcess

DEFAULT_NEW_TOKENS = 5
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def defaults_server(model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": DEFAULT_NEW_TOKENS}))
    srv = ServerProcess(model_path, tmp_path_factory.mktemp("logs") / "defaults.log", "--num-blocks", "64",
                        "--served-model-name", "tiny", "--generation-config", str(folder),
                        "--max-model-len", str(MAX_MODEL_LEN))
    yield srv
    srv.stop()


def test_unset_max_tokens_takes_max_new_tokens_on_every_endpoint(defaults_server):
    client = defaults_server.openai()
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == DEFAULT_NEW_TOKENS and chat.choices[0].finish_reason == "length"
    with defaults_server.http() as http:
        completion = http.post("/v1/completions", json={"model": "tiny", "prompt": "Once upon a time",
                                                        "max_tokens": None, "ignore_eos": True})
    assert completion.json()["usage"]["completion_tokens"] == DEFAULT_NEW_TOKENS
    # The Responses API has no ignore_eos: greedy, the tiny model's text does not end within the default.
    response = client.responses.create(model="tiny", input="hi", temperature=0)
    assert response.usage.output_tokens == DEFAULT_NEW_TOKENS
    assert response.incomplete_details.reason == "max_output_tokens"


def test_a_requested_length_wins_and_the_context_caps_the_default(defaults_server):
    client = defaults_server.openai()
    longer = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=9,
                                       extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 9
    near_the_end = [5] * (MAX_MODEL_LEN - 3)  # room for 3 tokens, fewer than the default
    with defaults_server.http() as http:
        capped = http.post("/v1/completions", json={"model": "tiny", "prompt": near_the_end, "max_tokens": None,
                                                    "ignore_eos": True}).json()
    assert capped["usage"]["completion_tokens"] == 3 and capped["choices"][0]["finish_reason"] == "length"
    defaults_server.wait_idle()
