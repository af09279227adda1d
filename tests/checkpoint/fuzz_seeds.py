"""The parsers tests/checkpoint/fuzz_parsers.py fuzzes, and a small valid
input of each for libFuzzer to mutate from. Apart from the fuzzer so that
the test and the benchmark that start it can read them without importing
atheris (importing the fuzzer instruments Octavo's modules)."""
from __future__ import annotations

import struct

PARSERS = ("gguf", "safetensors", "sentencepiece")


def _text(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


def seeds() -> dict[str, list[bytes]]:
    """Small valid inputs per parser; for "all", each behind the first byte that chooses its parser."""
    kv = [_text(b"general.architecture") + struct.pack("<I", 8) + _text(b"llama"),
          _text(b"tokenizer.ggml.model") + struct.pack("<I", 8) + _text(b"gpt2"),
          _text(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + _text(b"a") + _text(b"b") + _text(b"ab"),
          _text(b"tokenizer.ggml.merges") + struct.pack("<IIQ", 9, 8, 1) + _text(b"a b")]
    gguf_seed = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv)
    header = b'{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"__metadata__":{"format":"pt"}}'
    safetensors_seed = struct.pack("<Q", len(header)) + header + bytes(16)
    pieces = b"".join(b"\x0a" + bytes([len(p) + 9]) + b"\x0a" + bytes([len(p)]) + p + b"\x15\x00\x00\x80\xbf\x18\x01"
                      for p in (b"a", b"b", b"ab"))
    spm_seed = pieces + b"\x12\x02\x18\x02"  # trainer_spec: model_type BPE
    each = {"gguf": [gguf_seed], "safetensors": [safetensors_seed], "sentencepiece": [spm_seed]}
    each["all"] = [bytes([PARSERS.index(name)]) + seed for name in PARSERS for seed in each[name]]
    return each
