"""Which tokenizer a model path holds, as one ``tokenizers`` object and the
fields of tokenizer_config.json, whatever the files:

- a folder with tokenizer.json (the Hugging Face "fast" tokenizer): read as is;
- a folder with only tokenizer.model (SentencePiece; older Llama and Mistral
  checkpoints): converted (octavo/checkpoint/sentencepiece.py), special
  tokens the config does not name taken from the model's own ids;
- a GGUF file: built from its metadata (octavo/checkpoint/gguf_vocab.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from octavo.checkpoint.bounds import (MAX_SMALL_JSON_BYTES, MAX_TOKENIZER_JSON_BYTES, read_bounded, read_json_file,
                                      short_repr)
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
    """The tokenizer at ``path`` (a folder or a GGUF file); ValueError naming what is missing
    or the file and field that is out of bounds."""
    path = Path(path)
    if is_gguf(path):
        tokenizer, config = gguf_tokenizer(open_gguf(path))
        return TokenizerFiles(tokenizer, config)
    if not path.is_dir():
        raise ValueError(f"tokenizer {str(path)!r} is neither a folder nor a GGUF file")
    config = _tokenizer_config(path / "tokenizer_config.json")
    jinja_file = path / "chat_template.jinja"
    jinja = read_bounded(jinja_file, MAX_SMALL_JSON_BYTES).decode("utf-8", "replace") if jinja_file.is_file() else None
    if (path / "tokenizer.json").is_file():
        return TokenizerFiles(_tokenizer_json(path / "tokenizer.json"), config, jinja)
    if (path / "tokenizer.model").is_file():
        vocab = read_model_file(path / "tokenizer.model")
        defaults = {"bos_token": vocab.piece(vocab.bos_id), "eos_token": vocab.piece(vocab.eos_id),
                    "unk_token": vocab.piece(vocab.unk_id), "pad_token": vocab.piece(vocab.pad_id)}
        config = {**{k: v for k, v in defaults.items() if v is not None}, **config}
        return TokenizerFiles(build_tokenizer(vocab, str(path / "tokenizer.model")), config, jinja)
    # A folder without config.json is no checkpoint at all: said too, so a model folder typed wrong reads as such.
    bare = "" if (path / "config.json").is_file() else " (nor a config.json: not a Hugging Face checkpoint folder)"
    raise ValueError(f"no tokenizer.json or tokenizer.model in {path}{bare}")


def _tokenizer_json(path: Path) -> Tokenizer:
    """tokenizer.json, its size bounded before it is read; the ``tokenizers``
    library's own checks (its types, its nesting limit) as a ValueError naming the file."""
    data = read_bounded(path, MAX_TOKENIZER_JSON_BYTES)
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    except Exception as exc:  # tokenizers raises plain Exception for every malformed document
        raise ValueError(f"{path} is not a tokenizer the tokenizers library reads: {exc}") from None


# tokenizer_config.json's fields that are read, and what each may hold.
_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _tokenizer_config(path: Path) -> dict[str, Any]:
    """tokenizer_config.json's fields ({} without one), those read type-checked:
    special tokens as text or ``{"content": text}``, add_bos_token a bool,
    chat_template text or a list of ``{"name", "template"}``."""
    if not path.is_file():
        return {}
    config = read_json_file(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    for name in _TOKEN_FIELDS:
        value = config.get(name)
        text = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(text, str):
            raise ValueError(f"{path}: {name} must be a token's text or an object with its 'content', "
                             f"got {short_repr(value)}")
    if config.get("add_bos_token") not in (None, True, False):
        raise ValueError(f"{path}: add_bos_token must be true or false, got {short_repr(config['add_bos_token'])}")
    template = config.get("chat_template")
    named = isinstance(template, list) and template and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in template)
    if template is not None and not isinstance(template, str) and not named:
        raise ValueError(f"{path}: chat_template must be text or a list of {{'name', 'template'}} objects, "
                         f"got {short_repr(template)}")
    return config
