"""Which tokenizer a model path holds, as one ``tokenizers`` object and the
fields of tokenizer_config.json, whatever the files:

- a folder with tokenizer.json (the Hugging Face "fast" tokenizer): read as is;
- a folder with only tokenizer.model (SentencePiece; older Llama and Mistral
  checkpoints): converted (octavo/checkpoint/sentencepiece.py), special
  tokens the config does not name taken from the model's own ids;
- a GGUF file: built from its metadata (octavo/checkpoint/gguf_vocab.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from octavo.checkpoint.gguf_file import is_gguf, open_gguf
from octavo.checkpoint.gguf_vocab import gguf_tokenizer
from octavo.checkpoint.sentencepiece import build_tokenizer, read_model_file


@dataclass
class TokenizerFiles:
    tokenizer: Tokenizer
    config: dict[str, Any]  # tokenizer_config.json's fields
    # chat_template.jinja's text, when the folder has one
    jinja_template: str | None = None


def load_tokenizer_files(path: str | Path) -> TokenizerFiles:
    """The tokenizer at ``path`` (a folder or a GGUF file); ValueError naming what is missing."""
    path = Path(path)
    if is_gguf(path):
        tokenizer, config = gguf_tokenizer(open_gguf(path))
        return TokenizerFiles(tokenizer, config)
    if not path.is_dir():
        raise ValueError(f"tokenizer {str(path)!r} is neither a folder nor a GGUF file")
    config = read_json(path / "tokenizer_config.json")
    jinja_file = path / "chat_template.jinja"
    jinja = jinja_file.read_text() if jinja_file.is_file() else None
    if (path / "tokenizer.json").is_file():
        return TokenizerFiles(Tokenizer.from_file(str(path / "tokenizer.json")), config, jinja)
    if (path / "tokenizer.model").is_file():
        vocab = read_model_file(path / "tokenizer.model")
        defaults = {"bos_token": vocab.piece(vocab.bos_id), "eos_token": vocab.piece(vocab.eos_id),
                    "unk_token": vocab.piece(vocab.unk_id), "pad_token": vocab.piece(vocab.pad_id)}
        config = {**{k: v for k, v in defaults.items() if v is not None}, **config}
        return TokenizerFiles(build_tokenizer(vocab), config, jinja)
    # A folder without config.json is no checkpoint at all: said too, so a model folder typed wrong reads as such.
    bare = "" if (path / "config.json").is_file() else " (nor a config.json: not a Hugging Face checkpoint folder)"
    raise ValueError(f"no tokenizer.json or tokenizer.model in {path}{bare}")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)
