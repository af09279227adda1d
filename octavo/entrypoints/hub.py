"""Hugging Face hub ids (``org/name``) as model paths.

A local folder or GGUF file of that name always wins. Otherwise the id is
looked up in the local Hugging Face cache (``HF_HUB_CACHE``, else
``HF_HOME``/hub, else ~/.cache/huggingface/hub: the snapshot its
``refs/main`` points to) with no network access, and, when that fails and
``HF_HUB_OFFLINE`` is not set, downloaded into the cache with
``huggingface_hub``. The environment is read at each call (not when
huggingface_hub is imported), so a process that sets HF_HOME late is honoured.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

# org/name as the hub spells repository ids (one optional owner, no path beyond).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# What a model needs; *.bin only where a repository has no safetensors (see ``_download``).
_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]
_TRUE = ("1", "on", "yes", "true")


def looks_like_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and not model.endswith((".gguf", ".json"))


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def resolve_hub_model(model_id: str) -> str:
    """The local snapshot folder of hub id ``model_id``; ValueError in one
    line naming the id and the cache searched when it is neither cached nor
    downloadable."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # a declared dependency; only a broken install lacks it
        raise ValueError(f"model {model_id!r} is not a local path, and huggingface_hub is not installed "
                         "to look it up") from None
    cache = hub_cache_dir()
    try:
        return snapshot_download(model_id, cache_dir=cache, local_files_only=True)
    except Exception as exc:  # not cached (or a broken ref): try the network below
        cached_error = exc
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        raise ValueError(f"model {model_id!r} is not a local path and not in the Hugging Face cache {cache} "
                         f"(HF_HUB_OFFLINE is set, so it was not downloaded; {type(cached_error).__name__})")
    try:
        return _download(snapshot_download, model_id, cache)
    except Exception as exc:  # no network, no such repository, gated: all one line for the user
        raise ValueError(f"model {model_id!r} is not a local path, not in the Hugging Face cache {cache}, "
                         f"and could not be downloaded: {_one_line(exc)}") from None


def _download(snapshot_download, model_id: str, cache: Path) -> str:  # noqa: ANN001 (huggingface_hub's function)
    folder = snapshot_download(model_id, cache_dir=cache, allow_patterns=_PATTERNS)
    if not any(Path(folder).glob("*.safetensors")):
        folder = snapshot_download(model_id, cache_dir=cache, allow_patterns=_PATTERNS + ["pytorch_model*.bin"])
    return folder


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
