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

# modules.json names each module by its class's import path: sentence-transformers 5 and earlier
# wrote the ``sentence_transformers.models`` aliases, 6 writes where the classes now live.
_ST_MODULES = {
    "sentence_transformers.models.Transformer": "Transformer",
    "sentence_transformers.base.modules.transformer.Transformer": "Transformer",
    "sentence_transformers.models.Pooling": "Pooling",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling": "Pooling",
    "sentence_transformers.models.Normalize": "Normalize",
    "sentence_transformers.base.modules.normalize.Normalize": "Normalize",
}
# 1_Pooling/config.json: 6 writes one ``pooling_mode`` name, 5 and earlier a boolean key per mode.
_ST_MODES = {
    "lasttoken": "last", "mean": "mean", "cls": "cls",
    "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "weightedmean": "weightedmean",
}
_ST_LEGACY_KEYS = {
    "pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}


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
    st_pooling, st_normalize, chat_prompt = st if st is not None else (None, None, False)
    pooling_type = model_config.pooling_type or st_pooling or "last"
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {pooling_type!r}")
    normalize = model_config.normalize
    if normalize is None:
        normalize = st_normalize if st_normalize is not None else True
    return PoolerConfig(pooling_type, normalize, int(raw["hidden_size"]), _matryoshka(raw), chat_prompt)


def _matryoshka(raw: dict[str, Any]) -> Optional[tuple[int, ...]]:
    dims = raw.get("matryoshka_dimensions")
    if dims:
        if not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims):
            raise ValueError(f"config.json: matryoshka_dimensions must be a list of positive integers, got {dims!r}")
        return tuple(sorted(dims))
    return () if raw.get("is_matryoshka") else None


def _sentence_transformers(folder: Path) -> Optional[tuple[str, bool, bool]]:
    """(pooling type, normalize, texts as chat messages) of a sentence-transformers folder, None for
    another folder. Modules this engine cannot apply are a ValueError: an
    embedding that silently skipped a Dense layer would be wrong, not close."""
    path = folder / "modules.json"
    if not path.is_file():
        return None
    modules = _read_json(path)
    if not isinstance(modules, list):
        raise ValueError(f"{path}: expected a list of modules")
    pooling, normalize, chat_prompt = None, False, False
    for m in modules:
        kind, where = str(m.get("type", "")), str(m.get("path", ""))
        role = _ST_MODULES.get(kind)
        if role == "Transformer":
            if where not in ("", "."):
                raise ValueError(f"{path}: the Transformer module must be the folder itself, got path {where!r}")
            chat_prompt = _st_chat_prompt(folder / "sentence_bert_config.json")
        elif role == "Pooling":
            pooling = _st_pooling(folder / where / "config.json")
        elif role == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{path}: module {kind!r} is not supported (supported: Transformer, Pooling, Normalize)")
    if pooling is None:
        raise ValueError(f"{path}: no Pooling module")
    return pooling, normalize, chat_prompt


def _st_chat_prompt(path: Path) -> bool:
    """Whether sentence-transformers (6 and later) embeds each text as a user message in the chat
    template: it does whenever the Transformer module's ``modality_config`` has a "message" entry."""
    if not path.is_file():
        return False
    message = (_read_json(path).get("modality_config") or {}).get("message")
    if message is None:
        return False
    if message.get("format", "flat") != "flat":
        raise ValueError(f"{path}: modality_config.message format {message.get('format')!r} is not supported "
                         "(supported: flat, a message's content as one string)")
    return True


def _st_pooling(path: Path) -> str:
    raw = _read_json(path)
    if raw.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt false is not supported")
    mode = raw["pooling_mode"] if "pooling_mode" in raw else [m for k, m in _ST_LEGACY_KEYS.items() if raw.get(k)]
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    # Several modes concatenate into one longer vector, which no pooler here builds.
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise ValueError(f"{path}: pooling mode {mode!r} is not supported (supported: {', '.join(_ST_MODES)})")
    return _ST_MODES[mode]


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"no {path.name} in {path.parent}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
