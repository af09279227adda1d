"""Coverage-guided fuzzing (atheris, on libFuzzer) of the parsers that read
untrusted checkpoint files: a GGUF file's header and vocabulary, a
safetensors header, a SentencePiece tokenizer.model and the vocabulary built
from it. Every input must parse or raise ValueError; any other exception is
a crash that libFuzzer reports (and saves under -artifact_prefix), and
-rss_limit_mb turns a large allocation into one too.

    python -m tests.checkpoint.fuzz_parsers gguf|safetensors|sentencepiece|all [libFuzzer flags] [corpus folder]

"all" fuzzes the three in one process, an input's first byte choosing the
parser: tests/checkpoint/test_fuzz_parsers.py runs it for a few seconds
(one process start instead of three). benchmarks/hostile_files.py runs each
alone and reports the executions.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import atheris

# Imported before instrumenting: only Octavo's parsers are traced for coverage.
import numpy  # noqa: F401
import tokenizers  # noqa: F401

from tests.checkpoint.fuzz_seeds import PARSERS

with atheris.instrument_imports(include=["octavo.checkpoint"]):
    from octavo.checkpoint.gguf_file import GgufFile
    from octavo.checkpoint.gguf_vocab import gguf_tokenizer
    from octavo.checkpoint.safetensors_header import parse_safetensors_header
    from octavo.checkpoint.sentencepiece import build_tokenizer, parse_model

WHERE = Path("fuzzed")


def gguf(data: bytes) -> None:
    file = GgufFile(WHERE, data)
    if file.get("tokenizer.ggml.tokens") is not None:
        gguf_tokenizer(file)


def safetensors(data: bytes) -> None:
    parse_safetensors_header(data, len(data), str(WHERE))


def sentencepiece(data: bytes) -> None:
    build_tokenizer(parse_model(data), str(WHERE))


TARGETS: dict[str, Callable[[bytes], None]] = {"gguf": gguf, "safetensors": safetensors,
                                               "sentencepiece": sentencepiece}


def every_parser(data: bytes) -> None:
    if data:
        TARGETS[PARSERS[data[0] % len(PARSERS)]](data[1:])


def main() -> None:
    name, flags = sys.argv[1], sys.argv[2:]
    target = every_parser if name == "all" else TARGETS[name]

    def one_input(data: bytes) -> None:
        try:
            target(data)
        except ValueError:
            pass

    atheris.Setup([sys.argv[0], *flags], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
