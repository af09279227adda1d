"""The options of the commands whose settings have no config dataclass elsewhere: ``generate``, ``run-batch``
(its files) and ``download``. Kept apart from the commands' code so that building the parser imports nothing
heavy (``run-batch`` pulls in the server)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from octavo.config import option


@dataclass
class GenerateConfig:
    """``octavo generate``'s options besides the engine's. Unset sampling options take the model's
    generation_config.json values, as the server does: tiny models loop under greedy decoding."""

    prompt: tuple[str, ...] = field(metadata={"help": "repeat for several prompts", "repeatable": True})
    max_tokens: Optional[int] = option(None, "most tokens generated per prompt; default: the model's max_new_tokens, "
                                             "else 64", unit="tokens")
    temperature: Optional[float] = option(None, "default: the model's, else 1.0")
    top_p: Optional[float] = option(None, "default: the model's, else 1.0")
    top_k: Optional[int] = option(None, "default: the model's, else off")
    chat: bool = option(False, "wrap each prompt as a user message in the chat template")


@dataclass
class BatchConfig:
    """``octavo run-batch``'s files (its other options are the engine's and the server's request handling)."""

    input_file: str = field(metadata={"help": "JSONL of {custom_id, method, url, body}; - for stdin",
                                      "aliases": ("-i",)})
    output_file: str = field(metadata={"help": "JSONL of {id, custom_id, response, error}, a line as each request "
                                               "finishes; - for stdout", "aliases": ("-o",)})


@dataclass
class DownloadConfig:
    cache_dir: Optional[str] = option(None, "where to put it (default: $OCTAVO_CACHE_DIR/models, else "
                                            "~/.cache/octavo/models)")
