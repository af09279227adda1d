"""Hugging Face hub ids: resolved from a real cache layout (HF_HOME, refs,
snapshots) with no network, served under the id; a local path of the same
name wins; an id in no cache, offline, is one error naming it and the cache."""
from __future__ import annotations

import shutil

import httpx
import pytest

from octavo import LLM, SamplingParams
from octavo.entrypoints.engine_args import engine_config
from tests.checkpoint.conftest import PROMPT
from tests.model_factory import make_tiny_model
from tests.server.conftest import ServerProcess

REVISION = "0123456789abcdef0123456789abcdef01234567"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _write_cache(hf_home, repo_id: str, folder) -> None:
    """The layout huggingface_hub writes: blobs, a snapshot of links to them, refs/main naming the snapshot."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in folder.iterdir():
        blob = repo / "blobs" / f"blob-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-models")
    return make_tiny_model(root, "llama"), make_tiny_model(root, "qwen3")


@pytest.fixture()
def hf_home(tmp_path, monkeypatch, models):
    home = tmp_path / "hf"
    _write_cache(home, "octavo-test/tiny-llama", models[0])
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_hub_id_loads_from_the_cache_under_its_id(hf_home, models):
    config = engine_config("octavo-test/tiny-llama")
    assert config.model.model.endswith(f"snapshots/{REVISION}")
    llm = LLM("octavo-test/tiny-llama", dtype="float32")
    assert llm.engine.model_name == "octavo-test/tiny-llama"
    want = LLM(models[0], dtype="float32").generate([PROMPT], GREEDY, use_tqdm=False)
    got = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_hf_hub_cache_overrides_hf_home(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hf_home.parent / "elsewhere"))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    assert engine_config("octavo-test/tiny-llama").model.model.endswith(REVISION)


def test_a_local_folder_of_the_same_name_wins(hf_home, models, tmp_path, monkeypatch):
    local = tmp_path / "work" / "octavo-test" / "tiny-llama"
    shutil.copytree(models[1], local)  # a different model (qwen3) under the id's name
    monkeypatch.chdir(tmp_path / "work")
    config = engine_config("octavo-test/tiny-llama")
    assert config.model.model == "octavo-test/tiny-llama"
    assert config.model.served_model_name is None


def test_missing_id_offline_names_the_id_and_the_cache(hf_home):
    with pytest.raises(ValueError, match=r"'octavo-test/absent' is not a local path and not in the Hugging Face "
                                         rf"cache {hf_home / 'hub'} \(HF_HUB_OFFLINE is set"):
        LLM("octavo-test/absent")


def test_unreachable_hub_is_one_line_naming_the_id(hf_home, monkeypatch):
    """Online but no hub to reach (an endpoint nothing listens on): one line, the id and the cache."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match=r"'octavo-test/absent' is not a local path, not in the Hugging Face "
                                         r"cache .*and could not be downloaded") as err:
        engine_config("octavo-test/absent")
    assert "\n" not in str(err.value)


def test_serve_a_hub_id(hf_home, tmp_path):
    """`octavo serve org/name` end to end (~20 s: the CLI's own resolution in a real server process)."""
    srv = ServerProcess("octavo-test/tiny-llama", tmp_path / "server.log", api_key=None)
    try:
        models = httpx.get(f"{srv.url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["octavo-test/tiny-llama"]
        body = {"model": "octavo-test/tiny-llama", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        srv.stop()
