"""Endpoints and flags users reach for when they switch from vLLM: GET /v1/models/{id}, several
--served-model-name values, --version, CORS, --root-path, TLS."""
from __future__ import annotations

import openai
import pytest

from tests.server.conftest import ServerProcess


@pytest.fixture(scope="module")
def named_server(model_path, tmp_path_factory):
    srv = ServerProcess(model_path, tmp_path_factory.mktemp("logs") / "named.log", "--num-blocks", "64",
                        "--served-model-name", "org/main-name", "alias", api_key=None)
    yield srv
    srv.stop()


def test_retrieve_a_model_and_several_names(named_server):
    client = named_server.openai()
    assert [m.id for m in client.models.list().data] == ["org/main-name", "alias"]
    m = client.models.retrieve("org/main-name")
    assert m.id == "org/main-name" and m.object == "model" and m.owned_by == "octavo"
    assert client.models.retrieve("alias").id == "alias"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("other")
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    # Requests may name the model by any of its names; responses carry the first.
    for name in ("org/main-name", "alias"):
        r = client.completions.create(model=name, prompt="Hi", max_tokens=1)
        assert r.model == "org/main-name"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=1)
