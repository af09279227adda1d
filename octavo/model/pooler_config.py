"""Which task a model folder is served for, and how an embedding model pools
(torch-free; the engine and each worker resolve the same answer).

``--task auto`` serves embeddings for a checkpoint without an LM head
(``Qwen3Model``, ``LlamaModel``: what transformers' ``AutoModel`` saves) and
for a sentence-transformers folder (``modules.json`` with a Pooling module),
which is how embedding models such as Qwen3-Embedding are published even when
their config.json names a ``...ForCausalLM``. The pooling and normalization
default to what the folder's sentence-transformers modules do, else last-token
pooling, normalized (Qwen3-Embedding's recipe)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from octavo.config import ModelConfig
from octavo.model.registry import HEADLESS_ARCHITECTURES
from octavo.pooling import POOLING_TYPES, TASKS, PoolerConfig

_ST = "sentence_transformers.models."
# sentence-transformers' Pooling config key -> our pooling type.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
)


def resolve_pooler(model_config: ModelConfig) -> Optional[PoolerConfig]:
    """The pooler of a model served for embeddings; None when it is served
    for generation. ValueError naming the option or file that does not fit."""
    folder = Path(model_config.model)
    task = model_config.task
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
    if folder.is_file():  # a GGUF file: its metadata describes a generation model
        if task == "embed" or model_config.pooling_type is not None or model_config.normalize is not None:
            raise ValueError(f"task embed (and pooling_type, normalize) needs a checkpoint folder; {folder.name} "
                             "is served for generation")
        return None
    raw = _read_json(folder / "config.json")
    architecture = (raw.get("architectures") or [""])[0]
    st = _sentence_transformers(folder)
    headless = architecture in HEADLESS_ARCHITECTURES
    if task == "auto":
        task = "embed" if headless or st is not None else "generate"
    if task == "generate":
        if headless:
            raise ValueError(f"task generate needs a language-model head, and {architecture} has none "
                             "(an embedding checkpoint): serve it with --task embed")
        if model_config.pooling_type is not None or model_config.normalize is not None:
            raise ValueError("pooling_type and normalize apply to embedding models (--task embed)")
        return None
    st_pooling, st_normalize = st if st is not None else (None, None)
    pooling_type = model_config.pooling_type or st_pooling or "last"
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {pooling_type!r}")
    normalize = model_config.normalize
    if normalize is None:
        normalize = st_normalize if st_normalize is not None else True
    return PoolerConfig(pooling_type, normalize, int(raw["hidden_size"]), _matryoshka(raw))


def _matryoshka(raw: dict[str, Any]) -> Optional[tuple[int, ...]]:
    dims = raw.get("matryoshka_dimensions")
    if dims:
        if not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims):
            raise ValueError(f"config.json: matryoshka_dimensions must be a list of positive integers, got {dims!r}")
        return tuple(sorted(dims))
    return () if raw.get("is_matryoshka") else None


def _sentence_transformers(folder: Path) -> Optional[tuple[str, bool]]:
    """(pooling type, normalize) of a sentence-transformers folder, None for
    another folder. Modules this engine cannot apply are a ValueError: an
    embedding that silently skipped a Dense layer would be wrong, not close."""
    path = folder / "modules.json"
    if not path.is_file():
        return None
    modules = _read_json(path)
    if not isinstance(modules, list):
        raise ValueError(f"{path}: expected a list of modules")
    pooling, normalize = None, False
    for m in modules:
        kind, where = str(m.get("type", "")), str(m.get("path", ""))
        if kind == _ST + "Transformer":
            if where not in ("", "."):
                raise ValueError(f"{path}: the Transformer module must be the folder itself, got path {where!r}")
        elif kind == _ST + "Pooling":
            pooling = _st_pooling(folder / where / "config.json")
        elif kind == _ST + "Normalize":
            normalize = True
        else:
            raise ValueError(f"{path}: module {kind!r} is not supported (supported: Transformer, Pooling, Normalize)")
    if pooling is None:
        raise ValueError(f"{path}: no Pooling module")
    return pooling, normalize


def _st_pooling(path: Path) -> str:
    raw = _read_json(path)
    if raw.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt false is not supported")
    unsupported = [k for k in _ST_UNSUPPORTED_MODES if raw.get(k)]
    chosen = [mode for key, mode in _ST_MODES.items() if raw.get(key)]
    if unsupported or len(chosen) != 1:
        raise ValueError(f"{path}: exactly one of {', '.join(_ST_MODES)} must be true"
                         + (f" ({', '.join(unsupported)} is not supported)" if unsupported else ""))
    return chosen[0]


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"no {path.name} in {path.parent}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
