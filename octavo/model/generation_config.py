"""generation_config.json: the checkpoint's stop tokens and sampling defaults."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from octavo.checkpoint.bounds import read_json_file
from octavo.model.config import token_id_list


@dataclass(frozen=True)
class GenerationDefaults:
    """Fields absent from the file stay None: the caller's defaults apply."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    max_new_tokens: Optional[int] = None


def load_generation_defaults(folder: str | Path) -> GenerationDefaults:
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults()
    raw = read_json_file(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")

    def pick(key: str, kind: type) -> Optional[float | int]:
        value = raw.get(key)
        return kind(value) if value is not None else None

    max_new_tokens = pick("max_new_tokens", int)
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"{path}: max_new_tokens must be >= 1, got {max_new_tokens}")
    return GenerationDefaults(
        eos_token_ids=token_id_list(raw.get("eos_token_id"), f"{path}: eos_token_id"),
        temperature=pick("temperature", float),
        top_p=pick("top_p", float),
        top_k=pick("top_k", int),
        min_p=pick("min_p", float),
        repetition_penalty=pick("repetition_penalty", float),
        max_new_tokens=max_new_tokens,
    )
